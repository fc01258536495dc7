"""Pruning: delete old history, and lock rows unused for long, never letting a token repeat.

What goes: ended grants (except each lock's latest grant, whose token is the
lock's counter), rejections, idempotency records, accepted-write records and
the records of fenced tasks' executions (never one whose lease is live),
unique-job claims that no longer hold and rate-limit starts older than the
longest period (so no window still counts them) older than a cutoff measured
on the database clock; and the Lock rows of keys
free and unused for ``COORDINATION["PRUNE_LOCKS_AFTER"]`` seconds (and at
least the cutoff), with what is left of their grant history. What stays,
always: Fence rows (their watermarks are what refuse old tokens), every lock
that is held, expired within the cutoff, in a running lock-delay or with a
fair waiter queued, and the grants of every lock that stays.

Why deleting a Lock row keeps tokens increasing (rules 3 and 8 of
docs/rules.md): the row holds the key's counter, and a key with no row starts
again at the token floor + 1. So the transaction that deletes lock rows first
raises the floor (:class:`~coordination.models.TokenFloor`) to at least the
highest counter it deletes; every grant point issues ``max(counter, floor) +
1`` and reads the floor after it holds the key's row (the ORM and SQLite
paths) or reads it again when it created the row (the PostgreSQL function):
a later grant of a pruned key gets a token above every token the key ever
had, and above every watermark its fences hold. The rows are locked first
(``FOR UPDATE SKIP LOCKED``: a lock an acquire is taking is skipped, never
waited for) and checked again after the locks are held, so an acquire racing
the prune either takes the row before it is locked (and it stays) or finds
it gone and creates a new one above the raised floor. The price is that the
floor is shared: every other key's next token jumps above the pruned key's
counter too (gaps are allowed; order per key is kept).

Deletion goes in batches, each its own short transaction, so the grant point
and the fences keep running while it prunes.
"""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Callable
from dataclasses import dataclass

from django.db import models, transaction
from django.db.models import Exists, F, OuterRef, Q

from .conf import app_settings
from .exceptions import InvalidInput
from .locks import database_now
from .models import (
    MAX_TOKEN,
    RATE_PERIOD_MAX,
    AcceptedWrite,
    DatabaseNow,
    Execution,
    Grant,
    IdempotencyRecord,
    Lock,
    RateStart,
    Rejection,
    Ticket,
    UniqueClaim,
)
from .restore import raise_floor_to
from .unique import holding

__all__ = ["PruneTarget", "lock_cutoff", "parse_age", "prune", "prune_locks", "targets", "unused_locks"]

_AGE = re.compile(r"(\d+)([smhd])")
_UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days"}


def parse_age(text: str) -> dt.timedelta:
    """``"30d"``, ``"12h"``, ``"90m"``, ``"45s"`` as a timedelta; InvalidInput otherwise."""
    match = _AGE.fullmatch(text.strip())
    if match is None:
        raise InvalidInput(
            f"age {text!r} must be a whole number and a unit: s, m, h or d (like 30d or 12h)"
        )
    number, unit = match.groups()
    try:
        return dt.timedelta(**{_UNITS[unit]: int(number)})
    except OverflowError:
        raise InvalidInput(f"age {text!r} is too long") from None


@dataclass(frozen=True)
class PruneTarget:
    """One kind of history row and which of its rows are old enough to delete,
    given the cutoff and the database's time now."""

    name: str
    model: type[models.Model]
    old: Callable[[dt.datetime, dt.datetime], Q]


def targets() -> list[PruneTarget]:
    longest_period = dt.timedelta(seconds=RATE_PERIOD_MAX)
    return [
        PruneTarget(
            "grants",
            Grant,
            # Ended grants only, and never the lock's latest: its token is the
            # counter, and grant_from_proof may still be asked about it.
            lambda cutoff, now: Q(ended_at__lt=cutoff) & ~Q(token=F("lock__token")),
        ),
        PruneTarget("rejections", Rejection, lambda cutoff, now: Q(created_at__lt=cutoff)),
        PruneTarget(
            "idempotency records", IdempotencyRecord, lambda cutoff, now: Q(created_at__lt=cutoff)
        ),
        PruneTarget("accepted writes", AcceptedWrite, lambda cutoff, now: Q(created_at__lt=cutoff)),
        # An execution's record goes with its grant's history, never while it runs.
        PruneTarget("executions", Execution, lambda cutoff, now: Q(started_at__lt=cutoff) & ~Q(Exists(
            Grant.objects.live().filter(lock__key=OuterRef("lock_key"), token=OuterRef("token"))
        ))),
        # A claim that holds keeps its job unique; an ended one is made again by the next claim.
        PruneTarget("unique claims", UniqueClaim, lambda cutoff, now: Q(claimed_at__lt=cutoff) & ~holding()),
        # A start within the longest period may still count in some key's window.
        PruneTarget(
            "rate starts", RateStart,
            lambda cutoff, now: Q(started_at__lt=min(cutoff, now - longest_period)),
        ),
    ]


