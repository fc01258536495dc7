"""``once=True`` on real worker processes: a task id whose body completed never runs it again.

A prefork worker on Redis (acks late, requeue when a process is lost, as the
worker settings say) is SIGKILLed after the body's transaction committed and
before the ack; a message is published twice with one task id; a visibility
timeout shorter than the body makes Redis hand the message to a second
process while the first still runs it. Each scenario runs with ``once=True``
and, as its negative control, with the same task without it
(``deposit_every_time``): there the body runs again and the deposit is made
twice. A retry of an attempt that raised after its write still runs, and its
write is made once. The embedded default (SQLite, filesystem broker) runs the
duplicate message.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from coordination.contrib.once import once_key
from coordination.models import IdempotencyRecord, JobTally
from project.demo.models import Account
from tests.support import once_tasks as tasks
from tests.support.celery_workers import (
    RedisBroker,
    Worker,
    events,
    publish,
    unique,
    wait_for_event,
    wait_ready,
)
from tests.support.waiting import wait_for

pytestmark = pytest.mark.django_db(transaction=True)
PG_ONLY = pytest.mark.legs(
    "pg", reason="prefork workers killed mid-task need a database with row locks; "
    "the SQLite leg runs the duplicate message on the embedded default"
)
# The visibility timeout of the worker whose messages Redis hands out again.
SHORT_VISIBILITY = 2.0


@pytest.fixture(scope="module")
def workers(start_workers: Callable[..., Worker]) -> dict[str, Worker]:
    started = {
        "prefork": start_workers("once", pool="prefork", concurrency=2, ready=False),
        "short": start_workers(
            "short", pool="prefork", concurrency=2, ready=False,
            COORDINATION_TEST_VISIBILITY_TIMEOUT=str(SHORT_VISIBILITY),
        ),
    }
    wait_ready(started.values())
    return started


def task_for(once: bool) -> Any:
    return tasks.deposit_once if once else tasks.deposit_every_time


def bodies(report: Path) -> list[dict[str, Any]]:
    return [event for event in events(report) if event["event"] == "body"]


def returned(report: Path) -> list[dict[str, Any]]:
    return [event for event in events(report) if event["event"] == "returned"]


def balance(account: Account) -> Decimal:
    return Account.objects.get(pk=account.pk).balance


def finished_count(task: Any) -> int:
    row = JobTally.objects.filter(task=task.name, outcome="finished").first()
    return row.count if row else 0


@PG_ONLY
@pytest.mark.parametrize("once", [True, False], ids=["once", "negative-control"])
def test_a_worker_killed_after_the_commit_and_before_the_ack_does_not_run_the_body_again(
    workers: dict[str, Worker], broker: RedisBroker, tmp_path: Path, once: bool
) -> None:
    worker, task = workers["prefork"], task_for(once)
    account = Account.objects.create(owner="killed", balance=Decimal("100.00"))
    report, pause = tmp_path / "events.jsonl", tmp_path / "pause"
    pause.touch()
    task_id = unique("killed")
    publish(task, worker.queue, broker, account.pk, "7", task_id=task_id,
         kwargs={"report": str(report), "pause_after": str(pause)})
    first = wait_for_event(report, lambda e: e["event"] == "returned", workers=[worker])
    # Committed: the deposit and (with once) the record of its completion are in.
    assert balance(account) == Decimal("107.00")
    assert IdempotencyRecord.objects.filter(key=once_key(task.name, task_id)).exists() is once
    os.kill(first["pid"], signal.SIGKILL)  # before the ack: the broker delivers it again

    wait_for(lambda: len(returned(report)) == 2, timeout=60, what="the redelivery's return")
    again = returned(report)[1]
    assert again["task_id"] == task_id and again["pid"] != first["pid"]
    if once:
        assert len(bodies(report)) == 1
        assert again["retval"] == first["retval"]  # the stored result, token included
        assert balance(account) == Decimal("107.00")
        assert finished_count(task) >= 1
    else:
        assert len(bodies(report)) == 2
        assert balance(account) == Decimal("114.00")


@PG_ONLY
@pytest.mark.parametrize("once", [True, False], ids=["once", "negative-control"])
def test_a_message_published_twice_with_one_task_id_runs_its_body_once(
    workers: dict[str, Worker], broker: RedisBroker, tmp_path: Path, once: bool
) -> None:
    """Both copies at once on two processes: the second waits for the key's lock
    (``wait``), then finds the record under its own grant and returns it."""
    worker, task = workers["prefork"], task_for(once)
    account = Account.objects.create(owner="twice", balance=Decimal("100.00"))
    report, task_id = tmp_path / "events.jsonl", unique("twice")
    for _ in range(2):
        publish(task, worker.queue, broker, account.pk, "5", task_id=task_id,
             kwargs={"report": str(report), "hold": 1.0})

    wait_for(lambda: len(returned(report)) == 2, timeout=60, what="both copies' returns")
    first, second = returned(report)
    assert len(bodies(report)) == (1 if once else 2)
    assert balance(account) == (Decimal("105.00") if once else Decimal("110.00"))
    if once:
        assert second["retval"] == first["retval"]


@PG_ONLY
@pytest.mark.parametrize("once", [True, False], ids=["once", "negative-control"])
def test_a_visibility_timeout_shorter_than_the_body_does_not_run_it_twice(
    workers: dict[str, Worker], broker: RedisBroker, tmp_path: Path, once: bool
) -> None:
    """Redis hands the unacknowledged message to the worker's other process after
    the visibility timeout, while the body still runs (its lease kept alive): the
    copy waits on the key's lock, and once it holds it finds the record."""
    worker, task = workers["short"], task_for(once)
    account = Account.objects.create(owner="visibility", balance=Decimal("100.00"))
    report, task_id = tmp_path / "events.jsonl", unique("visibility")
    publish(task, worker.queue, broker, account.pk, "3", task_id=task_id,
         kwargs={"report": str(report), "hold": 3 * SHORT_VISIBILITY})

    # The copy starts while the first body runs (both processes have the message).
    wait_for(lambda: len(returned(report)) >= 2, timeout=60, what="the second delivery's return")
    retvals = {json.dumps(event["retval"], sort_keys=True) for event in returned(report)}
    # Sent once: every other delivery is Redis restoring the unacknowledged message.
    if once:
        assert len(bodies(report)) == 1
        assert len(retvals) == 1
        assert balance(account) == Decimal("103.00")
    else:
        assert len(bodies(report)) >= 2
        assert balance(account) >= Decimal("106.00")


