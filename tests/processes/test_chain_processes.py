"""Fenced tasks inside Celery chains and chords, on a real prefork worker with a Redis
broker and on the embedded default (SQLite and the filesystem broker).

What a link that does not run its body does to the rest, as docs/celery.md
states it: a deferred link (paused job policy) continues the chain when it
runs, since its message is sent again with the chain; a skipped link hands
the next link its ``Skipped`` result; a link whose task id completed before
(``once``) hands the next link the stored result; a refused link (a fenced
write refused) fails, and the chain stops there, as for any failed task. In a
chord, a skipped member's ``Skipped`` is among the results the body gets; a
refused member fails the chord: its body does not run (Redis only: a chord needs
a result backend, which the embedded default has none of).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from celery import chain
from django.db import connection

from coordination import locks
from coordination.models import JobPolicy, JobTally
from tests.support import once_tasks as tasks
from tests.support.celery_workers import (
    RedisBroker,
    Worker,
    events,
    unique,
    wait_for_event,
)
from tests.support.waiting import wait_for

pytestmark = [
    pytest.mark.legs(
        "pg", "sqlite", reason="a real worker on Redis (PostgreSQL) and on the embedded default "
        "(SQLite and the filesystem broker); chains are Celery's, not the database's",
    ),
    pytest.mark.django_db(transaction=True),
]
# The job policies' refresh in the worker processes (COORDINATION["JOB_POLICY_REFRESH"]).
REFRESH = 2.0


@pytest.fixture(scope="module")
def via(request: pytest.FixtureRequest) -> RedisBroker | None:
    """The broker the chains go through: the module's Redis, or on the SQLite leg
    the site's own filesystem broker (None), as ``bin/run`` sets it up."""
    if connection.vendor == "sqlite":
        return None
    broker: RedisBroker = request.getfixturevalue("broker")
    return broker


@pytest.fixture(scope="module")
def worker(start_workers: Callable[..., Worker], via: RedisBroker | None) -> Worker:
    if via is None:
        return start_workers("chains", embedded=True, pool="prefork", concurrency=1)
    # A chord needs a result backend: the worker's settings read it from the environment.
    return start_workers("chains", pool="prefork", concurrency=1, CELERY_RESULT_BACKEND=via.url)


def link(task: Any, name: str, report: Path, worker: Worker, **options: Any) -> Any:
    return task.s(name=name, report=str(report)).set(queue=worker.queue, **options)


def send(signature: Any, broker: RedisBroker | None) -> None:
    if broker is None:
        signature.apply_async()
        return
    with broker.connection() as conn:
        signature.apply_async(connection=conn)


def send_chain(
    broker: RedisBroker | None, worker: Worker, report: Path, middle: Any, names: tuple[str, str, str],
    **middle_options: Any,
) -> None:
    """Send ``step(names[0]) | middle(names[1]) | step(names[2])``."""
    first = tasks.step.s([], name=names[0], report=str(report)).set(queue=worker.queue)
    send(chain(
        first, link(middle, names[1], report, worker, **middle_options),
        link(tasks.step, names[2], report, worker),
    ), broker)


def steps(report: Path) -> dict[str, list[dict[str, Any]]]:
    seen: dict[str, list[dict[str, Any]]] = {}
    for event in events(report):
        if event["event"] == "step":
            seen.setdefault(event["name"], []).append(event)
    return seen


def test_a_chain_of_fenced_links_hands_each_result_on(
    worker: Worker, via: RedisBroker | None, tmp_path: Path
) -> None:
    report = tmp_path / "events.jsonl"
    names = (unique("a"), unique("b"), unique("c"))
    send_chain(via, worker, report, tasks.step, names)

    wait_for(lambda: names[2] in steps(report), timeout=60, what="the last link")
    assert steps(report)[names[2]][0]["received"] == list(names[:2])


def test_a_link_whose_task_id_completed_hands_on_the_stored_result_without_running(
    worker: Worker, via: RedisBroker | None, tmp_path: Path
) -> None:
    report, done_id = tmp_path / "events.jsonl", unique("done")
    a, b, c = unique("a"), unique("b"), unique("c")
    # The middle link's task id ran before, on other input: its result is stored.
    earlier = tasks.step.s(["earlier"], name=b, report=str(report))
    send(earlier.set(queue=worker.queue, task_id=done_id), via)
    wait_for(lambda: b in steps(report), timeout=60, what="the earlier run")

    send_chain(via, worker, report, tasks.step, (a, b, c), task_id=done_id)

    wait_for(lambda: c in steps(report), timeout=60, what="the last link")
    assert len(steps(report)[b]) == 1  # not run again
    assert steps(report)[c][0]["received"] == ["earlier", b]  # the stored result


