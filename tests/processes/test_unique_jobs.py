"""Unique jobs with real processes: producers in several processes racing for one
key, a duplicate message that reaches a real prefork worker, and a worker killed
with SIGKILL in the middle of a "while running" job, whose key is free again once
its lease expired by the database clock. The workers' tests: Redis broker,
PostgreSQL; the producers' race also on every leg (SQLite, filesystem broker)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from celery import Task

from coordination import unique
from coordination.models import Grant, JobTally
from tests.support import unique_tasks as tasks
from tests.support.celery_workers import (
    REPO,
    RedisBroker,
    Worker,
    events,
    start_worker,
    wait_for_event,
    wait_ready,
    worker_environment,
)
from tests.support.celery_workers import (
    unique as fresh,
)
from tests.support.waiting import wait_for, wait_until_database_time_passes

pytestmark = pytest.mark.django_db(transaction=True)
on_workers = pytest.mark.legs("pg", reason="real prefork workers paused and killed need row locks")

PRODUCERS = 6


def dup(result: Any) -> bool:
    """Whether an enqueue was a duplicate (False where nothing says so)."""
    return bool(getattr(result, "duplicate", False))


@pytest.fixture(scope="module")
def worker(start_workers: Callable[..., Worker]) -> Worker:
    return start_workers("unique", pool="prefork", concurrency=2)


def drained(worker: Worker, broker: RedisBroker) -> None:
    """Wait until the worker took and acknowledged every message of its queue."""
    wait_for(
        lambda: not broker.queue_length(worker.queue) and not broker.unacked_on(worker.queue),
        timeout=60, what="the queue drained",
    )


def race(run: str, queue: str, tmp_path: Path, env: dict[str, str], *folder: str) -> list[dict[str, Any]]:
    """Start the producers, open the barrier once all are connected; their outputs."""
    report, barrier = tmp_path / "events.jsonl", tmp_path / "barrier"
    barrier.mkdir()
    producers = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.support.unique_producer", run, str(n), queue,
             str(report), str(barrier), *folder],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )
        for n in range(PRODUCERS)
    ]
    try:
        wait_for(lambda: len(list(barrier.glob("ready-*"))) == PRODUCERS, timeout=90, what="producers ready")
        (barrier / "go").touch()
        outputs = [process.communicate(timeout=60) for process in producers]
    finally:
        for process in producers:
            if process.poll() is None:
                process.kill()
    assert all(process.returncode == 0 for process in producers), [err[-2000:] for _out, err in outputs]
    return [json.loads(out) for out, _err in outputs]


def test_producers_in_several_processes_on_the_embedded_default_send_one_message(tmp_path: Path) -> None:
    """Every leg, SQLite included: the messages go to a filesystem broker's folder."""
    folder = tmp_path / "broker"
    folder.mkdir()
    enqueued = race(fresh("race"), "nobody", tmp_path, worker_environment(None), str(folder))

    sent = [one for one in enqueued if not one["duplicate"]]
    assert len(sent) == 1, enqueued
    assert {one["id"] for one in enqueued} == {sent[0]["id"]}
    assert len(list(folder.iterdir())) == 1


@on_workers
def test_producers_in_several_processes_send_one_message_and_all_get_its_id(
    worker: Worker, broker: RedisBroker, tmp_path: Path
) -> None:
    run, report = fresh("race"), tmp_path / "events.jsonl"
    env = worker_environment(broker.url, COORDINATION_TEST_REDIS_PREFIX=broker.prefix)
    enqueued = race(run, worker.queue, tmp_path, env)

    sent = [one for one in enqueued if not one["duplicate"]]
    assert len(sent) == 1, enqueued
    assert {one["id"] for one in enqueued} == {sent[0]["id"]}  # every duplicate got its id

    wait_for_event(report, lambda e: e["event"] == "ran", timeout=60, workers=[worker])
    drained(worker, broker)
    ran = [e for e in events(report) if e["event"] == "ran"]
    assert [(e["n"], e["task_id"]) for e in ran] == [(sent[0]["n"], sent[0]["id"])]
    wait_for(lambda: unique.holder_of(f"uq:{run}") is None, what="the claim ended on success")


