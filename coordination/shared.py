"""Shared (read) grants: many readers of a key at once, writers exclusive, all fenced.

::

    from coordination import locks
    from coordination.shared import acquire_shared

    reader = acquire_shared("report:7", holder="renderer-2", ttl=30)
    try:
        figures = read_figures()                     # many readers at once
        with fence("report-cache:7", reader):        # refused once a writer wrote
            store(render(figures))
    finally:
        locks.release(reader)

    writer = locks.acquire("report:7", holder="importer", ttl=30)   # waits for no reader

A reader's grant is a :class:`~coordination.leases.Lease` with ``mode``
``"shared"`` and a token of the key's one counter: readers and writers of a
key draw their tokens from the same strictly increasing sequence (rule 3 of
docs/rules.md). A writer is granted only once no reader's lease runs, so its
token is greater than every reader token issued before it, and a resource that
accepted the writer's write refuses a reader's late, read-derived write
(rules 1, 2 and 4). Writers use the ordinary ``locks.acquire``: their rules are
unchanged. Renew, release, keep-alives, ``use_grant`` and the fences take a
reader's lease as any lease.

The grant point's side is :class:`coordination.backends.shared.SharedLeases`.
"""

from __future__ import annotations

import functools
import time

from .backends import get_backend
from .leases import Lease
from .locks import release
from .models import validate_holder, validate_key
from .waiting import Waiter, announce_grant, await_grant, grant_timings, wait_for_grant

__all__ = ["aacquire_shared", "acquire_shared"]

def acquire_shared(
    key: str,
    *,
    holder: str,
    ttl: float | None = None,
    wait: float = 0.0,
    fair: bool = False,
    lock_delay: float | None = None,
    using: str | None = None,
) -> Lease:
    """Grant ``key`` to ``holder`` as a reader (shared mode) for ``ttl`` seconds.

    Granted while other readers hold ``key``, refused while a writer (an
    ordinary ``locks.acquire``) holds it, its lock-delay runs, or a fair waiter
    (``acquire(..., fair=True)``) is queued: a writer that must not wait behind
    a stream of readers queues fairly. Returns a lease with ``mode="shared"``
    and the key's next token, so every writer granted later holds a greater
    token; the Grant row records the mode. While readers hold the key, the
    lock's row shows them as one holder (``"2 shared holders"``) whose lease
    ends with the last reader's, and writers are refused until then.

    With ``wait`` > 0 the attempt is repeated (back-off with jitter, up to the
    end of the writer's lease) until granted or ``wait`` seconds pass, woken
    early by the writer's release or revoke (LISTEN/NOTIFY on PostgreSQL).
    With ``fair=True`` a waiting reader takes a ticket in the key's queue, the
    queue writers join with ``acquire(..., fair=True)``: readers and writers
    are then served in arrival order (a reader queued behind a writer waits
    for it; readers next to one another in the queue join one group), and a
    reader that gives up leaves the queue. Without it a reader takes no
    ticket and every queued waiter is served first.

    Raises ``LockHeld`` (who holds it, until when, ``retry_after``),
    ``InvalidInput`` for a bad key, holder, ttl, wait or lock_delay,
    ``TokenExhausted`` and ``InTransaction`` as ``locks.acquire`` does.
    """
    key = validate_key(key)
    holder = validate_holder(holder)
    lease_seconds, wait, delay = grant_timings(ttl, wait, lock_delay)
    backend = get_backend(using)
    started = time.monotonic()
    # Woken by the writer's release or revoke (PostgreSQL), else polling.
    acquired = wait_for_grant(
        lambda ticket: backend.acquire_shared(key, holder, lease_seconds, delay, ticket),
        wait=wait, waiter=Waiter(backend, key, holder, fair=fair, wait=wait), key=key, using=using,
    )
    return announce_grant(acquired, holder, time.monotonic() - started, mode=acquired.lease.mode)


async def aacquire_shared(
    key: str,
    *,
    holder: str,
    ttl: float | None = None,
    wait: float = 0.0,
    lock_delay: float | None = None,
    using: str | None = None,
) -> Lease:
    """``acquire_shared()`` for async code: the same grant, guarantees and errors.

    Each attempt is one ``acquire_shared()`` call (``wait=0``) on the app's
    thread pool; a grant made for a coroutine cancelled meanwhile is released
    at once (``waiting.await_grant``).
    """

    def attempt() -> Lease:
        return acquire_shared(key, holder=holder, ttl=ttl, lock_delay=lock_delay, using=using)

    return await await_grant(attempt, wait=wait, release=functools.partial(release, using=using))
