"""Named :class:`~coordination.models.Fence` rows, locked in the writer's
transaction, for side effects that are not one row update."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any, TypeVar, overload

from django.db import DatabaseError, connections, transaction

from .. import aio, signals
from ..backends import dialect_of
from ..conf import app_settings
from ..exceptions import CoordinationError, InvalidInput, LeaseLost, WrongLock
from ..leases import Lease
from ..models import DatabaseNow, Fence, RejectionReason, validate_key
from .grants import Grants, resolve_grants, resolve_step
from .rejections import refusal_of, refuse

T = TypeVar("T")


@overload
def fence(  # type: ignore[overload-overlap]  # a str is also a Sequence[str]
    resource: str, grant: Grants | None = None, *, step: int | None = None,
    using: str | None = None, idle_timeout: float | None = None,
    key_check: Callable[[str], None] | None = None,
) -> AbstractContextManager[Fence]: ...


@overload
def fence(
    resource: Sequence[str],
    grant: Grants | None = None,
    *,
    step: int | None = None,
    using: str | None = None,
    idle_timeout: float | None = None,
    key_check: Callable[[str], None] | None = None,
) -> AbstractContextManager[list[Fence]]: ...


def fence(
    resource: str | Sequence[str],
    grant: Grants | None = None,
    *,
    step: int | None = None,
    using: str | None = None,
    idle_timeout: float | None = None,
    key_check: Callable[[str], None] | None = None,
) -> AbstractContextManager[Any]:
    """Guard a side effect with the named Fence row(s), inside one transaction.

    On entry, locks the Fence row(s) (created on first use, guarded by
    ``grant``'s lock key) with ``SELECT ... FOR UPDATE`` in resource-name order,
    so several resources in one transaction never deadlock; checks the grant's
    (token, step) against each watermark and raises the watermark. The block runs
    inside the same transaction: database writes in it commit together with the
    new watermark, or not at all. Yields the Fence (a list for several).

    ``grant`` may be several leases of different keys (a list, or the dict
    :func:`coordination.locks.acquire_many` returns), for resources guarded by
    different keys: each Fence row is checked with the lease of the key that
    guards it (rule 7 of docs/rules.md: tokens compare only within one key),
    and a row none of them guards is refused (``WrongLock``). A Fence row
    created on first use is guarded by the lease whose key is its name, or by
    the only lease; with several leases and none named like it, ``InvalidInput``
    (create the Fence row first, naming its ``lock_key``). Without ``step``,
    each lease numbers its write with its own next step.

    Refusals raise ``StaleToken``, ``DuplicateWrite``, ``WrongLock`` (the fence is
    guarded by another key) or ``LeaseLost``, before the block runs; with several
    leases, the first refused row (in resource-name order) is reported and
    nothing is written.

    The Fence rows stay locked until the transaction ends, so a holder that
    pauses inside the block (GC, SIGSTOP, a VM pause) or hangs there blocks
    every newer holder of the resource, however long ago its lease ended.
    ``idle_timeout`` (default ``COORDINATION["FENCE_IDLE_TIMEOUT"]``; None
    leaves the server's own setting) bounds that on PostgreSQL: once the
    transaction has waited that many seconds for its holder's next statement,
    the server ends the holder's session, which rolls the whole block back and
    frees the rows. The holder then gets ``LeaseLost`` (its write did not
    happen) from its next statement or from the commit. Statements that run
    for long are not idle: the bound is on the pauses between them. Keep it
    above the longest pause a live holder makes inside the block (a call to
    another service, say). SQLite has no such bound: a paused writer there
    holds the database's write lock.

    ``key_check(lock_key)`` runs for each Fence row once it is locked, before
    its watermark is compared: whatever it raises is raised, the transaction
    rolls back (a row created on first use with it) and no rejection is
    recorded. The REST API refuses there a row guarded by a key outside the
    writer's access rules, so that neither the key nor its watermark reaches
    the writer, however the writer raced the row's first write.
    """
    names = [resource] if isinstance(resource, str) else sorted(set(resource))
    if not names:
        raise InvalidInput("fence() needs at least one resource name")
    for name in names:
        validate_key(name, what="resource")
    return _fenced_block(
        names, grant, step, using or app_settings.DATABASE, isinstance(resource, str),
        idle_timeout=_idle_bound(idle_timeout), key_check=key_check,
    )


async def afence(
    resource: str | Sequence[str],
    operation: Callable[[Any], T] | None = None,
    grant: Grants | None = None,
    *,
    step: int | None = None,
    using: str | None = None,
    idle_timeout: float | None = None,
) -> T | None:
    """``fence()`` for async code: ``operation(fence)`` runs inside the fence's transaction.

    The same check as :func:`fence` (the Fence row(s) locked, the grant's
    (token, step) checked against each watermark and raised) and the same
    refusals, raised before ``operation`` runs. ``operation`` is a plain
    function that receives the Fence (a list for several) and makes the
    side effect's database writes; it runs on the app's thread pool, inside
    the fence's transaction, and its result is returned. Its writes commit
    together with the new watermark, or not at all.

    Why not ``async with``: the transaction lives on one thread's connection,
    and an async block's ORM calls run on other threads (other connections),
    outside it; a transaction held open across the event loop's awaits would
    also hold the fence's row lock for as long as the slowest await.
    """
    leases = resolve_grants(grant)
    steps = {id(lease): resolve_step(lease, step) for lease in leases}
    bound = _idle_bound(idle_timeout)

    def run() -> T | None:
        with _fenced_block(
            [resource] if isinstance(resource, str) else sorted(set(resource)),
            leases, None, using or app_settings.DATABASE, isinstance(resource, str), steps,
            idle_timeout=bound,
        ) as row:
            return None if operation is None else operation(row)

    if not resource:
        raise InvalidInput("fence() needs at least one resource name")
    for name in [resource] if isinstance(resource, str) else resource:
        validate_key(name, what="resource")
    return await aio.run_sync(run)


@contextmanager
def _fenced_block(
    names: list[str],
    grant: Grants | list[Lease] | None,
    step: int | None,
    alias: str,
    single: bool,
    steps: dict[int, int] | None = None,
    *,
    idle_timeout: float | None = None,
    key_check: Callable[[str], None] | None = None,
) -> Iterator[Any]:
    leases = resolve_grants(grant)
    by_key = {lease.key: lease for lease in leases}
    if steps is None:
        steps = {id(lease): resolve_step(lease, step) for lease in leases}
    for lease in leases:
        if lease.lost:
            refuse(
                LeaseLost(f"the lease of {lease.key!r} token {lease.token} was lost; not writing"),
                resource=names[0], grant=lease, step=steps[id(lease)],
                reason=RejectionReason.LEASE_LOST, using=alias,
            )
    refused: tuple[Fence, Lease, RejectionReason, CoordinationError] | None = None
    with _idle_bounded(alias, idle_timeout), transaction.atomic(using=alias):
        if idle_timeout is not None:
            _set_idle_timeout(alias, idle_timeout)
        rows = _locked_fences(names, _new_fence_keys(names, by_key), alias)
        if key_check is not None:
            # Under the row lock: the key read here is the one the write would meet.
            for row in rows:
                key_check(row.lock_key)
        for row in rows:
            guarding = by_key.get(row.lock_key)
            if guarding is None:
                error: CoordinationError = WrongLock(
                    f"fence {row.resource!r} is guarded by lock {row.lock_key!r}, "
                    f"not {' or '.join(repr(key) for key in by_key)}"
                )
                refused = (row, leases[0], RejectionReason.WRONG_LOCK, error)
                break
            lease = guarding
            refusal = refusal_of(row.resource, lease.token, steps[id(lease)], row.token, row.step)
            if refusal is not None:
                refused = (row, lease, *refusal)
                break
        if refused is None:
            for lease in leases:
                guarded = [row for row in rows if row.lock_key == lease.key]
                if not guarded:
                    continue
                write_step = steps[id(lease)]
                Fence.objects.using(alias).filter(pk__in=[row.pk for row in guarded]).update(
                    token=lease.token, step=write_step, updated_at=DatabaseNow()
                )
                for row in guarded:
                    row.token, row.step = lease.token, write_step
                    signals.write_accepted.send(
                        sender=Fence, resource=row.resource, grant=lease, step=write_step
                    )
            yield rows[0] if single else rows
            return
    # Refused: the transaction above changed nothing but new, empty fence rows.
    row, lease, reason, error = refused
    refuse(
        error, resource=row.resource, grant=lease, step=steps[id(lease)], reason=reason,
        watermark=(row.token, row.step), using=alias,
    )


def _idle_bound(seconds: float | None) -> float | None:
    """The idle bound of a fence() transaction: ``seconds``, else the setting."""
    value = app_settings.FENCE_IDLE_TIMEOUT if seconds is None else seconds
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < 10**6:
        raise InvalidInput(f"idle_timeout must be a number of seconds > 0, not {value!r}")
    return float(value)


def _set_idle_timeout(alias: str, seconds: float) -> None:
    """Where the database can: end this transaction's session once it idles
    ``seconds`` between statements (the transaction's alone, reset by its end)."""
    connection = connections[alias]
    dialect_of(connection).bound_idle_transaction(connection, seconds)


@contextmanager
def _idle_bounded(alias: str, seconds: float | None) -> Iterator[None]:
    """Turn the server ending an idle fence transaction into ``LeaseLost``."""
    try:
        yield
    except DatabaseError as error:
        if seconds is None or not dialect_of(connections[alias]).ended_for_idling(error):
            raise
        connections[alias].close()  # the server closed it; Django's handle is unusable
        raise LeaseLost(
            f"the fence's transaction sat idle for more than {seconds:g} s (a paused or hung "
            "holder), so the database ended it: nothing in it was written"
        ) from error


def _new_fence_keys(names: list[str], by_key: Mapping[str, Lease]) -> Callable[[str], str]:
    """Which lock key guards a Fence row ``fence()`` creates: the only lease's, or
    the key named like the resource."""
    only = next(iter(by_key)) if len(by_key) == 1 else None

    def key_of(name: str) -> str:
        if only is not None:
            return only
        if name in by_key:
            return name
        raise InvalidInput(
            f"fence {name!r} does not exist yet and none of the grants' keys "
            f"({', '.join(sorted(by_key))}) is its name: create it first with its lock_key"
        )

    return key_of


def _locked_fences(names: list[str], key_of: Callable[[str], str], alias: str) -> list[Fence]:
    rows = Fence.objects.using(alias).select_for_update().filter(resource__in=names)
    found = list(rows.order_by("resource"))
    if len(found) < len(names):
        existing = {row.resource for row in found}
        dialect_of(connections[alias]).create_missing(
            Fence.objects.using(alias),
            [Fence(resource=name, lock_key=key_of(name)) for name in names if name not in existing],
            "resource",
        )
        found = list(rows.order_by("resource"))
    return found
