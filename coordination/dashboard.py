"""What the admin dashboard shows, computed with the database clock.

Every "now" here is :func:`coordination.locks.database_now`, the clock leases
are decided with (rule 11 of docs/rules.md), so a bar ends where the grant point says the
lease ended. The pictures are plain geometry (pixel positions in dataclasses)
that the template draws as inline SVG: no JavaScript, no CDN.

What a viewer sees is what their permissions and access rules let them read
(:class:`Shown`): grant holders and tokens only with ``view_grant``, refused
writes only with ``view_rejection``, accepted writes only with
``view_acceptedwrite``, and only of the keys their rules allow reading. A part
they may not see is None, left out of the page rather than shown as zero.
"""

from __future__ import annotations

import datetime as dt
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from django.db.models import Count, QuerySet
from django.db.models.functions import TruncMinute

from . import jobs
from .access import UNRESTRICTED, Access
from .conf import app_settings
from .locks import database_now
from .models import (
    AcceptedWrite,
    Grant,
    JobOutcome,
    JobPolicy,
    JobTally,
    Lock,
    LockQuerySet,
    Rejection,
)

__all__ = [
    "Dashboard", "JobRow", "Jobs", "Shown", "SlotRow", "Timeline", "build_dashboard", "build_jobs",
    "build_semaphore_timeline", "build_timeline",
]

HOUR = dt.timedelta(hours=1)
DAY = dt.timedelta(days=1)
MINUTES = 60
TIMELINE_LOCKS = 6
TIMELINE_GRANTS = 10
TIMELINE_MARKS = 300
CONTENDED_KEYS = 10
SEMAPHORE_SLOTS = 20  # slots drawn on a semaphore's timeline (the lowest numbers)
SEMAPHORE_GRANTS = 40  # its most recent grants, over all its slots
# A permit's key is <name>@<slot> (coordination.semaphores); the dashboard's
# key form takes <name>@* for the whole semaphore.
SLOT_KEY = re.compile(r"(?P<name>.+)@(?P<slot>[1-9][0-9]*)")
SEMAPHORE_SUFFIX = "@*"

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
class Shown:
    """What the viewer may see: the histories their view permissions cover, and the
    keys their access rules let them read. The default shows everything."""

    grants: bool = True
    rejections: bool = True
    accepted_writes: bool = True
    access: Access = UNRESTRICTED

    def keys(self, rows: QuerySet[Any], field: str) -> QuerySet[Any]:
        """``rows`` of the keys (column ``field``) the viewer may read."""
        return self.access.filter(rows, "read", field)


@dataclass(frozen=True)
class Tick:
    x: float
    label: str


@dataclass(frozen=True)
class Counts:
    held: int
    expired: int
    free: int
    # None: not shown to this viewer (or, for accepted writes, not recorded).
    grants_hour: int | None
    grants_day: int | None
    refused_hour: int | None
    refused_day: int | None
    accepted_hour: int | None


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
    grants_total: int | None  # None: the series is not shown to this viewer
    refused_total: int | None


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
    refused: int | None  # None: refused writes are not shown to this viewer


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
    mode: str = "exclusive"  # GrantMode value: shared lanes are readers (drawn hatched)
    key: str = ""  # the lock key, on a semaphore's timeline (the slot's key)
    slot: int = 0  # the slot number, on a semaphore's timeline

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
class SlotRow:
    """One slot of a semaphore's timeline: a row of its own, the slot's grants
    one after the other on it (two leases of a slot never overlap)."""

    slot: int
    key: str
    lock_id: int
    state: str
    token: int
    y: float
    lanes: list[Lane] = field(default_factory=list)

    @property
    def label_y(self) -> float:
        return self.y + LANE_HEIGHT / 2


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
    semaphore: str = ""  # a semaphore's timeline: its name (``key`` is ``<name>@*``)
    slots: list[SlotRow] = field(default_factory=list)

    @property
    def held(self) -> int:
        """A semaphore's slots held now."""
        return sum(1 for row in self.slots if row.state == "held")

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
    chart: MinuteChart | None  # None: neither grants nor refused writes are shown
    contended: list[ContendedKey] | None  # None: grants are not shown
    timelines: list[Timeline]  # empty when grants are not shown: a lane is a grant
    recording_writes: bool
    shown: Shown = field(default_factory=Shown)
    roles: list[RoleRow] = field(default_factory=list)


