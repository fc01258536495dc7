"""Rate limits over every worker: at most N starts in any window of a period, per key.

:func:`take_start` decides one start of rate key ``bucket`` under a
:class:`Rate` of ``limit`` starts per ``period`` seconds, in a transaction of
the grant point's own (:meth:`~coordination.backends.base.GrantPoint.transaction`):

1. the key's :class:`~coordination.models.RateBucket` row is locked
   (``SELECT ... FOR UPDATE``; created first if missing), so the decisions of
   one key happen one at a time over every process and machine;
2. ``T`` is read from the database clock;
3. the starts logged for the key at a time later than ``T - period`` are
   counted: with fewer than ``limit``, a start at ``T`` is logged and granted;
   otherwise it is refused with a countdown: the time until the start whose
   leaving the window makes room is older than ``period``.

**What is guaranteed**: every half-open window ``[t, t + period)``, at any
``t`` (a sliding window, not fixed buckets), holds at most ``limit`` logged
starts. Proof: take the starts in one such window and the one decided last,
at ``T``; every other lies within ``period`` of ``T``, so it is later than
``T - period``, and it was logged before that decision, which counted it. The
count has no upper bound, so this holds even if the database clock stepped
back between decisions.

Entries older than twice the period are pruned by the key's own decisions;
:func:`prune_starts` removes what keys no longer used left behind.
"""

from __future__ import annotations

import datetime as dt
import re
from dataclasses import dataclass
from typing import Any

from .backends import dialect_of, get_backend
from .conf import app_settings
from .exceptions import InvalidInput
from .models import RATE_LIMIT_MAX, RATE_PERIOD_MAX, RATE_PERIOD_MIN, RateBucket, RateStart

__all__ = ["Decision", "Rate", "parse_rate", "prune_starts", "starts_of", "take_start"]

_UNITS = {
    **dict.fromkeys(("s", "sec", "secs", "second", "seconds"), 1.0),
    **dict.fromkeys(("m", "min", "mins", "minute", "minutes"), 60.0),
    **dict.fromkeys(("h", "hour", "hours"), 3600.0),
    **dict.fromkeys(("d", "day", "days"), 86400.0),
}
_RATE = re.compile(r"\s*(?P<limit>\d+)\s*/\s*(?P<count>\d+(?:\.\d+)?)?\s*(?P<unit>[a-z]+)\s*")
RATE_RULE = (
    "a rate: \"10/m\" (10 per minute), \"100/h\", \"5/s\", \"1000/d\" or \"10/30s\" "
    f"(10 per 30 seconds): 1 to {RATE_LIMIT_MAX} starts per {RATE_PERIOD_MIN:g} to "
    f"{RATE_PERIOD_MAX:g} seconds"
)


@dataclass(frozen=True)
class Rate:
    """``limit`` starts per ``period`` seconds."""

    limit: int
    period: float

    def __post_init__(self) -> None:
        if isinstance(self.limit, bool) or not isinstance(self.limit, int) or not (
            1 <= self.limit <= RATE_LIMIT_MAX
        ) or not RATE_PERIOD_MIN <= float(self.period) <= RATE_PERIOD_MAX:
            raise InvalidInput(f"{self.limit}/{self.period}s is not {RATE_RULE}")

    def __str__(self) -> str:
        return f"{self.limit}/{self.period:g}s"


def parse_rate(value: object) -> Rate:
    """A :class:`Rate` from ``"10/m"`` (the units of Django REST framework's
    throttle rates: s, m, h, d, or their names), ``"10/30s"``, ``(10, 60.0)`` or
    a ``Rate``; else ``InvalidInput``."""
    if isinstance(value, Rate):
        return value
    if isinstance(value, tuple) and len(value) == 2:
        limit, period = value
        if isinstance(period, bool) or not isinstance(period, int | float):
            raise InvalidInput(f"{value!r} is not {RATE_RULE}")
        return Rate(limit, float(period))
    match = _RATE.fullmatch(value) if isinstance(value, str) else None
    if match is None or match["unit"] not in _UNITS:
        raise InvalidInput(f"{value!r} is not {RATE_RULE}")
    unit = _UNITS[match["unit"]]
    return Rate(int(match["limit"]), float(match["count"] or 1) * unit)


@dataclass(frozen=True)
class Decision:
    """One decision of :func:`take_start`: granted (its start logged at ``at``) or
    refused with ``countdown`` seconds until a start would be granted."""

    granted: bool
    at: dt.datetime
    countdown: float
    in_window: int


def take_start(bucket: str, rate: Rate, *, task: str = "", using: str | None = None) -> Decision:
    """Grant one start of rate key ``bucket`` under ``rate``, or refuse it with a
    countdown: decided on the database clock, one decision of the key at a time
    (see the module's documentation for the guarantee). Not inside a transaction
    of the caller's (``TransactionInProgress``, as an acquire)."""
    alias = using or app_settings.DATABASE
    backend = get_backend(alias)
    period = dt.timedelta(seconds=rate.period)
    with backend.transaction() as connection:
        row = _locked_bucket(alias, bucket, connection)
        now = backend.now()
        window = RateStart.objects.using(alias).filter(bucket_id=row.pk, started_at__gt=now - period)
        count = window.count()
        if count < rate.limit:
            RateStart.objects.using(alias).create(bucket_id=row.pk, started_at=now, task=task[:255])
            RateStart.objects.using(alias).filter(
                bucket_id=row.pk, started_at__lte=now - 2 * period
            ).delete()
            return Decision(True, now, 0.0, count + 1)
        # The (count - limit + 1)-th oldest start is the one whose leaving makes room.
        leaves = window.order_by("started_at").values_list("started_at", flat=True)[count - rate.limit]
        countdown = (leaves + period - now).total_seconds()
        return Decision(False, now, max(countdown, 0.001), count)


def _locked_bucket(alias: str, bucket: str, connection: Any) -> RateBucket:
    rows = RateBucket.objects.using(alias)
    while True:
        try:
            return rows.select_for_update().get(key=bucket)
        except RateBucket.DoesNotExist:
            # Racing first decisions of a new key all get past here, then queue on
            # the same row lock (create_missing never deadlocks them).
            dialect_of(connection).create_missing(rows, [RateBucket(key=bucket)], "key")


def starts_of(bucket: str, *, using: str | None = None) -> list[dt.datetime]:
    """The logged start times of rate key ``bucket``, oldest first (database time)."""
    alias = using or app_settings.DATABASE
    return list(
        RateStart.objects.using(alias).filter(bucket__key=bucket)
        .order_by("started_at").values_list("started_at", flat=True)
    )


def prune_starts(older_than: float = 2 * RATE_PERIOD_MAX, *, using: str | None = None) -> int:
    """Delete the starts logged more than ``older_than`` seconds ago (database time;
    by default twice the longest period, so no window still counts them).
    Returns how many were deleted."""
    alias = using or app_settings.DATABASE
    before = get_backend(alias).now() - dt.timedelta(seconds=older_than)
    deleted, _ = RateStart.objects.using(alias).filter(started_at__lt=before).delete()
    return deleted
