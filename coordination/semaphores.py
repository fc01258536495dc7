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

Not built yet (docs/primitives.md): wake-ups and a fair queue for waiting
permit holders (waiters poll), the Celery ``concurrency=N`` option, REST
endpoints and the admin's drawing of slots.
"""

from __future__ import annotations

import functools
import random
import time

from django.db.models import Q

from .conf import app_settings
from .exceptions import InvalidInput, LockHeld
from .leases import Lease
from .locks import (
    _grant_timings,
    _Pace,
    _release_quietly,
    acquire,
    await_grant,
    database_now,
)
from .models import DatabaseNow, Lock, validate_holder, validate_key

__all__ = [
    "MAX_PERMITS", "aacquire_permit", "acquire_permit", "permit_keys", "permit_slot",
]

MAX_PERMITS = 1000
"""The largest ``limit`` of a semaphore."""

SLOT_SEPARATOR = "@"


def permit_keys(name: str, limit: int) -> list[str]:
    """The lock keys of the ``limit`` slots of semaphore ``name``: ``<name>@1`` ... ``<name>@N``."""
    name = validate_key(name, what="semaphore name")
    if isinstance(limit, bool) or not isinstance(limit, int) or not 0 < limit <= MAX_PERMITS:
        raise InvalidInput(f"limit must be an integer from 1 to {MAX_PERMITS}")
    return [validate_key(f"{name}{SLOT_SEPARATOR}{slot}") for slot in range(1, limit + 1)]


def permit_slot(permit: Lease) -> int:
    """The slot number (1 to N) of a permit."""
    _, _, slot = permit.key.rpartition(SLOT_SEPARATOR)
    return int(slot)


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
    grant wins. With ``wait`` > 0 the attempt is repeated (back-off with jitter,
    up to the earliest end of a held slot's lease) until a permit is granted or
    ``wait`` seconds pass. Waiters poll: no wake-ups, no fair queue yet.

    Raises ``LockHeld`` (``holder`` says that all ``limit`` permits are held,
    ``retry_after`` when the first lease ends) when none is free,
    ``InvalidInput`` for a bad name, limit, holder, ttl, wait or lock_delay,
    ``TokenExhausted`` for a slot out of tokens and ``InTransaction`` inside
    ``transaction.atomic()``, as ``locks.acquire`` does.
    """
    keys = permit_keys(name, limit)
    holder = validate_holder(holder)
    lease_seconds, wait, delay = _grant_timings(ttl, wait, lock_delay)
    alias = using or app_settings.DATABASE
    pace = _Pace(wait)
    while True:
        refusal = None
        for key in _candidates(keys, alias):
            try:
                # The single acquire of the slot's key: its grant rule, log and signals.
                return acquire(key, holder=holder, ttl=lease_seconds, lock_delay=delay, using=using)
            except LockHeld as held:  # taken since the read: try the next one
                if refusal is None or held.retry_after < refusal.retry_after:
                    refusal = held
        if refusal is None:
            refusal = _all_held(name, limit, keys, alias)
        time.sleep(pace.pause(refusal))


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
    released at once (``locks.await_grant``).
    """

    def attempt() -> Lease:
        return acquire_permit(
            name, limit=limit, holder=holder, ttl=ttl, lock_delay=lock_delay, using=using
        )

    return await await_grant(attempt, functools.partial(_release_quietly, using=using), wait)


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
        f"{name}{SLOT_SEPARATOR}*", f"all {limit} permits of {name!r}", first,
        max((first - now).total_seconds(), float(app_settings.POLL_INTERVAL)),
    )