def test_a_skipped_link_hands_the_next_its_skipped_result(
    worker: Worker, via: RedisBroker | None, tmp_path: Path
) -> None:
    report = tmp_path / "events.jsonl"
    a, busy, c = unique("a"), unique("busy"), unique("c")
    held = locks.acquire(f"step:{busy}", holder="test", ttl=60)
    try:
        send_chain(via, worker, report, tasks.skippable_step, (a, busy, c))
        wait_for(lambda: c in steps(report), timeout=60, what="the link after the skipped one")
    finally:
        locks.release(held)
    assert busy not in steps(report)
    received = steps(report)[c][0]["received"]
    assert received["coordination"] == "skipped" and received["reason"] == "lock_held"
    assert received["key"] == f"step:{busy}"


def test_a_deferred_link_continues_the_chain_when_it_runs(
    worker: Worker, via: RedisBroker | None, tmp_path: Path
) -> None:
    policy = JobPolicy(task=tasks.paused_step.name, paused=True, defer_seconds=0.5)
    policy.save(changed_by="test", via="orm")
    time.sleep(REFRESH + 0.5)
    report = tmp_path / "events.jsonl"
    a, paused, c = unique("a"), unique("paused"), unique("c")
    send_chain(via, worker, report, tasks.paused_step, (a, paused, c))

    def deferred() -> int:
        row = JobTally.objects.filter(task=tasks.paused_step.name, outcome="deferred").first()
        return row.count if row else 0

    wait_for(lambda: deferred() >= 2, timeout=60, what="the paused link deferred twice")
    assert a in steps(report) and paused not in steps(report) and c not in steps(report)
    policy.paused = False
    policy.save(changed_by="test", via="orm")

    wait_for(lambda: c in steps(report), timeout=60, what="the chain's rest after the resume")
    assert steps(report)[c][0]["received"] == [a, paused]
    assert len(steps(report)[paused]) == 1


def test_a_refused_link_stops_the_chain(
    worker: Worker, via: RedisBroker | None, tmp_path: Path
) -> None:
    report = tmp_path / "events.jsonl"
    a, refused, c, marker = unique("a"), unique("refused"), unique("c"), unique("marker")
    send_chain(via, worker, report, tasks.refused_step, (a, refused, c))
    wait_for_event(report, lambda e: e["event"] == "refused", workers=[worker])
    # A message sent after the refusal and run after it (one solo worker), then time
    # for a next link that would have been sent at the refused link's end.
    send(link(tasks.step, marker, report, worker).clone(args=([],)), via)
    wait_for(lambda: marker in steps(report), timeout=60, what="the marker")
    time.sleep(2.0)
    assert c not in steps(report)


@pytest.mark.legs("pg", reason="a chord needs a result backend: Redis's; the embedded default has none")
def test_a_chord_gets_a_skipped_members_result_and_a_refused_member_fails_it(
    worker: Worker, via: RedisBroker | None, tmp_path: Path
) -> None:
    report = tmp_path / "events.jsonl"
    x, busy, y = unique("x"), unique("busy"), unique("y")
    held = locks.acquire(f"step:{busy}", holder="test", ttl=60)
    try:
        send(tasks.launch_chord.s(
            [("step", x), ("skippable", busy), ("step", y)], report=str(report), queue=worker.queue,
        ).set(queue=worker.queue), via)
        collected = wait_for_event(report, lambda e: e["event"] == "collected", timeout=60, workers=[worker])
    finally:
        locks.release(held)
    first, skipped, last = collected["results"]
    assert first == [x] and last == [y]
    assert skipped["coordination"] == "skipped" and skipped["reason"] == "lock_held"

    refused_report = tmp_path / "refused.jsonl"
    z, refused = unique("z"), unique("refused")
    send(tasks.launch_chord.s(
        [("step", z), ("refused", refused)], report=str(refused_report), queue=worker.queue,
    ).set(queue=worker.queue), via)
    wait_for_event(refused_report, lambda e: e["event"] == "refused", workers=[worker])
    wait_for(lambda: z in steps(refused_report), timeout=60, what="the chord's other member")
    time.sleep(2.0)
    assert not [e for e in events(refused_report) if e["event"] == "collected"]