def build_dashboard(
    keys: Sequence[str] = (), *, using: str | None = None, shown: Shown | None = None
) -> Dashboard:
    """Everything the dashboard page shows, as of the database's current time.

    ``keys`` chooses the locks drawn as timelines; by default the most recently
    granted ones. The slots of a semaphore (keys ``<name>@<n>``) are drawn
    together, on one timeline of the semaphore (:func:`build_semaphore_timeline`),
    in place of the first of them; ``<name>@*`` chooses it. ``shown`` limits it
    to what the viewer may see (default: all); keys outside the viewer's rules
    are left out as if they did not exist.
    """
    alias = using or app_settings.DATABASE
    shown = shown or Shown()
    now = database_now(alias)
    timelines: list[Timeline] = []
    if shown.grants:
        if keys:
            # A key outside the viewer's rules is as a key that does not exist
            # (a semaphore's slots are filtered one by one).
            keys = [
                key for key in keys
                if key.endswith(SEMAPHORE_SUFFIX) or shown.access.allows("read", key)
            ]
        else:
            # More keys than timelines: a semaphore's slots make one timeline.
            keys = recent_keys(TIMELINE_LOCKS * 3, using=alias, access=shown.access)
        subjects = _timeline_subjects(keys)[:TIMELINE_LOCKS]
        locks = {lock.key: lock for lock in Lock.objects.using(alias).filter(key__in=subjects)}
        for subject in subjects:
            if subject.endswith(SEMAPHORE_SUFFIX):
                name = subject.removesuffix(SEMAPHORE_SUFFIX)
                semaphore = build_semaphore_timeline(name, now, using=alias, shown=shown)
                if semaphore is not None:
                    timelines.append(semaphore)
            elif subject in locks:
                timelines.append(build_timeline(locks[subject], now, using=alias, shown=shown))
    return Dashboard(
        now=now,
        counts=_counts(now, alias, shown),
        chart=_minute_chart(now, alias, shown) if shown.grants or shown.rejections else None,
        contended=_contended(now, alias, shown) if shown.grants else None,
        timelines=timelines,
        recording_writes=bool(app_settings.RECORD_WRITES),
        shown=shown,
        roles=_roles(now, alias, shown),
    )


def recent_keys(
    limit: int, *, using: str | None = None, access: Access = UNRESTRICTED
) -> list[str]:
    """The keys of the locks granted most recently, newest first (of those ``access`` reads)."""
    alias = using or app_settings.DATABASE
    keys: list[str] = []
    # The acquired_at index makes this a short scan, however long the history.
    granted = access.filter(Grant.objects.using(alias), "read", "lock__key")
    recent = granted.order_by("-acquired_at").values_list("lock__key", flat=True)
    for key in recent[: limit * 50]:
        if key not in keys:
            keys.append(key)
            if len(keys) == limit:
                break
    return keys


def _marks_and_axis(
    alias: str, keys: list[str], spans: list[tuple[Grant, dt.datetime, dt.datetime, str]],
    now: dt.datetime, shown: Shown,
) -> tuple[dt.datetime, dt.datetime, list[Rejection], list[AcceptedWrite]]:
    """The writes to mark (refused, and accepted when recorded; the newest
    :data:`TIMELINE_MARKS` of each that ``shown`` lets the viewer see) of the
    grants in ``spans`` on ``keys``, and the time axis that holds their bars
    and marks, with a little room on both sides so marks at the edges stay
    visible."""
    start = min((begin for _, begin, _, _ in spans), default=now - dt.timedelta(minutes=1))
    tokens = {grant.token for grant, _, _, _ in spans}
    refused = list(
        Rejection.objects.using(alias)
        .filter(lock_key__in=keys, token__in=tokens, created_at__gte=start)
        .order_by("-created_at")[:TIMELINE_MARKS]
    ) if shown.rejections else []
    accepted = list(
        AcceptedWrite.objects.using(alias)
        .filter(lock_key__in=keys, token__in=tokens, created_at__gte=start)
        .order_by("-created_at")[:TIMELINE_MARKS]
    ) if shown.accepted_writes else []
    end = max(
        [finish for _, _, finish, _ in spans]
        + [row.created_at for row in refused]
        + [row.created_at for row in accepted]
        + [start + dt.timedelta(seconds=1)]
    )
    pad = (end - start) * 0.03
    return start - pad, end + pad, refused, accepted


