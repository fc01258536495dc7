"""The duplicate check of a beat chaos run (project/lab/chaos/beat.py), on
histories written by hand: the function that judges the real runs, fenced and
stock, reports a slot that ran twice and nothing else."""

from __future__ import annotations

from typing import Any

from project.lab.chaos.beat import executed_more_than_once, slot_of

SLOT = "beat-chaos/tick@2026-12-02T01:00:0{}.000Z"


def fenced(second: int, at: float, pid: int = 100) -> dict[str, Any]:
    """An execution as the beat task records one sent by the FencedScheduler."""
    return {"slot": SLOT.format(second), "pid": pid, "at": at}


def stock(at: float, pid: int = 100) -> dict[str, Any]:
    """An execution sent by Celery's stock scheduler: no slot header."""
    return {"slot": None, "pid": pid, "at": at}


def test_a_fenced_history_with_a_slot_run_twice_is_reported() -> None:
    history = [fenced(1, 1.0), fenced(2, 2.0), fenced(2, 2.9, pid=200), fenced(3, 3.0)]
    assert executed_more_than_once(history, interval=1.0) == {SLOT.format(2): 2}


def test_the_slot_names_the_execution_not_the_clock() -> None:
    # Two slots run late into the same second (a backlog after a take-over):
    # not a duplicate; the same slot run in two different seconds: one.
    late = [fenced(1, 5.1), fenced(2, 5.2), fenced(3, 6.0), fenced(3, 9.5, pid=200)]
    assert executed_more_than_once(late, interval=1.0) == {SLOT.format(3): 2}


def test_a_history_without_a_duplicate_passes() -> None:
    assert executed_more_than_once([fenced(n, float(n)) for n in range(1, 6)], interval=1.0) == {}
    assert executed_more_than_once([], interval=1.0) == {}


def test_a_stock_history_counts_the_executions_of_one_interval() -> None:
    # Two stock beats each send the entry every second.
    history = [stock(10.1), stock(10.2, pid=200), stock(11.1), stock(12.1), stock(12.3, pid=200)]
    assert executed_more_than_once(history, interval=1.0) == {"interval 10": 2, "interval 12": 2}
    assert slot_of(stock(10.1), interval=2.0) == "interval 5"
    assert slot_of(fenced(1, 10.1), interval=2.0) == SLOT.format(1)
