"""The thread and asyncio drivers of one fenced execution step the same steps:
the same log lines, counts and signals for a paused task (deferred or skipped)
and a busy one (skipped)."""

from __future__ import annotations

import asyncio
import logging
import re
from typing import Any

import pytest

from coordination import jobs, locks, signals
from coordination.contrib.execution import AsyncFencedExecution, FencedExecution
from coordination.models import JobPolicy, JobTally

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("uncached_policies")]

TASK = "tests.drivers.report"


def policy(**fields: Any) -> None:
    JobPolicy.objects.filter(task=TASK).delete()
    JobPolicy(task=TASK, **fields).save(changed_by="tester", via="test")
    jobs.clear_cache()


def options() -> dict[str, Any]:
    return {"holder": "drivers", "ttl": 5, "name": TASK, "label": f"{TASK}[1]"}


def run_sync(**run: Any) -> Any:
    return FencedExecution("report:drivers", **options()).run(lambda: "ran", **run)


def run_async(**run: Any) -> Any:
    async def body() -> str:
        return "ran"

    return asyncio.run(AsyncFencedExecution("report:drivers", **options()).run(body, **run))


def observe(caplog: pytest.LogCaptureFixture, call: Any) -> tuple[Any, list[tuple[str, str]],
                                                                  dict[str, int], list[str]]:
    """The outcome, the coordination.tasks log lines, the tallies and the skip signals."""
    JobTally.objects.filter(task=TASK).delete()
    heard: list[str] = []

    def listen(sender: Any, reason: str, **kwargs: Any) -> None:
        heard.append(reason)

    caplog.clear()
    signals.task_skipped.connect(listen)
    try:
        with caplog.at_level(logging.DEBUG, logger="coordination.tasks"):
            outcome = call()
    finally:
        signals.task_skipped.disconnect(listen)
    lines = [
        (r.levelname, _unclocked(r.getMessage())) for r in caplog.records if r.name == "coordination.tasks"
    ]
    tallies = {row.outcome: row.count for row in JobTally.objects.filter(task=TASK)}
    if isinstance(outcome, dict) and isinstance(outcome.get("detail"), str):
        outcome = {**outcome, "detail": _unclocked(outcome["detail"])}
    return outcome, lines, tallies, heard


# A busy lock's refusal says how long its lease has left: the two runs ask at
# different moments (30.0 s, then 29.9 s), which is no difference between drivers.
_RETRY_AFTER = re.compile(r"retry after [0-9.]+ s")


def _unclocked(text: str) -> str:
    return _RETRY_AFTER.sub("retry after (seconds) s", text)


@pytest.mark.parametrize("case", ["defer", "skip paused", "skip busy"])
def test_both_drivers_log_count_and_signal_the_same(
    caplog: pytest.LogCaptureFixture, case: str
) -> None:
    held = None
    run: dict[str, Any] = {}
    if case == "defer":
        policy(paused=True, defer_seconds=30)
        run = {"defer": lambda countdown: {"deferred": countdown}}
    elif case == "skip paused":
        policy(paused=True, when_paused="skip")
    else:
        policy(on_busy="skip")
        held = locks.acquire("report:drivers", holder="someone else", ttl=30)

    on_thread = observe(caplog, lambda: run_sync(**run))
    on_loop = observe(caplog, lambda: run_async(**run))
    if held is not None:
        locks.release(held)

    assert on_thread == on_loop
    outcome, lines, tallies, heard = on_thread
    if case == "defer":
        assert outcome == {"deferred": 30.0}
        assert [level for level, _ in lines] == ["INFO"] and "task deferred" in lines[0][1]
        assert tallies == {"deferred": 1} and heard == []
    else:
        reason = "paused" if case == "skip paused" else "lock_held"
        assert outcome["coordination"] == "skipped" and outcome["reason"] == reason
        assert len(lines) == 1 and "task skipped" in lines[0][1]
        assert tallies == {"skipped": 1} and heard == [reason]