def build_timeline(
    lock: Lock, now: dt.datetime, *, using: str | None = None, shown: Shown | None = None
) -> Timeline:
    """One lock's recent grants as bars on the database-time axis, with its writes marked.

    A bar runs from acquire to release, revoke or expiry; a live lease runs to
    ``now``. Refused writes (always recorded) and accepted writes (when
    RECORD_WRITES is on) are marked on the lane of the token that made them,
    each only if ``shown`` lets the viewer see them.
    """
    alias = using or app_settings.DATABASE
    shown = shown or Shown()
    grants = list(
        Grant.objects.using(alias).filter(lock=lock).order_by("-token")[:TIMELINE_GRANTS]
    )[::-1]
    spans = [(grant, *_span(grant, now)) for grant in grants]
    start, end, refused, accepted = _marks_and_axis(alias, [lock.key], spans, now, shown)
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
                mode=grant.mode,
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


def _timeline_subjects(keys: Sequence[str]) -> list[str]:
    """``keys`` with each slot key replaced by its semaphore (``<name>@*``), where
    the first of its slots was, each subject once."""
    subjects: list[str] = []
    for key in keys:
        slot = SLOT_KEY.fullmatch(key)
        subject = f"{slot['name']}{SEMAPHORE_SUFFIX}" if slot else key
        if subject not in subjects:
            subjects.append(subject)
    return subjects