def prune(
    older_than: dt.timedelta,
    *,
    apply: bool = True,
    batch_size: int = 1000,
    using: str | None = None,
    progress: Callable[[str], None] = lambda line: None,
) -> dict[str, int]:
    """Delete history rows older than ``older_than`` (database time); returns counts by kind.

    With ``apply=False`` only counts what would go. ``InvalidInput`` for a
    negative age or a batch size below 1.
    """
    if older_than < dt.timedelta(0):
        raise InvalidInput("the age must not be negative")
    if batch_size < 1:
        raise InvalidInput("the batch size must be at least 1")
    alias = using or app_settings.DATABASE
    now = database_now(alias)
    cutoff = now - older_than
    counts: dict[str, int] = {}
    locks_cutoff = lock_cutoff(now, cutoff)
    for target in targets():
        rows = target.model._base_manager.using(alias).filter(target.old(cutoff, now))
        if not apply:
            counts[target.name] = rows.count()
            progress(f"{target.name}: {counts[target.name]} to delete")
            continue
        deleted = 0
        while True:
            # Pick a batch, then delete it by primary key, re-checking the
            # condition: one short transaction per batch, no long scan held open.
            batch = list(rows.order_by("pk").values_list("pk", flat=True)[:batch_size])
            if not batch:
                break
            with transaction.atomic(using=alias):
                _count, by_model = rows.filter(pk__in=batch).delete()
            deleted += by_model.get(target.model._meta.label, 0)
            progress(f"{target.name}: {deleted} deleted")
            if len(batch) < batch_size:
                break
        counts[target.name] = deleted
    if locks_cutoff is not None:
        counts["locks"] = prune_locks(
            locks_cutoff, apply=apply, batch_size=batch_size, using=alias, progress=progress
        )
    return counts


def lock_cutoff(now: dt.datetime, history_cutoff: dt.datetime) -> dt.datetime | None:
    """Until when a lock must have been unused to be pruned, or None: never.

    ``PRUNE_LOCKS_AFTER`` seconds before ``now``, and never after the history
    cutoff: a pruned lock's grants go with it, so none of them may be younger
    than the grant history kept.
    """
    after = app_settings.PRUNE_LOCKS_AFTER
    if after is None:
        return None
    return min(history_cutoff, now - dt.timedelta(seconds=float(after)))


def unused_locks(cutoff: dt.datetime) -> Q:
    """Locks free and unused since ``cutoff`` (database time), as far as SQL decides it.

    Free: released or revoked with any lock-delay over, or a lease that expired
    before the cutoff (its lock-delay is checked by :func:`_lease_over`). Unused:
    created before the cutoff, and no grant of the key open or ended since. No
    fair waiter queued for the key. Never a key at the largest token: its
    counter would lift the shared floor to where no key has a token left.
    """
    recent_grant = Grant.objects.filter(lock=OuterRef("pk")).filter(
        Q(ended_at__gte=cutoff) | Q(ended_at__isnull=True, expires_at__gte=cutoff)
    )
    queued = Ticket.objects.filter(lock_key=OuterRef("key"), expires_at__gt=DatabaseNow())
    free = Q(holder="") & (Q(delay_until__isnull=True) | Q(delay_until__lt=cutoff))
    expired = Q(holder__gt="", expires_at__lt=cutoff)
    return (
        Q(created_at__lt=cutoff, token__lt=MAX_TOKEN)
        & (free | expired)
        & ~Exists(recent_grant)
        & ~Exists(queued)
    )


def _lease_over(holder: str, expires_at: dt.datetime | None, lock_delay: float, cutoff: dt.datetime) -> bool:
    """A lease left to expire counts as ended once its lock-delay is over too."""
    if not holder:
        return True
    return expires_at is not None and expires_at + dt.timedelta(seconds=lock_delay) < cutoff


def prune_locks(
    cutoff: dt.datetime,
    *,
    apply: bool = True,
    batch_size: int = 1000,
    using: str | None = None,
    progress: Callable[[str], None] = lambda line: None,
) -> int:
    """Delete the Lock rows unused since ``cutoff`` and their grants; return how many.

    Each batch is one transaction: lock the candidate rows (skipping rows
    another transaction holds), check them again now that they are locked,
    raise the token floor to the highest counter among them, delete their
    grants, delete them. See the module's docstring for why tokens stay
    increasing. With ``apply=False`` only counts.
    """
    alias = using or app_settings.DATABASE
    candidates = Lock.objects.using(alias).filter(unused_locks(cutoff))
    fields = ("pk", "token", "holder", "expires_at", "lock_delay")
    if not apply:
        count = sum(
            1
            for holder, expires_at, lock_delay in candidates.values_list(*fields[2:]).iterator()
            if _lease_over(holder, expires_at, lock_delay, cutoff)
        )
        progress(f"locks: {count} to delete")
        return count
    deleted = 0
    after_pk = 0
    while True:
        with transaction.atomic(using=alias):
            locked = list(
                candidates.filter(pk__gt=after_pk)
                .select_for_update(skip_locked=True)
                .order_by("pk")
                .values_list("pk", flat=True)[:batch_size]
            )
            if not locked:
                break
            after_pk = locked[-1]
            # Checked again in a statement of its own, after the row locks are
            # held: a grant committed after the first statement began is seen
            # here, and no grant can commit now until this transaction ends.
            rows = [
                (pk, token)
                for pk, token, holder, expires_at, lock_delay in (
                    candidates.filter(pk__in=locked).values_list(*fields)
                )
                if _lease_over(holder, expires_at, lock_delay, cutoff)
            ]
            if rows:
                pks = [pk for pk, _token in rows]
                # The floor first, in the same transaction: a key pruned here
                # and granted again starts above its last token (rule 3).
                raise_floor_to(max(token for _pk, token in rows), using=alias)
                Grant.objects.using(alias).filter(lock_id__in=pks).delete()
                Lock.objects.using(alias).filter(pk__in=pks).delete()
                deleted += len(pks)
        progress(f"locks: {deleted} deleted")
        if len(locked) < batch_size:
            break
    return deleted
