"""What the admin dashboard shows, computed with the database clock.

Every "now" here is :func:`coordination.locks.database_now`, the clock leases
are decided with (rule 11 of docs/rules.md), so a bar ends where the grant point says the
lease ended. The pictures are plain geometry (pixel positions in dataclasses)
that the template draws as inline SVG: no JavaScript, no CDN.
"""

from __future__ import annotations

import datetime as dt
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from django.db.models import Count, QuerySet
from django.db.models.functions import TruncMinute

from .conf import app_settings
from .locks import database_now
from .models import AcceptedWrite, Grant, Lock, Rejection

__all__ = ["Dashboard", "Timeline", "build_dashboard", "build_timeline"]

HOUR = dt.timedelta(hours=1)
DAY = dt.timedelta(days=1)
MINUTES = 60
TIMELINE_LOCKS = 6
TIMELINE_GRANTS = 10
TIMELINE_MARKS = 300
CONTENDED_KEYS = 10

# Geometry of the pictures, in SVG pixels.
CHART_WIDTH, CHART_HEIGHT = 640, 190
CHART_LEFT, CHART_RIGHT, CHART_TOP, CHART_BOTTOM = 40, 24, 12, 30
TIMELINE_WIDTH = 960
LABEL_WIDTH, TIMELINE_RIGHT = 190, 40
LABEL_CHARS = 20
LANE_HEIGHT, LANE_GAP, AXIS_HEIGHT = 22, 8, 30
TICK_STEPS = (
    0.1, 0.2, 0.5, 1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600,
    7200, 10800, 21600, 43200, 86400,
)


@dataclass(frozen=True)
class Tick:
    x: float
    label: str


@dataclass(frozen=True)
class Counts:
    held: int
    expired: int
    free: int
    grants_hour: int
    grants_day: int
    refused_hour: int
    refused_day: int
    accepted_hour: int | None  # None: accepted writes are not recorded


@dataclass(frozen=True)
class ChartBar:
    kind: str  # "grants" or "refused"
    minute: str
    count: int
    x: float
    y: float
    width: float
    height: float


@dataclass(frozen=True)
class GridLine:
    y: float
    label: str


@dataclass
class MinuteChart:
    width: int
    height: int
    bars: list[ChartBar]
    ticks: list[Tick]
    grid: list[GridLine]
    plot_left: int
    plot_right: int
    baseline: float
    grants_total: int
    refused_total: int


@dataclass(frozen=True)
class RoleRow:
    """A role of :mod:`coordination.election`: its leader now (empty: none) and term."""

    role: str
    key: str
    leader: str
    term: int
    since: dt.datetime | None
    terms: int


@dataclass(frozen=True)
class ContendedKey:
    key: str
    lock_id: int
    grants: int
    holders: int
    refused: int


@dataclass(frozen=True)
class Lane:
    token: int
    holder: str
    end: str  # GrantEnd value, "live" or "expired-not-released"
    acquired_at: dt.datetime
    ends_at: dt.datetime
    y: float
    bar_x: float
    bar_width: float

    @property
    def label(self) -> str:
        """The holder, shortened to fit beside the lane (the full one is in the tooltip)."""
        return _short_holder(self.holder)

    @property
    def label_y(self) -> float:
        return self.y + LANE_HEIGHT / 2

    @property
    def duration(self) -> float:
        return (self.ends_at - self.acquired_at).total_seconds()


@dataclass(frozen=True)
class Mark:
    kind: str  # "accepted" or "refused"
    token: int
    step: int
    resource: str
    reason: str
    at: dt.datetime
    x: float
    y: float


@dataclass
class Timeline:
    key: str
    lock_id: int
    state: str
    token: int
    start: dt.datetime
    end: dt.datetime
    width: int
    height: int
    lanes: list[Lane] = field(default_factory=list)
    marks: list[Mark] = field(default_factory=list)
    ticks: list[Tick] = field(default_factory=list)
    now_x: float | None = None
    plot_left: int = LABEL_WIDTH
    plot_right: int = TIMELINE_WIDTH - TIMELINE_RIGHT

    @property
    def axis_y(self) -> float:
        return self.height - AXIS_HEIGHT

    @property
    def refused(self) -> int:
        return sum(1 for mark in self.marks if mark.kind == "refused")

    @property
    def accepted(self) -> int:
        return sum(1 for mark in self.marks if mark.kind == "accepted")


