"""Counting semaphores whose permits are fenced: at most N holders, each slot its own lock.

``acquire_permit(name, limit=N, holder=...)`` grants one of the N slots of the
semaphore ``name``. Each slot is an ordinary lock key, ``<name>@<slot>`` for
slots 1 to N, granted by the grant point with the grant rule of every lock
(docs/rules.md): so each slot has its own strictly increasing token (rule 3),
and a resource written under a permit is fenced by its slot's key. A holder of
slot 2 that pauses past its lease, while another holder is granted slot 2,
is refused by the fences of ``<name>@2`` when it resumes (rules 1 and 2),
while the other slots run on.

The permit is a :class:`~coordination.leases.Lease` of its slot's key: renew,
release, ``hold``-like use (``use_grant``), keep-alives and fences take it as
they take any lease. :func:`aacquire_permit` is the async twin.

Waiters queue in arrival order (a ticket in the semaphore's queue, ``<name>@*``)
and are woken when a slot is released (LISTEN/NOTIFY on PostgreSQL, polling
elsewhere). The queue decides only who asks first: every grant is still the
grant point's decision on one slot's row, so the queue never affects how many
permits are live or which tokens they carry.
"""

from __future__ import annotations

import functools
import random
import re
import time

from django.db.models import Q

from .backends import get_backend
from .backends.base import Acquired, GrantPoint, refuse_in_caller_transaction
from .conf import app_settings
from .exceptions import InvalidInput, LockHeld
from .leases import Lease
from .locks import database_now, release
from .models import DatabaseNow, Lock, validate_holder, validate_key
from .waiting import Waiter, announce_grant, await_grant, grant_timings, wait_for_grant

__all__ = [
    "MAX_PERMITS", "aacquire_permit", "acquire_permit", "parse_slot_key", "permit_keys",
    "permit_queue", "permit_slot", "slot_key",
]

MAX_PERMITS = 1000
"""The largest ``limit`` of a semaphore."""

SLOT_SEPARATOR = "@"
QUEUE_SUFFIX = "*"
"""The queue of semaphore ``name`` is ``<name>@*``: ``*`` is not a key character,
so no lock key is ever the name of a semaphore's queue."""


QUEUE_KEY_SUFFIX = f"{SLOT_SEPARATOR}{QUEUE_SUFFIX}"
"""``@*``: what a semaphore's name ends with to name its queue (and, in the
dashboard's ``key`` parameter, the whole semaphore)."""

_SLOT_KEY = re.compile(rf"(?P<name>.+){SLOT_SEPARATOR}(?P<slot>[1-9][0-9]*)")


def slot_key(name: str, slot: int) -> str:
    """The lock key of slot ``slot`` of semaphore ``name``: ``<name>@<slot>``."""
    return f"{name}{SLOT_SEPARATOR}{slot}"


def parse_slot_key(key: str) -> tuple[str, int] | None:
    """The semaphore name and slot number of a slot's key (:func:`slot_key`), or
    None for a key of no slot."""
    match = _SLOT_KEY.fullmatch(key)
    return (match["name"], int(match["slot"])) if match else None


def permit_keys(name: str, limit: int) -> list[str]:
    """The lock keys of the ``limit`` slots of semaphore ``name``: ``<name>@1`` ... ``<name>@N``."""
    name = validate_key(name, what="semaphore name")
    if isinstance(limit, bool) or not isinstance(limit, int) or not 0 < limit <= MAX_PERMITS:
        raise InvalidInput(f"limit must be an integer from 1 to {MAX_PERMITS}")
    return [validate_key(slot_key(name, slot)) for slot in range(1, limit + 1)]


def permit_queue(name: str) -> str:
    """The name of the waiters' queue of semaphore ``name`` (``<name>@*``): the
    ``lock_key`` of their :class:`~coordination.models.Ticket` rows."""
    return f"{validate_key(name, what='semaphore name')}{QUEUE_KEY_SUFFIX}"


def permit_slot(permit: Lease) -> int:
    """The slot number (1 to N) of a permit."""
    parsed = parse_slot_key(permit.key)
    if parsed is None:
        raise InvalidInput(f"{permit.key!r} is no semaphore permit's key")
    return parsed[1]


