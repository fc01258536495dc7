"""Tasks whose failure a caller reads back through a real result backend.

Each raises the app's error the way production code meets it: a stale token
refused by a real fence, a lock held by another holder.
"""

from __future__ import annotations

from celery import shared_task

from coordination import locks
from coordination.fencing import fence


@shared_task
def write_with_a_stale_token(key: str) -> None:
    """Two grants of ``key`` write to its fence in turn; the older one writes last."""
    older = locks.acquire(key, holder="older", ttl=30)
    locks.release(older)
    newer = locks.acquire(key, holder="newer", ttl=30)
    with fence(key, newer):
        pass
    locks.release(newer)
    with fence(key, older):  # raises StaleToken: the fence has accepted ``newer``
        pass


@shared_task
def acquire_without_waiting(key: str) -> None:
    """Raises LockHeld while the caller holds ``key``."""
    locks.release(locks.acquire(key, holder="task", ttl=30, wait=0))