@dataclass
class Dashboard:
    now: dt.datetime
    counts: Counts
    chart: MinuteChart
    contended: list[ContendedKey]
    timelines: list[Timeline]
    recording_writes: bool
    roles: list[RoleRow] = field(default_factory=list)


def build_dashboard(keys: Sequence[str] = (), *, using: str | None = None) -> Dashboard:
    """Everything the dashboard page shows, as of the database's current time.

    ``keys`` chooses the locks drawn as timelines; by default the most recently
    granted ones.
    """
    alias = using or app_settings.DATABASE
    now = database_now(alias)
    keys = list(keys) or recent_keys(TIMELINE_LOCKS, using=alias)
    locks = {lock.key: lock for lock in Lock.objects.using(alias).filter(key__in=keys)}
    timelines = [build_timeline(locks[key], now, using=alias) for key in keys if key in locks]
    return Dashboard(
        now=now,
        counts=_counts(now, alias),
        chart=_minute_chart(now, alias),
        contended=_contended(now, alias),
        timelines=timelines,
        recording_writes=bool(app_settings.RECORD_WRITES),
        roles=_roles(now, alias),
    )


def recent_keys(limit: int, *, using: str | None = None) -> list[str]:
    """The keys of the locks granted most recently, newest first."""
    alias = using or app_settings.DATABASE
    keys: list[str] = []
    # The acquired_at index makes this a short scan, however long the history.
    recent = Grant.objects.using(alias).order_by("-acquired_at").values_list("lock__key", flat=True)
    for key in recent[: limit * 50]:
        if key not in keys:
            keys.append(key)
            if len(keys) == limit:
                break
    return keys


def build_timeline(lock: Lock, now: dt.datetime, *, using: str | None = None) -> Timeline:
    """One lock's recent grants as bars on the database-time axis, with its writes marked.

    A bar runs from acquire to release, revoke or expiry; a live lease runs to
    ``now``. Refused writes (always recorded) and accepted writes (when
    RECORD_WRITES is on) are marked on the lane of the token that made them.
    """
    alias = using or app_settings.DATABASE
    grants = list(
        Grant.objects.using(alias).filter(lock=lock).order_by("-token")[:TIMELINE_GRANTS]
    )[::-1]
    spans = [(grant, *_span(grant, now)) for grant in grants]
    tokens = {grant.token for grant in grants}
    start = min((begin for _, begin, _, _ in spans), default=now - dt.timedelta(minutes=1))
    refused = list(
        Rejection.objects.using(alias)
        .filter(lock_key=lock.key, token__in=tokens, created_at__gte=start)
        .order_by("-created_at")[:TIMELINE_MARKS]
    )
    accepted = list(
        AcceptedWrite.objects.using(alias)
        .filter(lock_key=lock.key, token__in=tokens, created_at__gte=start)
        .order_by("-created_at")[:TIMELINE_MARKS]
    )
    end = max(
        [finish for _, _, finish, _ in spans]
        + [row.created_at for row in refused]
        + [row.created_at for row in accepted]
        + [start + dt.timedelta(seconds=1)]
    )
    # A little room on both sides, so marks at the very edges stay visible.
    pad = (end - start) * 0.03
    start, end = start - pad, end + pad
    height = len(grants) * (LANE_HEIGHT + LANE_GAP) + LANE_GAP + AXIS_HEIGHT
    timeline = Timeline(
        key=lock.key,
        lock_id=lock.pk,
        state=str(lock.state_at(now)),
        token=lock.token,
        start=start,
        end=end,
        width=TIMELINE_WIDTH,
        height=height,
    )
    scale = _TimeScale(start, end, LABEL_WIDTH, TIMELINE_WIDTH - TIMELINE_RIGHT)
    lane_y: dict[int, float] = {}
    for index, (grant, begin, finish, end_kind) in enumerate(spans):
        y = LANE_GAP + index * (LANE_HEIGHT + LANE_GAP)
        lane_y[grant.token] = y
        left = scale.x(begin)
        timeline.lanes.append(
            Lane(
                token=grant.token,
                holder=grant.holder,
                end=end_kind,
                acquired_at=begin,
                ends_at=finish,
                y=y,
                bar_x=left,
                bar_width=round(max(scale.x(finish) - left, 2.0), 1),
            )
        )
    for row in accepted:
        timeline.marks.append(
            Mark("accepted", row.token, row.step, row.resource, "", row.created_at,
                 scale.x(row.created_at), lane_y[row.token] + LANE_HEIGHT / 2)
        )
    # Refused marks last, so they are drawn on top.
    for rejection in refused:
        timeline.marks.append(
            Mark("refused", rejection.token, rejection.step, rejection.resource,
                 rejection.reason, rejection.created_at,
                 scale.x(rejection.created_at), lane_y[rejection.token] + LANE_HEIGHT / 2)
        )
    timeline.ticks = scale.ticks()
    if start <= now <= end:
        timeline.now_x = scale.x(now)
    return timeline


