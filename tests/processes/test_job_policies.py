"""Job policies on a real prefork worker (``-c 4``) with a Redis broker.

A task paused in the admin runs no body while paused and every message after
the resume; a cap of 2 keeps at most 2 bodies running at once, counted by the
database; raising the cap in the admin lets more run, without a restart. The
negative control: without a policy the same messages run 4 at once.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.test import Client
from django.urls import reverse

from coordination import jobs
from coordination.models import JobPolicy, JobTally
from project.demo.models import Account
from tests.support import job_policy_tasks as tasks
from tests.support.celery_workers import (
    RedisBroker,
    Worker,
    events,
    start_worker,
    unique,
    wait_ready,
    wait_until_workers_disconnect,
)
from tests.support.waiting import wait_for

pytestmark = [
    pytest.mark.legs("pg", reason="a prefork worker of four processes needs a database with row locks"),
    pytest.mark.django_db(transaction=True),
]

TASK = tasks.counted_body.name
# A change reaches every worker process within the refresh; the waits give it room.
REFRESH = 2.0


@pytest.fixture(scope="module")
def worker(
    django_db_setup: None, django_db_blocker: Any, broker: RedisBroker,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Worker]:
    started = start_worker(
        "jobs", unique("jobs"), tmp_path_factory.mktemp("job-worker-logs"), broker=broker,
        pool="prefork", concurrency=4,
    )
    try:
        wait_ready([started])
        yield started
    finally:
        started.stop()
        with django_db_blocker.unblock():
            wait_until_workers_disconnect()


@pytest.fixture
def admin_client() -> Client:
    client = Client()
    client.force_login(User.objects.create_superuser("operator", password="x"))
    return client


def wait_out_the_refresh() -> None:
    """Executions that start later than the refresh see a change, whatever the
    worker's processes read before it (the documented bound; nothing to poll:
    the cache lives in the worker's processes)."""
    time.sleep(REFRESH + 0.5)


def send_batch(worker: Worker, broker: RedisBroker, run: str, count: int, **kwargs: Any) -> None:
    with broker.connection() as conn:
        for n in range(count):
            tasks.counted_body.apply_async(
                (run, n), kwargs, queue=worker.queue, connection=conn,
            )


def starts(report: Path) -> list[dict[str, Any]]:
    return [event for event in events(report) if event["event"] == "start"]


def ends(report: Path) -> list[dict[str, Any]]:
    return [event for event in events(report) if event["event"] == "end"]


def counter() -> Account:
    return Account.objects.create(owner="running bodies")


def change_in_admin(client: Client, policy: JobPolicy, **fields: Any) -> None:
    """Save the policy's change form as an operator would."""
    data = {
        "task": policy.task, "when_paused": policy.when_paused, "defer_seconds": policy.defer_seconds,
        "max_running": policy.max_running or "", "ttl": policy.ttl or "",
        "on_busy": policy.on_busy, "note": policy.note, "_save": "Save",
    }
    if policy.paused:
        data["paused"] = "on"
    for name, value in fields.items():
        if name == "paused":
            if value:
                data["paused"] = "on"
            else:
                data.pop("paused", None)
        else:
            data[name] = value
    response = client.post(reverse("admin:coordination_jobpolicy_change", args=[policy.pk]), data)
    assert response.status_code == 302, response.content.decode()[:2000]


def test_without_a_policy_four_bodies_run_at_once(
    worker: Worker, broker: RedisBroker, tmp_path: Path
) -> None:
    """The negative control of the cap: the prefork worker runs its 4 processes at once."""
    report, run, count = tmp_path / "report.jsonl", unique("free"), counter()
    send_batch(worker, broker, run, 4, counter=count.pk, report=str(report), hold=2.0)

    wait_for(lambda: len(ends(report)) == 4, timeout=60, what="four bodies")
    assert max(event["running"] for event in starts(report)) == 4


def test_a_paused_task_runs_no_body_until_resumed_in_the_admin_then_every_message(
    worker: Worker, broker: RedisBroker, tmp_path: Path, admin_client: Client
) -> None:
    policy = JobPolicy(task=TASK, paused=True, defer_seconds=0.5)
    policy.save(changed_by="test", via="orm")
    report, run, count = tmp_path / "report.jsonl", unique("paused"), counter()
    wait_out_the_refresh()
    send_batch(worker, broker, run, 6, counter=count.pk, report=str(report), hold=0.1)

    def deferred() -> int:
        row = JobTally.objects.filter(task=TASK, outcome="deferred").first()
        return row.count if row else 0

    # Every message deferred at least twice (sent again and deferred again): none ran.
    wait_for(lambda: deferred() >= 12, timeout=60, what="twelve deferrals")
    assert starts(report) == []

    change_in_admin(admin_client, policy, paused=False)

    wait_for(lambda: len(ends(report)) == 6, timeout=60, what="all six after the resume")
    assert Counter(event["n"] for event in starts(report)) == {n: 1 for n in range(6)}
    assert not JobPolicy.objects.get(pk=policy.pk).paused
    assert [change.via for change in policy.changes.order_by("id")] == ["orm", "admin"]


def test_a_cap_of_two_holds_and_raising_it_in_the_admin_lets_more_run(
    worker: Worker, broker: RedisBroker, tmp_path: Path, admin_client: Client
) -> None:
    policy = JobPolicy(task=TASK, max_running=2)
    policy.save(changed_by="test", via="orm")
    wait_out_the_refresh()
    capped, run, count = tmp_path / "capped.jsonl", unique("capped"), counter()
    send_batch(worker, broker, run, 6, counter=count.pk, report=str(capped), hold=1.0)

    wait_for(lambda: len(ends(capped)) == 6, timeout=60, what="six capped bodies")
    assert max(event["running"] for event in starts(capped)) == 2

    change_in_admin(admin_client, policy, max_running=4)
    raised = tmp_path / "raised.jsonl"
    send_batch(worker, broker, unique("raised"), 8, counter=count.pk, report=str(raised), hold=1.5)

    wait_for(lambda: len(ends(raised)) == 8, timeout=60, what="eight bodies after the raise")
    assert 3 <= max(event["running"] for event in starts(raised)) <= 4
    # The bodies report their end before their execution releases key and permit.
    wait_for(lambda: jobs.running(TASK) == [], timeout=30, what="every lease released")
