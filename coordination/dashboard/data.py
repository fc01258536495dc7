"""The values the dashboard pages show: small dataclasses, apart from the queries
that fill them (:mod:`.queries`, :mod:`.pages`)."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from typing import Any

from django.db.models import QuerySet

from ..access import UNRESTRICTED, Access
from .geometry import (
    AXIS_HEIGHT,
    LABEL_WIDTH,
    LANE_HEIGHT,
    TIMELINE_RIGHT,
    TIMELINE_WIDTH,
    Tick,
    _short_holder,
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
