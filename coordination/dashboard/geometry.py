"""The dashboard's pictures as plain geometry: SVG pixel sizes, the time axis and its
ticks, the chart's rounded ceiling and the labels that fit beside a lane."""

from __future__ import annotations

import datetime as dt
import math
from dataclasses import dataclass

from ..holders import parse_task_holder

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



def _short_holder(holder: str) -> str:
    """The holder, shortened to fit beside a lane: a Celery task's holder
    (:func:`coordination.holders.task_holder`) as its task's last name and process."""
    task = parse_task_holder(holder)
    if task is not None:
        holder = f"{task.short_name}{task.rest}"
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