def _span(grant: Grant, now: dt.datetime) -> tuple[dt.datetime, dt.datetime, str]:
    """Where a grant's bar starts and ends, and why it ends there."""
    if grant.ended_at is not None:
        return grant.acquired_at, max(grant.ended_at, grant.acquired_at), grant.end_reason
    if grant.expires_at <= now:
        # Ran out, and nobody has released or taken the lock since.
        return grant.acquired_at, grant.expires_at, "expired-not-released"
    return grant.acquired_at, now, "live"


def _counts(now: dt.datetime, alias: str) -> Counts:
    locks = Lock.objects.using(alias)
    grants = Grant.objects.using(alias)
    rejections = Rejection.objects.using(alias)
    recording = bool(app_settings.RECORD_WRITES)
    return Counts(
        held=locks.held().count(),
        expired=locks.expired().count(),
        free=locks.free().count(),
        grants_hour=grants.filter(acquired_at__gt=now - HOUR).count(),
        grants_day=grants.filter(acquired_at__gt=now - DAY).count(),
        refused_hour=rejections.filter(created_at__gt=now - HOUR).count(),
        refused_day=rejections.filter(created_at__gt=now - DAY).count(),
        accepted_hour=(
            AcceptedWrite.objects.using(alias).filter(created_at__gt=now - HOUR).count()
            if recording
            else None
        ),
    )


def _per_minute(rows: QuerySet[Any], moment: str, since: dt.datetime) -> dict[dt.datetime, int]:
    """How many of ``rows`` have their ``moment`` in each minute from ``since`` (UTC)."""
    counted = (
        rows.filter(**{f"{moment}__gte": since})
        .annotate(minute=TruncMinute(moment, tzinfo=dt.UTC))
        .order_by()
        .values_list("minute")
        .annotate(n=Count("id"))
        .values_list("minute", "n")
    )
    return {
        minute.astimezone(dt.UTC).replace(second=0, microsecond=0): n for minute, n in counted
    }


def _minute_chart(now: dt.datetime, alias: str) -> MinuteChart:
    last = now.replace(second=0, microsecond=0)
    first = last - dt.timedelta(minutes=MINUTES - 1)
    minutes = [first + dt.timedelta(minutes=i) for i in range(MINUTES)]
    grants = _per_minute(Grant.objects.using(alias), "acquired_at", first)
    refused = _per_minute(Rejection.objects.using(alias), "created_at", first)
    top = _nice_ceiling(max([*grants.values(), *refused.values(), 1]))
    left, right = CHART_LEFT, CHART_WIDTH - CHART_RIGHT
    baseline = CHART_HEIGHT - CHART_BOTTOM
    plot_height = baseline - CHART_TOP
    slot = (right - left) / MINUTES
    bar_width = round(slot * 0.4, 1)
    bars: list[ChartBar] = []
    for index, minute in enumerate(minutes):
        label = f"{minute:%H:%M}"
        for offset, kind, count in ((0.1, "grants", grants.get(minute, 0)),
                                    (0.5, "refused", refused.get(minute, 0))):
            height = round(plot_height * count / top, 1)
            bars.append(
                ChartBar(kind, label, count, round(left + slot * (index + offset), 1),
                         round(baseline - height, 1), bar_width, height)
            )
    ticks = [
        Tick(round(left + slot * (index + 0.5), 1), f"{minute:%H:%M}")
        for index, minute in enumerate(minutes)
        if minute.minute % 10 == 0
    ]
    grid = [
        GridLine(round(baseline - plot_height * fraction, 1), f"{top * fraction:g}")
        for fraction in (0.0, 0.25, 0.5, 0.75, 1.0)
        if top * fraction == int(top * fraction)
    ]
    return MinuteChart(
        width=CHART_WIDTH, height=CHART_HEIGHT, bars=bars, ticks=ticks, grid=grid,
        plot_left=left, plot_right=right, baseline=baseline,
        grants_total=sum(grants.values()), refused_total=sum(refused.values()),
    )


