"""Stranded executions: fenced tasks whose worker was lost, listed and cleared.

Each execution of a fenced task records its grant when it starts
(:func:`coordination.jobs.record_execution`). A worker that dies without
releasing (SIGKILL, an OOM kill, a hard time limit, a machine gone) leaves its
lease to run out. Until the key is granted again, the lock still names that
dead grant as its lease, expired by the database clock: the execution is
*stranded*. Nothing is blocked for good (the next acquire of the key takes an
expired lease over), but the dead grant's token is still the highest its
resources have seen: a copy of the execution that was only paused (SIGSTOP,
a VM or GC pause) and wakes up can still write under it, wherever no newer
token has written yet.

:func:`clear` ends such an execution's lease and fences it out: the grant point
grants the key to the operator (only if the dead lease is still the key's
lease, expired: a worker that took the key meanwhile keeps it), which ends the
dead lease and issues the next token; every watermark this database holds for
the key (its Fence rows, the fenced document store's, and the FencedModel
rows the key guards) is raised to that token, so a write of the dead token is
refused as stale (``StaleToken``); then the operator's lease is released. The
execution's permits (``max_running``'s and the cap per key's), if it holds any,
are cleared the same way.
"""

from __future__ import annotations

import datetime as dt
import logging
from dataclasses import dataclass, field

from django.core.exceptions import ValidationError
from django.db import router
from django.db.models import OuterRef, Subquery

from . import locks
from .conf import app_settings
from .exceptions import LockHeld
from .fenced.conditions import admitted_rows
from .fenced.keys import lock_binding
from .fencing import raise_fence_to_lock
from .jobs import HeldLeases
from .leases import Lease
from .logfields import LogFields
from .models import Execution, Fence, Lock
from .restore import fenced_models

__all__ = ["Cleared", "Stranded", "clear", "count", "holder_of", "stranded_executions"]

logger = logging.getLogger("coordination.tasks")

# The operator's own lease, held while the watermarks are raised: long enough
# for that, short enough that a web process dying meanwhile frees it soon.
CLEAR_TTL = 30.0


@dataclass(frozen=True)
class Stranded(HeldLeases):
    """One stranded execution: what it recorded at its start, and its dead lease.

    ``last_renewal`` is when the lease was last extended: its end minus its
    length (the keep-alive renews to the length it was granted with); None for
    an execution recorded before executions kept their lease's length.
    """

    pk: int
    task: str
    task_id: str
    attempt: int
    worker: str
    key: str
    token: int
    holder: str
    permit: str
    permit_token: int | None
    cap_permit: str
    cap_permit_token: int | None
    started_at: dt.datetime
    expired_at: dt.datetime
    ttl: float | None

    @property
    def last_renewal(self) -> dt.datetime | None:
        if self.ttl is None:
            return None
        return self.expired_at - dt.timedelta(seconds=self.ttl)


def stranded_executions(
    *, task: str | None = None, pks: list[int] | None = None, limit: int = 200,
    using: str | None = None,
) -> list[Stranded]:
    """The stranded executions (of ``task``, or among ``pks``), the oldest first, at
    most ``limit``. Decided by the database clock, in one statement."""
    alias = using or app_settings.DATABASE
    lock = Lock.objects.using(alias).filter(key=OuterRef("lock_key"))
    rows = Execution.objects.using(alias).stranded().annotate(
        expired_at=Subquery(lock.values("expires_at")[:1]),
        holder=Subquery(lock.values("holder")[:1]),
    )
    if task is not None:
        rows = rows.filter(task=task)
    if pks is not None:
        rows = rows.filter(pk__in=pks)
    found = rows.order_by("started_at", "id").values_list(
        "pk", "task", "task_id", "attempt", "worker", "lock_key", "token", "holder",
        "permit_key", "permit_token", "cap_permit_key", "cap_permit_token", "started_at",
        "expired_at", "ttl",
    )[:limit]
    return [Stranded(*row) for row in found]


def count(*, using: str | None = None) -> int:
    """How many executions are stranded now (the metric's gauge)."""
    return Execution.objects.using(using or app_settings.DATABASE).stranded().count()


def holder_of(by: str) -> str:
    """The holder the operator's lease is granted to: who clears, and why."""
    return f"operator {by or 'unknown'}: clearing a stranded execution"[:200]