@PG_ONLY
def test_a_retry_of_an_attempt_that_raised_after_its_write_runs_and_writes_once(
    workers: dict[str, Worker], broker: RedisBroker, tmp_path: Path
) -> None:
    worker, task = workers["prefork"], tasks.deposit_once
    account = Account.objects.create(owner="retried", balance=Decimal("100.00"))
    report, task_id = tmp_path / "events.jsonl", unique("retried")
    publish(task, worker.queue, broker, account.pk, "9", task_id=task_id,
         kwargs={"report": str(report), "fail_first": True})

    wait_for(lambda: [e["retries"] for e in bodies(report)] == [0, 1], timeout=60, what="the retry")
    wait_for(lambda: len(returned(report)) == 2, timeout=30, what="both returns")
    # The first attempt's write rolled back with it: the deposit is made once.
    assert balance(account) == Decimal("109.00")
    record = IdempotencyRecord.objects.get(key=once_key(task.name, task_id))
    assert record.completed and record.result["deposited"] == "9"


# --- the embedded default: SQLite and the filesystem broker ------------------------


@pytest.fixture(scope="module")
def embedded_worker(start_workers: Callable[..., Worker]) -> Worker:
    """A prefork worker on the site's own broker: the filesystem one of the SQLite leg."""
    return start_workers("embedded", embedded=True, pool="prefork", concurrency=2)


@pytest.mark.legs("sqlite", reason="the embedded default; the PostgreSQL leg runs it on Redis above")
@pytest.mark.parametrize("once", [True, False], ids=["once", "negative-control"])
def test_on_the_embedded_default_a_message_published_twice_runs_its_body_once(
    embedded_worker: Worker, tmp_path: Path, once: bool
) -> None:
    """The filesystem broker has no acknowledgement to lose (a message is taken out
    of its folder when it is received): the copies come from a publisher."""
    task = task_for(once)
    account = Account.objects.create(owner="embedded", balance=Decimal("100.00"))
    report, task_id = tmp_path / "events.jsonl", unique("embedded")
    for _ in range(2):
        publish(task, embedded_worker.queue, None, account.pk, "5", task_id=task_id,
             kwargs={"report": str(report)})

    wait_for(lambda: len(returned(report)) == 2, timeout=60, what="both copies' returns")
    first, second = returned(report)
    assert len(bodies(report)) == (1 if once else 2)
    assert balance(account) == (Decimal("105.00") if once else Decimal("110.00"))
    if once:
        assert second["retval"] == first["retval"]
        assert finished_count(task) == 1