def _contended(now: dt.datetime, alias: str) -> list[ContendedKey]:
    """Keys with the most grants in the last hour, with their holders and refused writes."""
    since = now - HOUR
    rows = list(
        Grant.objects.using(alias)
        .filter(acquired_at__gt=since)
        .order_by()
        .values_list("lock__key", "lock_id")
        .annotate(grants=Count("id"), holders=Count("holder", distinct=True))
        .order_by("-grants", "lock__key")[:CONTENDED_KEYS]
    )
    refused = dict(
        Rejection.objects.using(alias)
        .filter(created_at__gt=since, lock_key__in=[key for key, *_ in rows])
        .order_by()
        .values_list("lock_key")
        .annotate(n=Count("id"))
        .values_list("lock_key", "n")
    )
    return [
        ContendedKey(key, lock_id, grants, holders, refused.get(key, 0))
        for key, lock_id, grants, holders in rows
    ]


# Celery task holders read "app.tasks.deposit[<task id>]#1 on host:pid".
_TASK_HOLDER = re.compile(r"^(?:[\w.]*\.)?(?P<name>[\w-]+)\[[^\]]*\](?:#\d+)?(?P<rest>.*)$")


def _roles(now: dt.datetime, alias: str, limit: int = 10) -> list[RoleRow]:
    """Election roles (locks ``election:<role>``), most recently granted first."""
    rows = (
        Lock.objects.using(alias).filter(key__startswith="election:")
        .annotate(terms=Count("grants")).order_by("-acquired_at")[:limit]
    )
    found = []
    for lock in rows:
        leading = bool(lock.holder) and lock.expires_at is not None and lock.expires_at > now
        found.append(RoleRow(
            role=lock.key.removeprefix("election:"), key=lock.key,
            leader=lock.holder if leading else "", term=lock.token,
            since=lock.acquired_at if leading else None, terms=getattr(lock, "terms", 0),
        ))
    return found


def _short_holder(holder: str) -> str:
    match = _TASK_HOLDER.match(holder)
    if match is not None:
        holder = f"{match['name']}{match['rest']}"
    return holder if len(holder) <= LABEL_CHARS else holder[: LABEL_CHARS - 1] + "\u2026"


def _nice_ceiling(value: int) -> int:
    """The smallest of 1, 2, 4, 5, 8 or 10 times a power of ten that is >= ``value``."""
    magnitude = int(10 ** max(0, math.floor(math.log10(value))))
    for factor in (1, 2, 4, 5, 8, 10):
        if factor * magnitude >= value:
            return factor * magnitude
    return 10 * magnitude  # pragma: no cover


class _TimeScale:
    def __init__(self, start: dt.datetime, end: dt.datetime, left: float, right: float) -> None:
        self.start, self.end = start, end
        self.left, self.right = left, right
        self.seconds = max((end - start).total_seconds(), 1e-6)

    def x(self, moment: dt.datetime) -> float:
        fraction = (moment - self.start).total_seconds() / self.seconds
        return round(self.left + (self.right - self.left) * fraction, 1)

    def ticks(self) -> list[Tick]:
        step = next((s for s in TICK_STEPS if self.seconds / s <= 8), TICK_STEPS[-1])
        epoch = self.start.timestamp()
        first = math.ceil(epoch / step) * step
        ticks: list[Tick] = []
        moment = first
        while moment <= self.end.timestamp():
            when = dt.datetime.fromtimestamp(moment, tz=dt.UTC)
            label = f"{when:%H:%M:%S}" if step >= 1 else f"{when:%H:%M:%S}.{when.microsecond // 100000}"
            ticks.append(Tick(self.x(when), label))
            moment = round(moment + step, 3)
        return ticks