@on_workers
def test_a_duplicate_message_that_reaches_a_real_worker_does_not_run(
    worker: Worker, broker: RedisBroker, tmp_path: Path
) -> None:
    run, report = fresh("around"), tmp_path / "events.jsonl"
    with broker.connection() as conn:
        holder = tasks.until_succeeded.apply_async(
            (run, 1), {"report": str(report), "hold": 2.0}, queue=worker.queue, connection=conn
        )
        # Sent around the check (Celery's own apply_async, no claim), as a second
        # beat, a producer without the decorator or a replayed message would be.
        Task.apply_async(
            tasks.until_succeeded, (run, 2), {"report": str(report)}, queue=worker.queue,
            connection=conn,
        )
    skipped = wait_for_event(report, lambda e: e["event"] == "skipped", timeout=60, workers=[worker])
    wait_for_event(report, lambda e: e["event"] == "ran", timeout=60, workers=[worker])
    drained(worker, broker)

    assert skipped["reason"] == "duplicate"
    assert skipped["key"] == f"uq:{run}"
    assert skipped["args"] == [run, 2]
    ran = [e for e in events(report) if e["event"] == "ran"]
    assert [(e["n"], e["task_id"]) for e in ran] == [(1, holder.id)]
    assert JobTally.objects.get(task=tasks.until_succeeded.name, outcome="skipped").count >= 1


@pytest.mark.legs("sqlite", reason="the embedded default; the PostgreSQL leg runs it on Redis above")
def test_on_the_embedded_default_a_duplicate_reaching_a_prefork_worker_does_not_run(
    start_workers: Callable[..., Worker], tmp_path: Path
) -> None:
    """SQLite and the filesystem broker: a duplicate enqueue gets the holder's id, and
    a copy sent around the check to the broker's folder is skipped by the worker."""
    worker = start_workers("unique-embedded", embedded=True, pool="prefork", concurrency=2)
    run, report = fresh("embedded"), tmp_path / "events.jsonl"
    holder = tasks.until_succeeded.apply_async((run, 1), {"report": str(report), "hold": 5.0},
                                               queue=worker.queue)
    again = tasks.until_succeeded.apply_async((run, 3), {"report": str(report)}, queue=worker.queue)
    Task.apply_async(tasks.until_succeeded, (run, 2), {"report": str(report)}, queue=worker.queue)

    skipped = wait_for_event(report, lambda e: e["event"] == "skipped", timeout=60, workers=[worker])
    wait_for(lambda: unique.holder_of(f"uq:{run}") is None, timeout=60, what="the holder's success")

    assert (dup(again), again.id) == (True, holder.id)
    assert (skipped["reason"], skipped["args"]) == ("duplicate", [run, 2])
    ran = [e for e in events(report) if e["event"] == "ran"]
    assert [(e["n"], e["task_id"]) for e in ran] == [(1, holder.id)]


@on_workers
def test_a_sigkilled_worker_leaves_a_while_running_key_free_after_its_lease(
    broker: RedisBroker, tmp_path: Path
) -> None:
    run, report, pause = fresh("killed"), tmp_path / "events.jsonl", tmp_path / "pause"
    pause.touch()
    doomed = start_worker("doomed", fresh("doomed"), tmp_path, broker=broker)
    try:
        wait_ready([doomed])
        with broker.connection() as conn:
            first = tasks.while_running.apply_async(
                (run, 1), {"report": str(report), "pause_once": str(pause)}, queue=doomed.queue,
                connection=conn,
            )
        started = wait_for_event(report, lambda e: e["event"] == "ran", timeout=60, workers=[doomed])
        with broker.connection() as conn:
            while_it_runs = tasks.while_running.apply_async(
                (run, 2), {"report": str(report)}, queue=doomed.queue, connection=conn
            )
        assert (dup(while_it_runs), while_it_runs.id) == (True, first.id)

        doomed.stop()  # SIGKILL, worker and pool: nothing releases the lease or the claim
        assert unique.holder_of(f"ur:{run}") == first.id  # its lease is still live
        time.sleep(1.0)  # a renewal in flight at the kill has landed by now
        grant = Grant.objects.get(lock__key=f"ur:{run}:1", token=started["token"])
        assert grant.ended_at is None
        wait_until_database_time_passes(grant.expires_at)

        assert unique.holder_of(f"ur:{run}") is None
        with broker.connection() as conn:
            after = tasks.while_running.apply_async(
                (run, 3), {"report": str(report)}, queue=fresh("nobody"), connection=conn
            )
        assert dup(after) is False and after.id != first.id
    finally:
        doomed.stop()
    assert os.path.exists(str(pause) + ".claimed")