def acquire_permit(
    name: str,
    *,
    limit: int,
    holder: str,
    ttl: float | None = None,
    wait: float = 0.0,
    lock_delay: float | None = None,
    using: str | None = None,
) -> Lease:
    """Grant ``holder`` one of the ``limit`` permits of semaphore ``name``.

    Returns the lease of one slot's key (``<name>@<slot>``, :func:`permit_slot`),
    with a token strictly greater than every earlier token of that slot. At most
    ``limit`` leases of the semaphore are live at any database time, because
    each slot is a lock (two leases of a key never overlap, rule 3 of
    docs/rules.md). Every caller must pass the same ``limit``: a lowered limit
    takes effect as the leases of the slots above it end (they are never
    granted again), a raised one at once.

    One attempt reads which slots are free or expired by the database clock
    (one query), then asks the grant point for them one by one, in an order
    starting at a random slot so that contending holders spread; the first
    grant wins. The semaphore's queue is read first: while a waiter's live
    ticket is ahead of this caller (every ticket, for a caller without one),
    nothing is granted, so a newcomer never takes a slot a waiter is queued
    for.

    With ``wait`` > 0 a refused caller takes a ticket in the queue (arrival
    order) and tries again when woken (a slot released or revoked, a waiter
    ahead granted or gone: LISTEN/NOTIFY on PostgreSQL), at the end of the
    first lease, or after a back-off step with jitter, until a permit is
    granted or ``wait`` seconds pass. A waiter that gives up leaves the queue
    at once; the ticket of one that died expires after
    ``COORDINATION["TICKET_TTL"]`` seconds and stops holding the others up.

    Raises ``LockHeld`` when none is granted: ``holder`` says that all
    ``limit`` permits are held (``retry_after`` when the first lease ends), or
    how many waiters are queued first. ``InvalidInput`` for a bad name, limit,
    holder, ttl, wait or lock_delay, ``TokenExhausted`` for a slot out of
    tokens and ``InTransaction`` inside ``transaction.atomic()``, as
    ``locks.acquire`` does.
    """
    keys = permit_keys(name, limit)
    holder = validate_holder(holder)
    lease_seconds, wait, delay = grant_timings(ttl, wait, lock_delay)
    backend = get_backend(using)
    queue = permit_queue(name)
    started = time.monotonic()
    # Queued in ``<name>@*`` once refused, woken by releases of every slot and
    # by the queue moving.
    waiter = Waiter(backend, queue, holder, fair=True, wait=wait, wake_keys=keys)
    acquired = wait_for_grant(
        lambda ticket: _attempt(backend, name, keys, holder, lease_seconds, delay, ticket),
        wait=wait, waiter=waiter, key=queue, using=using,
    )
    return announce_grant(acquired, holder, time.monotonic() - started)


def _attempt(
    backend: GrantPoint, name: str, keys: list[str], holder: str, ttl: float, delay: float,
    ticket: int | None,
) -> Acquired:
    """One attempt: each slot that looks grantable, until one is granted; none
    while a live ticket of the queue is ahead of ``ticket`` (the caller's place
    in it, or None: then every live ticket is ahead).

    Without a ticket: the queue is read, then each slot is one ordinary
    acquire call. With one: each slot is tried in a transaction of the grant
    point's own that reads the queue, grants the slot and consumes the ticket,
    so a waiter never holds a permit and a ticket at once. Either way a ticket
    committed after the queue was read is not seen (read committed), as in
    the acquire function's own queue check: the newcomer then asked first.

    One slot per transaction: a refused slot's row lock is not kept while the
    next slot is tried, so two attempts that try slots in different orders
    never wait for each other in a cycle."""
    alias = backend.alias
    queue = permit_queue(name)
    refuse_in_caller_transaction(backend.connection)  # before any read: InTransaction first
    if ticket is None:
        backend.refuse_behind_waiters(queue, None, "permit")
    refusal: LockHeld | None = None
    for key in _candidates(keys, alias):
        try:
            if ticket is None:
                return backend.acquire(key, holder, ttl, delay, None)
            return backend.grant_in_turn(key, holder, ttl, delay, queue, ticket)
        except LockHeld as held:
            if held.key == queue:
                raise  # queued behind other waiters: no slot is ours to try
            # Taken since the read: try the next one.
            if refusal is None or held.retry_after < refusal.retry_after:
                refusal = held
    if refusal is None:
        refusal = _all_held(name, len(keys), keys, alias)
    raise refusal


async def aacquire_permit(
    name: str,
    *,
    limit: int,
    holder: str,
    ttl: float | None = None,
    wait: float = 0.0,
    lock_delay: float | None = None,
    using: str | None = None,
) -> Lease:
    """``acquire_permit()`` for async code: the same permit, guarantees and errors.

    Each attempt is one ``acquire_permit()`` call (``wait=0``) on the app's
    thread pool; a permit granted to a coroutine cancelled meanwhile is
    released at once (``waiting.await_grant``).
    """

    def attempt() -> Lease:
        return acquire_permit(
            name, limit=limit, holder=holder, ttl=ttl, lock_delay=lock_delay, using=using
        )

    return await await_grant(attempt, wait=wait, release=functools.partial(release, using=using))


def _candidates(keys: list[str], alias: str) -> list[str]:
    """The slots that look grantable now (free, expired or never granted), in an
    order starting at a random slot. Only a hint: the grant point decides."""
    busy = set(
        Lock.objects.using(alias)
        .filter(key__in=keys)
        .filter(Q(holder__gt="", expires_at__gt=DatabaseNow()) | Q(delay_until__gt=DatabaseNow()))
        .values_list("key", flat=True)
    )
    start = random.randrange(len(keys))
    return [key for key in keys[start:] + keys[:start] if key not in busy]


def _all_held(name: str, limit: int, keys: list[str], alias: str) -> LockHeld:
    """Every slot is busy: say until when the first lease runs, by the database clock."""
    now = database_now(alias)
    ends = [
        end for end in Lock.objects.using(alias)
        .filter(key__in=keys, holder__gt="")
        .values_list("expires_at", flat=True)
        if end is not None
    ]
    first = min(ends, default=now)
    return LockHeld(
        f"{name}{QUEUE_KEY_SUFFIX}", f"all {limit} permits of {name!r}", first,
        max((first - now).total_seconds(), float(app_settings.POLL_INTERVAL)),
    )
