"""The lock dashboard's page: its counts, chart, contended keys, roles and the
timelines of locks and semaphores, laid out on the database-time axis."""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence

from ..conf import app_settings
from ..locks import database_now
from ..models import Grant, Lock, Rejection
from ..semaphores import QUEUE_KEY_SUFFIX, parse_slot_key
from .data import ChartBar, Dashboard, GridLine, Lane, Mark, MinuteChart, Shown, SlotRow, Timeline
from .geometry import (
    AXIS_HEIGHT,
    CHART_BOTTOM,
    CHART_HEIGHT,
    CHART_LEFT,
    CHART_RIGHT,
    CHART_TOP,
    CHART_WIDTH,
    LABEL_WIDTH,
    LANE_GAP,
    LANE_HEIGHT,
    TIMELINE_RIGHT,
    TIMELINE_WIDTH,
    Tick,
    _nice_ceiling,
    _TimeScale,
)
from .queries import (
    _contended,
    _counts,
    _marks_and_axis,
    _per_minute,
    _roles,
    _span,
    recent_keys,
)

MINUTES = 60
TIMELINE_LOCKS = 6
TIMELINE_GRANTS = 10
SEMAPHORE_SLOTS = 20  # slots drawn on a semaphore's timeline (the lowest numbers)
SEMAPHORE_GRANTS = 40  # its most recent grants, over all its slots
# A permit's key is <name>@<slot> (coordination.semaphores.slot_key); the
# dashboard's key form takes <name>@* for the whole semaphore.
SEMAPHORE_SUFFIX = QUEUE_KEY_SUFFIX


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
        slot = parse_slot_key(key)
        subject = f"{slot[0]}{SEMAPHORE_SUFFIX}" if slot else key
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
            (parsed[1], lock)
            for lock in Lock.objects.using(alias).filter(key__startswith=f"{name}@")
            if (parsed := parse_slot_key(lock.key)) and parsed[0] == name
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