@dataclass(frozen=True)
class Cleared:
    """What :func:`clear` did: the token every watermark of the key now stands at
    (the operator's, never used to write), how many watermarks it raised, and the
    same for each permit, by its key (a permit a live holder took meanwhile is
    not there)."""

    execution: Stranded
    token: int
    raised: int
    permits: dict[str, tuple[int, int]] = field(default_factory=dict)

    @property
    def permit_token(self) -> int | None:
        """The token ``max_running``'s permit is fenced at (None: not cleared)."""
        return self.permits.get(self.execution.permit, (None, 0))[0]

    @property
    def cap_permit_token(self) -> int | None:
        """The token the cap per key's permit is fenced at (None: not cleared)."""
        return self.permits.get(self.execution.cap_permit, (None, 0))[0]

    @property
    def summary(self) -> str:
        """What was done, as the audit trail records it."""
        execution = self.execution
        permit = "".join(
            f"; its permit {key} fenced at token {token}" for key, (token, _) in self.permits.items()
        )
        return (
            f"Cleared the stranded execution {execution.task}[{execution.task_id}]"
            f"#{execution.attempt} of {execution.worker or 'an unknown worker'} (token "
            f"{execution.token}, lease expired {execution.expired_at.isoformat()}): its lease "
            f"ended and {self.raised} watermark(s) raised to token {self.token}, so token "
            f"{execution.token} can no longer write{permit}."
        )


def clear(execution: Stranded, *, by: str, using: str | None = None) -> Cleared | None:
    """End ``execution``'s dead lease and fence its token out (see the module's
    docstring); None if it is no longer stranded (released late, taken over by a
    new grant, or cleared by someone else meanwhile: nothing to do).

    ``LockHeld`` if the key cannot be granted yet although the execution is still
    stranded (a lock-delay after the dead lease, fair waiters queued first: those
    take the key over soon, which ends the stranding too); its message says why.
    """
    alias = using or app_settings.DATABASE
    lease = _take_over(execution, execution.key, by, alias)
    if lease is None:
        return None
    try:
        raised = raise_watermarks(execution.key, lease.token, using=alias)
    finally:
        locks.release(lease, using=alias)
    permits: dict[str, tuple[int, int]] = {}
    for key in execution.permits:
        permit = _take_over(None, key, by, alias)
        if permit is not None:
            try:
                permits[key] = (permit.token, raise_watermarks(key, permit.token, using=alias))
            finally:
                locks.release(permit, using=alias)
    logger.warning(
        "stranded execution cleared %s",
        LogFields(
            task=execution.task, task_id=execution.task_id, attempt=execution.attempt,
            worker=execution.worker, key=execution.key, token=execution.token,
            fenced_at=lease.token, raised=raised, by=by,
        ),
    )
    return Cleared(execution, lease.token, raised, permits)


def _take_over(execution: Stranded | None, key: str, by: str, alias: str) -> Lease | None:
    """The operator's lease of ``key``, granted over the dead lease; None if the
    execution is no longer stranded. Any grant of the key is above the dead token,
    so raising the watermarks to the one granted here is right whichever lease it
    ended (a permit's slot may have been taken and freed again meanwhile)."""
    if execution is not None and not stranded_executions(pks=[execution.pk], limit=1, using=alias):
        return None
    try:
        return locks.acquire(key, holder=holder_of(by), ttl=CLEAR_TTL, lock_delay=0, using=alias)
    except LockHeld:
        if execution is None or not stranded_executions(pks=[execution.pk], limit=1, using=alias):
            return None  # a live holder has it now: a newer token than the dead one
        raise


def raise_watermarks(key: str, token: int, *, using: str | None = None) -> int:
    """Raise every watermark this database holds for ``key`` to ``(token, 0)``, the
    token's own writes (steps from 1) still admitted, every older token refused:
    the key's Fence rows and the FencedModel rows it guards. Never lowers one.
    Returns how many it raised."""
    alias = using or app_settings.DATABASE
    raised = 0
    for resource in Fence.objects.using(alias).filter(lock_key=key).values_list("resource", flat=True):
        raised += int(raise_fence_to_lock(resource, step=0, using=alias).raised)
    for model in fenced_models():
        binding = lock_binding(model, key)
        if binding is None:
            continue
        rows = model._base_manager.using(router.db_for_write(model))
        try:
            below, fits = admitted_rows(rows, token, 0, binding)
            raised += below.update(fence=token, fence_step=0) if fits else 0
        except (ValueError, ValidationError):
            continue  # the key's values cannot be this model's: it guards no row here
    return raised
