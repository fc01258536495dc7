"""The jobs chaos run's checks (:mod:`project.lab.chaos.jobs`), over the rows the
bodies committed: plain functions of rows, tested on hand-made ones."""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable
from typing import Any

__all__ = ["lost_task_ids", "most_at_once", "most_in_window", "ran_more_than_once", "unique_keys_run_twice"]


def most_at_once(rows: Iterable[dict[str, Any]]) -> dict[str, int]:
    """The most ``job_capped`` executions of each key whose intervals (start row to
    end row, database time) overlap at one moment. An execution whose end was
    refused (a stale copy) ended nothing and counts from neither row."""
    starts: dict[tuple[str, str, Any], Any] = {}
    ends: dict[tuple[str, str, Any], Any] = {}
    for row in rows:
        if row["scenario"] != "cap":
            continue
        identity = (row["key"], row["task_id"], row["token"])
        (starts if row["phase"] == "start" else ends)[identity] = row["at"]
    points: dict[str, list[tuple[Any, int]]] = defaultdict(list)
    for identity, started in starts.items():
        ended = ends.get(identity)
        if ended is not None:
            points[identity[0]] += [(started, 1), (ended, -1)]
    most: dict[str, int] = {}
    for key, moments in points.items():
        running = peak = 0
        for _, change in sorted(moments, key=lambda point: (point[0], point[1])):  # ends first
            running += change
            peak = max(peak, running)
        most[key] = peak
    return most


def ran_more_than_once(rows: Iterable[dict[str, Any]]) -> dict[str, int]:
    """Task ids of ``job_once`` whose body committed more than once, with the count."""
    bodies = Counter(row["task_id"] for row in rows if row["scenario"] == "once" and row["phase"] == "body")
    return {task_id: count for task_id, count in bodies.items() if count > 1}


def unique_keys_run_twice(rows: Iterable[dict[str, Any]]) -> dict[str, int]:
    """Keys of ``job_unique`` whose body committed under more than one message
    (task id), with the count: a redelivery of one message is not a duplicate."""
    ran: dict[str, set[str]] = defaultdict(set)
    for row in rows:
        if row["scenario"] == "unique" and row["phase"] == "body":
            ran[row["key"]].add(row["task_id"])
    return {key: len(ids) for key, ids in ran.items() if len(ids) > 1}


def most_in_window(times: Iterable[Any], period: float) -> int:
    """The most of ``times`` (datetimes) in one half-open window ``[t, t + period)``."""
    ordered = sorted(times)
    most = first = 0
    for last, moment in enumerate(ordered):
        while (moment - ordered[first]).total_seconds() >= period:
            first += 1
        most = max(most, last - first + 1)
    return most


def lost_task_ids(
    rows: Iterable[dict[str, Any]], sent: Iterable[str], scenario: str, phase: str
) -> list[str]:
    """Task ids sent whose body never committed its ``phase`` row."""
    done = {row["task_id"] for row in rows if row["scenario"] == scenario and row["phase"] == phase}
    return sorted(set(sent) - done)
