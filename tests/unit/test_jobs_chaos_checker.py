"""The jobs chaos checks over committed rows (project/lab/chaos/jobs.py), without a database."""

from __future__ import annotations

import datetime as dt
from typing import Any

from project.lab.chaos.jobs_checks import (
    lost_task_ids,
    most_at_once,
    most_in_window,
    ran_more_than_once,
    unique_keys_run_twice,
)

T0 = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)


def _at(seconds: float) -> dt.datetime:
    return T0 + dt.timedelta(seconds=seconds)


def _cap(key: str, task_id: str, token: int, start: float, end: float | None) -> list[dict[str, Any]]:
    rows = [{"scenario": "cap", "key": key, "phase": "start", "task_id": task_id, "token": token,
             "at": _at(start)}]
    if end is not None:
        rows.append({"scenario": "cap", "key": key, "phase": "end", "task_id": task_id, "token": token,
                     "at": _at(end)})
    return rows


def test_overlapping_intervals_are_counted_per_key() -> None:
    rows = [*_cap("a", "1", 1, 0, 3), *_cap("a", "2", 2, 1, 4), *_cap("a", "3", 3, 2, 5),
            *_cap("b", "4", 1, 0, 10)]
    assert most_at_once(rows) == {"a": 3, "b": 1}


def test_an_interval_that_ends_when_the_next_starts_does_not_overlap_it() -> None:
    rows = [*_cap("a", "1", 1, 0, 2), *_cap("a", "2", 2, 2, 4), *_cap("a", "3", 3, 1, 3)]
    assert most_at_once(rows) == {"a": 2}


def test_a_copy_whose_end_was_refused_counts_from_neither_row() -> None:
    # The stale copy (token 1) wrote its start, then was refused at its end.
    rows = [*_cap("a", "1", 1, 0, None), *_cap("a", "1", 2, 1, 3), *_cap("a", "2", 3, 1, 3)]
    assert most_at_once(rows) == {"a": 2}


def test_a_task_id_with_two_committed_bodies_ran_more_than_once() -> None:
    rows = [{"scenario": "once", "phase": "body", "task_id": task_id} for task_id in ("x", "y", "x")]
    rows.append({"scenario": "once", "phase": "done", "task_id": "y"})
    assert ran_more_than_once(rows) == {"x": 2}


def test_a_task_id_sent_without_a_committed_body_is_lost() -> None:
    rows = [{"scenario": "once", "phase": "body", "task_id": "x"},
            {"scenario": "once", "phase": "done", "task_id": "z"}]
    assert lost_task_ids(rows, ["x", "y", "z"], "once", "body") == ["y", "z"]


def test_a_unique_key_run_by_two_messages_is_counted_but_a_redelivery_is_not() -> None:
    rows = [{"scenario": "unique", "phase": "body", "key": key, "task_id": task_id}
            for key, task_id in (("a", "1"), ("a", "1"), ("b", "2"), ("b", "3"), ("b", "4"))]
    assert unique_keys_run_twice(rows) == {"b": 3}


def test_the_most_starts_in_one_half_open_window() -> None:
    starts = [_at(0), _at(1), _at(3), _at(3.5), _at(5.9)]
    assert most_in_window(starts, 3.0) == 3  # 3, 3.5 and 5.9
    assert most_in_window([_at(0), _at(3)], 3.0) == 1  # [0, 3) leaves 3 out
    assert most_in_window([], 3.0) == 0
