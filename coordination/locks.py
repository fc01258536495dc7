"""The grant point: lease locks that issue fencing tokens.

``acquire()`` returns a :class:`~coordination.leases.Lease`, the small handle the
holder keeps (``.key .token .lease_id .holder .acquired_at .expires_at``); the
grant is also recorded as a :class:`~coordination.models.Grant` row, the audit
history. Pass the lease to ``renew`` and ``release``, and to the fenced writes
of :mod:`coordination.fencing`: a lease only says the holder *was* granted the
lock, and a paused holder does not know its lease ended, so the fences refuse
its token once a newer one has written (rules 1 and 2 of docs/rules.md).

Every grant is one atomic state change of the lock's row, made by the grant
point of the database (:func:`coordination.backends.get_backend`, chosen once
per alias): on PostgreSQL one call of a PL/pgSQL function in its own
transaction, on SQLite an ORM transaction under BEGIN IMMEDIATE, and anywhere
the portable ORM transaction with ``select_for_update``
(``COORDINATION["GRANT_POINT"] = "orm"``). Each locks the row (creating it if
missing), reads the database clock after the row lock is held, decides with the
one grant rule (free, expired, lock-delay, fair queue, tokens left), raises the
token counter by one, closes the expired previous grant and records the new
one. Whoever holds the row lock is the only one deciding, so tokens of a key
are unique and strictly increasing in grant order, and two leases of a key
never overlap in database time.

This module holds what is the same on every backend: validating input, the
lease's own state, logs and signals; waiting (back-off, wake-ups, the fair
queue) is :mod:`coordination.waiting`, the one wait loop of every acquire.

The async API (``aacquire``, ``arenew``, ``arelease``, ``ahold`` and the
:class:`~coordination.keepalive.AsyncKeepAlive` task) runs the same calls on the app's own bounded pool
of threads (:mod:`coordination.aio`), with the same guarantees and errors; a
cancelled coroutine never leaves a lease behind (docs/async.md).
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import threading
import time
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping
from contextlib import asynccontextmanager, contextmanager, suppress
from typing import ParamSpec, TypeVar

from . import aio, signals
from .backends import get_backend
from .conf import app_settings
from .exceptions import InvalidInput, LeaseLost
from .keepalive import AsyncKeepAlive
from .leases import Lease, _current_grant, current_grant, use_grant
from .logfields import LogFields
from .models import (
    DatabaseNow,
    Grant,
    GrantEnd,
    Lock,
    hash_lease_id,
    lease_matches,
    validate_holder,
    validate_key,
)
from .renewal import database_now, renew
from .waiting import (
    Waiter,
    announce_grant,
    await_grant,
    grant_point_call,
    grant_timings,
    wait_for_grant,
)

__all__ = [
    "MAX_KEYS_AT_ONCE",
    "AsyncKeepAlive",
    "Lease",
    "aacquire",
    "aacquire_many",
    "acquire",
    "acquire_many",
    "ahold",
    "arelease",
    "arenew",
    "current_grant",
    "database_now",
    "grant_from_proof",
    "hold",
    "reentrant_count",
    "release",
    "release_many",
    "renew",
    "revoke",
    "use_grant",
]

logger = logging.getLogger("coordination.locks")

_P = ParamSpec("_P")
_R = TypeVar("_R")

def acquire(
    key: str,
    *,
    holder: str,
    ttl: float | None = None,
    wait: float = 0.0,
    fair: bool = False,
    lock_delay: float | None = None,
    reentrant: bool = False,
    using: str | None = None,
) -> Lease:
    """Grant the lock ``key`` to ``holder`` for ``ttl`` seconds of database time.

    Returns the :class:`~coordination.leases.Lease` with ``.key``, ``.token``
    (strictly greater than every earlier token of ``key``), ``.lease_id`` (the
    secret that ``renew`` and ``release`` need), ``.holder``, ``.acquired_at``
    and ``.expires_at``. The grant is recorded as a Grant row before this returns.

    With ``wait`` > 0, blocks up to that many seconds, waking when the current
    lease ends, when it is released or revoked (PostgreSQL LISTEN/NOTIFY, a hint
    that is always re-checked), or after a back-off step with jitter. With
    ``fair=True`` the waiter takes a ticket in the key's queue and waiters are
    granted in ticket order; a waiter that gives up leaves the queue.
    ``lock_delay`` (default ``COORDINATION["LOCK_DELAY"]``) keeps the lock
    ungrantable for that many seconds if this lease expires or is revoked.

    With ``reentrant=True``, an execution (this thread, or this asyncio task)
    that already holds ``key`` through a reentrant acquire of the same holder
    gets the same lease back (same token), counted, without a database call;
    the lease ends with the release that matches the outermost acquire
    (:func:`reentrant_count`). Any other execution is refused as before: the
    lock stays exclusive. Reentry reads the lock's row once, to check that the
    lease is still the live one by the database clock; it does not extend it
    (renew it as usual). A lease released, expired, taken over or marked lost
    is never reentered: it is marked lost and the call asks the grant point for
    a new grant. Without ``reentrant`` (the default) a second acquire of a held
    key is refused, even by its holder.

    Raises ``LockHeld`` (who holds it, until when, ``retry_after`` seconds) if still
    busy, ``InvalidInput`` for a bad key, holder, ttl, wait or lock_delay,
    ``TokenExhausted`` after token 2**63 - 1, and ``InTransaction`` inside
    ``transaction.atomic()``.
    """
    key = validate_key(key)
    holder = validate_holder(holder)
    if reentrant:
        entered = _reenter(key, holder, using)
        if entered is not None:
            return entered
    lease_seconds, wait, delay = grant_timings(ttl, wait, lock_delay)
    backend = get_backend(using)
    started = time.monotonic()
    if wait == 0:
        # One attempt, granted or refused: the wait loop would add nothing but its own cost.
        with grant_point_call("acquire", key, using):
            acquired = backend.acquire(key, holder, lease_seconds, delay, None)
    else:
        acquired = wait_for_grant(
            lambda ticket: backend.acquire(key, holder, lease_seconds, delay, ticket),
            wait=wait, waiter=Waiter(backend, key, holder, fair=fair, wait=wait), key=key,
            using=using,
        )
    lease = announce_grant(acquired, holder, time.monotonic() - started)
    if reentrant:
        _held_here()[(_alias(using), key)] = _Reentry(lease, _execution())
    return lease


def release(grant: Lease, *, using: str | None = None) -> Lease:
    """End the lease ``grant``; the lock is free at once. Returns the same lease,
    with ``ended_at`` and ``end_reason`` (``"released"``) set.

    Only the current holder's lease is released, never a newer holder's. Raises
    ``LeaseLost`` if it is no longer the current lease; if it merely expired and
    nobody took the lock since, the lock is freed and the grant recorded as
    expired (``end_reason`` ``"expired"``, and the lease marked lost) before
    ``LeaseLost`` is raised, so the caller learns that its work ran past its lease.

    A lease this execution acquired with ``reentrant=True`` more than once is
    only counted down (no database call) until the release that matches the
    outermost acquire, which ends it.
    """
    if _leave(grant, using):
        return grant
    backend = get_backend(using)
    with grant_point_call("release", grant.key, using):
        ended = backend.release(grant)
    grant.ended_at, grant.end_reason = ended.ended_at, ended.reason
    if ended.expired_at is not None:
        grant.mark_lost()
        signals.lock_expired.send(
            sender=Grant, key=grant.key, token=grant.token, holder=grant.holder,
            acquired_at=grant.acquired_at, expired_at=ended.expired_at,
        )
        raise LeaseLost(
            f"lease of {grant.key!r} token {grant.token} expired at "
            f"{ended.expired_at.isoformat()} before release; the lock is now free"
        )
    if logger.isEnabledFor(logging.DEBUG):  # per release, as per grant: DEBUG (waiting.py)
        logger.debug("lock released %s", LogFields(key=grant.key, token=grant.token))
    signals.lock_released.send(sender=Grant, grant=grant, reason=ended.reason)
    return grant


def revoke(key: str, *, using: str | None = None) -> Grant | None:
    """Operator take-over: end the current lease of ``key`` (held or expired).

    The holder's renew and release fail from now on with ``LeaseLost`` (every
    reader's, for a key held in shared mode), and the next acquire gets a
    higher token, whose first write fences the revoked
    holder out. Returns the revoked :class:`~coordination.models.Grant` row (the
    audit record: the operator holds no lease), or None if the lock was free.
    """
    key = validate_key(key)
    backend = get_backend(using)
    revoked = backend.revoke(key)
    if revoked is None:
        return None
    logger.warning(
        "lock revoked %s", LogFields(key=key, token=revoked.token, holder=revoked.holder)
    )
    signals.lock_released.send(sender=Grant, grant=revoked, reason=GrantEnd.REVOKED)
    return revoked


@contextmanager
def hold(
    key: str,
    *,
    holder: str,
    ttl: float | None = None,
    wait: float = 0.0,
    reentrant: bool = False,
    using: str | None = None,
) -> Iterator[Lease]:
    """Acquire ``key``, make the lease current for fenced writes, release on exit.

    If the block succeeded but the lease was lost meanwhile, release raises
    ``LeaseLost`` so the caller learns its work ran unprotected by the lease (the
    fenced writes inside it were still checked). With ``reentrant=True`` a
    nested ``hold`` of the same key and holder in the same execution yields the
    outer lease, and only the outermost block's exit releases it.
    """
    grant = acquire(key, holder=holder, ttl=ttl, wait=wait, reentrant=reentrant, using=using)
    try:
        with use_grant(grant):
            yield grant
    except BaseException:
        with suppress(LeaseLost):
            release(grant, using=using)
        raise
    release(grant, using=using)


# --- reentrancy within one execution ----------------------------------------------
#
# One execution is one thread, or one asyncio task on it: a task that a holder
# starts is another execution (it could run while the holder waits), and so is
# a thread of a pool. The registry lives in a context variable (a new thread
# starts with an empty one; a task starts with its creator's, which is why
# every entry also names the execution that made it), so reentry never needs
# the database and never crosses executions.


class _Reentry:
    __slots__ = ("count", "execution", "lease")

    def __init__(self, grant: Lease, execution: tuple[int, int]) -> None:
        self.lease, self.execution, self.count = grant, execution, 1


_reentries: contextvars.ContextVar[dict[tuple[str, str], _Reentry] | None] = (
    contextvars.ContextVar("coordination_reentries", default=None)
)


def _execution() -> tuple[int, int]:
    """This thread, and the asyncio task running on it (0: none)."""
    try:
        task = asyncio.current_task()
    except RuntimeError:  # no event loop in this thread
        task = None
    return threading.get_ident(), 0 if task is None else id(task)


def _held_here() -> dict[tuple[str, str], _Reentry]:
    held = _reentries.get()
    if held is None:
        held = {}
        _reentries.set(held)
    return held


def _alias(using: str | None) -> str:
    return using or app_settings.DATABASE


def _reenter(key: str, holder: str, using: str | None) -> Lease | None:
    held = _reentries.get()
    entry = None if held is None else held.get((_alias(using), key))
    if entry is None or entry.execution != _execution():
        return None
    lease = entry.lease
    if lease.holder != holder:
        return None  # another holder is another party: the grant point refuses it
    if lease.ended_at is not None or lease.lost or not _still_live(lease, using):
        # Released without the count, lost, expired or taken over: never reentered.
        # The entry goes; the caller asks the grant point for a new grant.
        if lease.ended_at is None:
            lease.mark_lost()
        assert held is not None
        del held[(_alias(using), key)]
        return None
    entry.count += 1
    return lease


def _still_live(grant: Lease, using: str | None) -> bool:
    """Whether ``grant`` is its lock's live lease by the database clock (rule 11 of
    docs/rules.md): one read, so that a lease left behind by a caller that never
    released it (a thread of a pool runs many jobs) is not handed out again."""
    return (
        Lock.objects.using(_alias(using))
        .filter(
            key=grant.key, token=grant.token, holder=grant.holder,
            lease_hash=hash_lease_id(grant.lease_id), expires_at__gt=DatabaseNow(),
        )
        .exists()
    )


def _leave(grant: Lease, using: str | None) -> bool:
    """Count down a reentered lease; True if it stays held (no release due)."""
    held = _reentries.get()
    slot = (_alias(using), grant.key)
    entry = None if held is None else held.get(slot)
    if entry is None or entry.lease is not grant or entry.execution != _execution():
        return False
    assert held is not None
    entry.count -= 1
    if entry.count > 0:
        return True
    del held[slot]
    return False


def reentrant_count(grant: Lease, *, using: str | None = None) -> int:
    """How many reentrant acquires of ``grant`` this execution has not released yet
    (0 if it holds ``grant`` through none)."""
    held = _reentries.get()
    entry = None if held is None else held.get((_alias(using), grant.key))
    if entry is None or entry.lease is not grant or entry.execution != _execution():
        return 0
    return entry.count


# --- several keys at once ---------------------------------------------------------

MAX_KEYS_AT_ONCE = 100
"""The most keys one ``acquire_many`` grants (one transaction holds their row locks)."""


def acquire_many(
    keys: Iterable[str],
    *,
    holder: str,
    ttl: float | None = None,
    wait: float = 0.0,
    lock_delay: float | None = None,
    using: str | None = None,
) -> dict[str, Lease]:
    """Grant every key of ``keys`` to ``holder``, all or none, in one transaction.

    Returns ``{key: lease}`` in sorted key order; each lease is an ordinary
    lease of its key (its own token, strictly greater than every earlier token
    of that key, rule 3 of docs/rules.md), renewed and released on its own or
    with :func:`release_many`, and the dict is accepted as it is by
    :func:`coordination.fencing.fence` for resources guarded by those keys.

    The grant point grants the keys in sorted order inside one transaction of
    its own, each with the grant rule of a single acquire; if one key is
    refused, none is granted (the transaction rolls back). Because every set is
    taken in the same order and nothing waits for a lease inside the
    transaction, overlapping sets never deadlock. With ``wait`` > 0 the whole
    set is tried again (back-off with jitter, up to the refusing lease's end)
    until it is granted or ``wait`` seconds pass, woken early by a release or
    revoke of any of its keys (LISTEN/NOTIFY on PostgreSQL); a set is never
    held in part while waiting. Sets do not queue: a waiting set takes no
    ticket, and every fair waiter (``acquire(..., fair=True)``) of one of its
    keys is served first.

    Raises ``LockHeld`` for the first refused key (in sorted order),
    ``InvalidInput`` for no key, more than :data:`MAX_KEYS_AT_ONCE` keys, a bad
    key or any of the errors of :func:`acquire`, ``TokenExhausted`` and
    ``InTransaction`` as :func:`acquire` does.
    """
    if isinstance(keys, str):
        raise InvalidInput("acquire_many takes a collection of keys, not one key")
    ordered = sorted({validate_key(key) for key in keys})
    if not ordered:
        raise InvalidInput("acquire_many needs at least one key")
    if len(ordered) > MAX_KEYS_AT_ONCE:
        raise InvalidInput(f"acquire_many takes at most {MAX_KEYS_AT_ONCE} keys, not {len(ordered)}")
    holder = validate_holder(holder)
    lease_seconds, wait, delay = grant_timings(ttl, wait, lock_delay)
    backend = get_backend(using)
    started = time.monotonic()
    # Woken by a release or revoke of any key of the set (PostgreSQL), else
    # polling; the whole set is tried again each time.
    waiter = Waiter(backend, ordered[0], holder, fair=False, wait=wait, wake_keys=ordered)
    granted = wait_for_grant(
        lambda _: backend.acquire_many(ordered, holder, lease_seconds, delay),
        wait=wait, waiter=waiter, key=", ".join(ordered), using=using,
    )
    waited = time.monotonic() - started
    for acquired in granted:
        announce_grant(acquired, holder, waited)
    return {lease.key: lease for lease, _ in granted}


def release_many(
    grants: Iterable[Lease] | Mapping[str, Lease], *, using: str | None = None
) -> list[Lease]:
    """Release every lease of ``grants`` (a list, or the dict of :func:`acquire_many`).

    Each is released on its own (:func:`release`), in key order, all of them
    even if one fails; then the first ``LeaseLost`` is raised, if any, so the
    caller learns that part of its work ran past a lease. Returns the leases.
    """
    leases = list(grants.values()) if isinstance(grants, Mapping) else list(grants)
    leases.sort(key=lambda lease: lease.key)
    lost: list[LeaseLost] = []
    for lease in leases:
        try:
            release(lease, using=using)
        except LeaseLost as error:
            lost.append(error)
    if lost:
        raise lost[0]
    return leases


def grant_from_proof(
    key: str, token: int, lease_id: str, *, using: str | None = None
) -> Lease:
    """Rebuild a lease from its proof (key, token, lease_id), as REST clients present it.

    Raises ``LeaseLost`` unless ``lease_id`` is the secret of the grant ``token`` of
    ``key`` (compared in constant time) and that grant was not revoked. Whether a
    newer token has written is for the fence to decide.
    """
    key = validate_key(key)
    alias = using or app_settings.DATABASE
    found = Grant.objects.using(alias).filter(lock__key=key, token=token).first()
    if found is None or not lease_matches(found.lease_hash, lease_id):
        raise LeaseLost(f"no grant of {key!r} with token {token} matches this lease_id")
    if found.end_reason == GrantEnd.REVOKED:
        raise LeaseLost(f"grant {token} of {key!r} was revoked")
    return Lease(
        key=key, token=found.token, lease_id=lease_id, holder=found.holder,
        acquired_at=found.acquired_at, expires_at=found.expires_at,
        ended_at=found.ended_at, end_reason=found.end_reason, mode=found.mode,
    )


# --- the async API ---------------------------------------------------------------


async def aacquire(
    key: str,
    *,
    holder: str,
    ttl: float | None = None,
    wait: float = 0.0,
    lock_delay: float | None = None,
    using: str | None = None,
) -> Lease:
    """``acquire()`` for async code: the same grant, guarantees and errors.

    Each attempt is one ``acquire()`` call on the app's thread pool
    (:mod:`coordination.aio`), never inside a transaction of the caller. With
    ``wait`` > 0 the coroutine sleeps between attempts (back-off with jitter,
    up to the holder's remaining lease), holding no thread while it waits;
    ``fair=True`` queueing is for sync callers only.

    Cancelled while an attempt runs, the attempt still completes on its
    thread (a database call cannot be interrupted half way), and a lease it
    granted is released there at once: a cancelled ``aacquire`` never leaves a
    lock held. Cancelled before a thread took the attempt, nothing runs.
    """

    def attempt() -> Lease:
        return acquire(key, holder=holder, ttl=ttl, wait=0.0, lock_delay=lock_delay, using=using)

    return await await_grant(attempt, wait=wait, release=functools.partial(release, using=using))


async def aacquire_many(
    keys: Iterable[str],
    *,
    holder: str,
    ttl: float | None = None,
    wait: float = 0.0,
    lock_delay: float | None = None,
    using: str | None = None,
) -> dict[str, Lease]:
    """``acquire_many()`` for async code: the same all-or-none grant, guarantees and errors.

    Each attempt is one ``acquire_many()`` call (``wait=0``) on the app's thread
    pool; between attempts the coroutine sleeps holding no thread. Cancelled
    while an attempt runs, the attempt completes on its thread and a set it
    granted is released there at once, as with :func:`aacquire`.
    """
    if isinstance(keys, str):
        raise InvalidInput("aacquire_many takes a collection of keys, not one key")
    wanted = list(keys)

    def attempt() -> dict[str, Lease]:
        return acquire_many(wanted, holder=holder, ttl=ttl, lock_delay=lock_delay, using=using)

    return await await_grant(attempt, wait=wait, release=functools.partial(release, using=using))


async def arenew(grant: Lease, *, ttl: float | None = None, using: str | None = None) -> Lease:
    """``renew()`` for async code: the same guarantee and errors (``LeaseLost``).

    A renewal already running when the caller is cancelled completes on its thread.
    """
    return await aio.run_sync(renew, grant, ttl=ttl, using=using)


async def arelease(grant: Lease, *, using: str | None = None) -> Lease:
    """``release()`` for async code: the same guarantee and errors (``LeaseLost``).

    The release runs to its end even if the caller is cancelled, before or while
    it runs, and the cancelled caller does not wait for it: a cancellation
    never leaves the lock held until its lease expires, and never hangs.
    """
    return await aio.run_to_completion(release, grant, using=using)


@asynccontextmanager
async def ahold(
    key: str,
    *,
    holder: str,
    ttl: float | None = None,
    wait: float = 0.0,
    keepalive: bool = False,
    using: str | None = None,
) -> AsyncIterator[Lease]:
    """``hold()`` for async code: ``async with ahold(key, holder=...) as grant:``.

    Acquires (``aacquire``), makes the lease current for fenced writes in the
    block (``current_grant()``, ``afenced_update``), and releases it on every
    exit, a cancellation included (``arelease``: the release completes even if
    the coroutine is cancelled again while it runs). With ``keepalive=True`` an
    :class:`~coordination.keepalive.AsyncKeepAlive` task renews the lease while
    the block runs. As with ``hold()``, a block that succeeded after its lease
    was lost ends with ``LeaseLost`` from the release.
    """
    lease_seconds = app_settings.DEFAULT_TTL if ttl is None else ttl
    grant = await aacquire(key, holder=holder, ttl=ttl, wait=wait, using=using)
    keeper = AsyncKeepAlive(grant, ttl=lease_seconds, using=using).start() if keepalive else None
    reset = _current_grant.set(grant)
    try:
        try:
            yield grant
        except BaseException:
            try:
                if keeper is not None:
                    await keeper.stop()
            finally:
                with suppress(LeaseLost):
                    await arelease(grant, using=using)
            raise
        try:
            if keeper is not None:
                await keeper.stop()
        finally:
            await arelease(grant, using=using)
    finally:
        _current_grant.reset(reset)