def build_semaphore_timeline(
    name: str, now: dt.datetime, *, using: str | None = None, shown: Shown | None = None
) -> Timeline | None:
    """A semaphore's recent permits on one database-time axis: a row per slot.

    Each slot (lock ``<name>@<n>``, of the first :data:`SEMAPHORE_SLOTS` the
    viewer may read) is a row, its grants drawn one after the other on it, so
    the permits live at any moment are the bars a vertical line crosses: never
    more than the slots. Writes are marked on the bar of the token (of that
    slot) that made them, as on a lock's timeline. None if no slot of ``name``
    was ever granted (or none is readable).
    """
    alias = using or app_settings.DATABASE
    shown = shown or Shown()
    slot_locks = sorted(
        (
            (int(match["slot"]), lock)
            for lock in Lock.objects.using(alias).filter(key__startswith=f"{name}@")
            if (match := SLOT_KEY.fullmatch(lock.key)) and match["name"] == name
            and shown.access.allows("read", lock.key)
        ),
        key=lambda pair: pair[0],
    )[:SEMAPHORE_SLOTS]
    if not slot_locks:
        return None
    grants = list(
        Grant.objects.using(alias).filter(lock__in=[lock for _, lock in slot_locks])
        .select_related("lock").order_by("-acquired_at")[:SEMAPHORE_GRANTS]
    )[::-1]
    spans = [(grant, *_span(grant, now)) for grant in grants]
    keys = [lock.key for _, lock in slot_locks]
    start, end, refused, accepted = _marks_and_axis(alias, keys, spans, now, shown)
    timeline = Timeline(
        key=f"{name}{SEMAPHORE_SUFFIX}",
        lock_id=slot_locks[0][1].pk,
        state="semaphore",
        token=0,
        start=start,
        end=end,
        width=TIMELINE_WIDTH,
        height=len(slot_locks) * (LANE_HEIGHT + LANE_GAP) + LANE_GAP + AXIS_HEIGHT,
        semaphore=name,
    )
    rows: dict[str, SlotRow] = {}
    for index, (slot, lock) in enumerate(slot_locks):
        rows[lock.key] = SlotRow(
            slot=slot, key=lock.key, lock_id=lock.pk, state=str(lock.state_at(now)),
            token=lock.token, y=LANE_GAP + index * (LANE_HEIGHT + LANE_GAP),
        )
    timeline.slots = list(rows.values())
    scale = _TimeScale(start, end, LABEL_WIDTH, TIMELINE_WIDTH - TIMELINE_RIGHT)
    lane_y: dict[tuple[str, int], float] = {}
    for grant, begin, finish, end_kind in spans:
        row = rows[grant.lock.key]
        left = scale.x(begin)
        lane = Lane(
            token=grant.token, holder=grant.holder, end=end_kind, acquired_at=begin,
            ends_at=finish, y=row.y, bar_x=left,
            bar_width=round(max(scale.x(finish) - left, 2.0), 1), mode=grant.mode,
            key=row.key, slot=row.slot,
        )
        row.lanes.append(lane)
        timeline.lanes.append(lane)
        lane_y[(row.key, grant.token)] = row.y
    for written in accepted:
        if (y := lane_y.get((written.lock_key, written.token))) is not None:
            timeline.marks.append(
                Mark("accepted", written.token, written.step, written.resource, "",
                     written.created_at, scale.x(written.created_at), y + LANE_HEIGHT / 2)
            )
    for rejection in refused:
        if (y := lane_y.get((rejection.lock_key, rejection.token))) is not None:
            timeline.marks.append(
                Mark("refused", rejection.token, rejection.step, rejection.resource,
                     rejection.reason, rejection.created_at, scale.x(rejection.created_at),
                     y + LANE_HEIGHT / 2)
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


def _counts(now: dt.datetime, alias: str, shown: Shown) -> Counts:
    locks = cast(LockQuerySet, shown.keys(Lock.objects.using(alias), "key"))
    grants = shown.keys(Grant.objects.using(alias), "lock__key")
    rejections = shown.keys(Rejection.objects.using(alias), "lock_key")
    accepted = shown.keys(AcceptedWrite.objects.using(alias), "lock_key")
    recording = bool(app_settings.RECORD_WRITES)
    return Counts(
        held=locks.held().count(),
        expired=locks.expired().count(),
        free=locks.free().count(),
        grants_hour=grants.filter(acquired_at__gt=now - HOUR).count() if shown.grants else None,
        grants_day=grants.filter(acquired_at__gt=now - DAY).count() if shown.grants else None,
        refused_hour=(
            rejections.filter(created_at__gt=now - HOUR).count() if shown.rejections else None
        ),
        refused_day=(
            rejections.filter(created_at__gt=now - DAY).count() if shown.rejections else None
        ),
        accepted_hour=(
            accepted.filter(created_at__gt=now - HOUR).count()
            if recording and shown.accepted_writes
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


def _minute_chart(now: dt.datetime, alias: str, shown: Shown) -> MinuteChart:
    last = now.replace(second=0, microsecond=0)
    first = last - dt.timedelta(minutes=MINUTES - 1)
    minutes = [first + dt.timedelta(minutes=i) for i in range(MINUTES)]
    series = [
        (0.1, "grants", _per_minute(shown.keys(Grant.objects.using(alias), "lock__key"),
                                    "acquired_at", first) if shown.grants else None),
        (0.5, "refused", _per_minute(shown.keys(Rejection.objects.using(alias), "lock_key"),
                                     "created_at", first) if shown.rejections else None),
    ]
    grants, refused = (counts or {} for _, _, counts in series)
    top = _nice_ceiling(max([*grants.values(), *refused.values(), 1]))
    left, right = CHART_LEFT, CHART_WIDTH - CHART_RIGHT
    baseline = CHART_HEIGHT - CHART_BOTTOM
    plot_height = baseline - CHART_TOP
    slot = (right - left) / MINUTES
    bar_width = round(slot * 0.4, 1)
    bars: list[ChartBar] = []
    for index, minute in enumerate(minutes):
        label = f"{minute:%H:%M}"
        for offset, kind, counts in series:
            if counts is None:
                continue
            count = counts.get(minute, 0)
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
        grants_total=sum(grants.values()) if shown.grants else None,
        refused_total=sum(refused.values()) if shown.rejections else None,
    )


def _contended(now: dt.datetime, alias: str, shown: Shown) -> list[ContendedKey]:
    """Keys with the most grants in the last hour, with their holders and refused writes."""
    since = now - HOUR
    rows = list(
        shown.keys(Grant.objects.using(alias), "lock__key")
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
    ) if shown.rejections else {}
    return [
        ContendedKey(
            key, lock_id, grants, holders, refused.get(key, 0) if shown.rejections else None
        )
        for key, lock_id, grants, holders in rows
    ]


# Celery task holders read "app.tasks.deposit[<task id>]#1 on host:pid".
_TASK_HOLDER = re.compile(r"^(?:[\w.]*\.)?(?P<name>[\w-]+)\[[^\]]*\](?:#\d+)?(?P<rest>.*)$")


def _roles(now: dt.datetime, alias: str, shown: Shown, limit: int = 10) -> list[RoleRow]:
    """Election roles (locks ``election:<role>``) the viewer may read, most
    recently granted first."""
    rows = (
        shown.keys(Lock.objects.using(alias), "key").filter(key__startswith="election:")
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


# --- jobs ---------------------------------------------------------------------


@dataclass(frozen=True)
class JobRow:
    """One fenced task on the jobs page: what runs now, what did not run, its policy.

    ``refused`` is None for a viewer without ``view_rejection``; ``running``
    holds only the executions whose keys the viewer may read.
    """

    task: str
    policy: JobPolicy | None
    running: list[jobs.Running]
    deferred: int
    skipped: int
    refused: int | None
    may_steer: bool = False

    @property
    def paused(self) -> bool:
        return self.policy is not None and self.policy.paused

    @property
    def own_policy(self) -> bool:
        """Whether the policy is the task's own row (not a pattern naming it)."""
        return self.policy is not None and self.policy.task == self.task


@dataclass(frozen=True)
class Jobs:
    now: dt.datetime
    rows: list[JobRow]
    patterns: list[JobPolicy]


def registered_fenced_tasks() -> list[str]:
    """The names of the fenced Celery tasks this process knows (none without Celery)."""
    try:
        from celery import current_app

        from .contrib.celery import FencedTask
    except ImportError:
        return []
    return sorted(name for name, task in current_app.tasks.items() if isinstance(task, FencedTask))


def build_jobs(*, shown: Shown = Shown(), may_steer: Any = None, limit: int = 200) -> Jobs:
    """The jobs page: every fenced task known (registered here, with a policy, a
    count or an execution running now) that the viewer may read as the key
    ``task:<name>``, with its executions running now (live grants, by the
    database clock), its deferred and skipped counts, its refused writes of
    the last day and the policy in force. ``may_steer(task)`` says whether
    the viewer may pause and resume it."""
    alias = app_settings.DATABASE
    now = database_now(alias)
    readable = shown.access.allows
    policies = list(JobPolicy.objects.using(alias).order_by("task"))
    exact = {policy.task: policy for policy in policies if not policy.task.endswith("*")}
    patterns = sorted(
        (policy for policy in policies if policy.task.endswith("*")),
        key=lambda policy: len(policy.task), reverse=True,
    )
    tallies: dict[str, dict[str, int]] = {}
    for task, outcome, count in JobTally.objects.using(alias).values_list("task", "outcome", "count"):
        tallies.setdefault(task, {})[outcome] = count
    running: dict[str, list[jobs.Running]] = {}
    for execution in jobs.running(using=alias):
        running.setdefault(execution.task, []).append(execution)
    names = sorted(
        {*registered_fenced_tasks(), *exact, *tallies, *running}, key=str
    )
    names = [name for name in names if readable("read", jobs.permit_name(name))][:limit]
    refused: dict[str, int] = {}
    if shown.rejections and names:
        recent = shown.keys(
            Rejection.objects.using(alias).filter(created_at__gte=now - DAY), "lock_key"
        )
        # A refusal is a task's when its token is a recorded execution's grant.
        tasks = jobs.executions_of(recent).filter(execution_task__isnull=False)
        for name in tasks.values_list("execution_task", flat=True):
            refused[name] = refused.get(name, 0) + 1
    rows = []
    for name in names:
        policy = exact.get(name) or next(
            (pattern for pattern in patterns if name.startswith(pattern.task[:-1])), None
        )
        counts = tallies.get(name, {})
        rows.append(JobRow(
            task=name, policy=policy,
            running=[run for run in running.get(name, []) if readable("read", run.key)],
            deferred=counts.get(JobOutcome.DEFERRED, 0), skipped=counts.get(JobOutcome.SKIPPED, 0),
            refused=refused.get(name, 0) if shown.rejections else None,
            may_steer=bool(may_steer(name)) if may_steer is not None else False,
        ))
    visible_patterns = [
        policy for policy in patterns if readable("read", jobs.permit_name(policy.task))
    ]
    return Jobs(now=now, rows=rows, patterns=visible_patterns)
