"""Pruning: delete old history, never the state that keeps tokens and watermarks ahead.

What goes: ended grants (except each lock's latest grant, whose token is the
lock's counter), rejections, idempotency records and accepted-write records
older than a cutoff measured on the database clock. What stays, always: Lock
and Fence rows (their counters and watermarks are what refuse old tokens), the
grants of current leases and each lock's latest grant.

Deletion goes in batches, each its own short transaction, so the grant point
and the fences keep running while it prunes.
"""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Callable
from dataclasses import dataclass

from django.db import models, transaction
from django.db.models import F, Q

from .conf import app_settings
from .exceptions import InvalidInput
from .locks import database_now
from .models import AcceptedWrite, Grant, IdempotencyRecord, Rejection

__all__ = ["PruneTarget", "parse_age", "prune", "targets"]

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
    """One kind of history row and which of its rows are old enough to delete."""

    name: str
    model: type[models.Model]
    old: Callable[[dt.datetime], Q]


def targets() -> list[PruneTarget]:
    return [
        PruneTarget(
            "grants",
            Grant,
            # Ended grants only, and never the lock's latest: its token is the
            # counter, and grant_from_proof may still be asked about it.
            lambda cutoff: Q(ended_at__lt=cutoff) & ~Q(token=F("lock__token")),
        ),
        PruneTarget("rejections", Rejection, lambda cutoff: Q(created_at__lt=cutoff)),
        PruneTarget("idempotency records", IdempotencyRecord, lambda cutoff: Q(created_at__lt=cutoff)),
        PruneTarget("accepted writes", AcceptedWrite, lambda cutoff: Q(created_at__lt=cutoff)),
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
    cutoff = database_now(alias) - older_than
    counts: dict[str, int] = {}
    for target in targets():
        rows = target.model._base_manager.using(alias).filter(target.old(cutoff))
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
    return counts
