"""Job policies on a real prefork worker (``-c 4``) with a Redis broker.

A task paused in the admin runs no body while paused and every message after
the resume; a cap of 2 keeps at most 2 bodies running at once, counted by the
database; raising the cap in the admin lets more run, without a restart. The
negative control: without a policy the same messages run 4 at once. An
execution stopped with SIGSTOP while it holds its customer's cap permit is
paused and revoked in the admin: its slot is free at once, and its late write
under the slot is refused when it resumes.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from django.contrib.admin.helpers import ACTION_CHECKBOX_NAME
from django.contrib.auth.models import User
from django.test import Client
from django.urls import reverse

from coordination import jobs, locks
from coordination.fencing import fence
from coordination.models import Fence, Grant, GrantEnd, JobPolicy, JobTally
from coordination.semaphores import acquire_permit
from project.demo.models import Account
from tests.support import job_policy_tasks as tasks
from tests.support.celery_workers import (
    RedisBroker,
    Worker,
    events,
    unique,
    wait_for_event,
)
from tests.support.pausing import paused
from tests.support.waiting import wait_for

pytestmark = [
    pytest.mark.legs("pg", reason="a prefork worker of four processes needs a database with row locks"),
    pytest.mark.django_db(transaction=True),
]

TASK = tasks.counted_body.name
# A change reaches every worker process within the refresh; the waits give it room.
REFRESH = 2.0


@pytest.fixture(scope="module")
def worker(start_workers: Callable[..., Worker]) -> Worker:
    return start_workers("jobs", pool="prefork", concurrency=4)


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


def test_pause_and_revoke_frees_a_stopped_copys_cap_slot_and_its_late_write_is_refused(
    worker: Worker, broker: RedisBroker, tmp_path: Path, admin_client: Client
) -> None:
    policy = JobPolicy(task=tasks.cap_slot_writer.name, key_cap=1, cap_key="{customer}")
    policy.save(changed_by="test", via="orm")
    wait_out_the_refresh()
    report, pause, customer = tmp_path / "report.jsonl", tmp_path / "pause", unique("customer")
    pause.touch()
    with broker.connection() as conn:
        tasks.cap_slot_writer.apply_async(
            (customer, 1), {"report": str(report), "pause_once": str(pause)}, queue=worker.queue,
            connection=conn,
        )
    wrote = wait_for_event(report, lambda e: e["event"] == "wrote", timeout=60, workers=[worker])
    name = jobs.cap_name(tasks.cap_slot_writer.name, customer)

    with paused(wrote["pid"]):  # as a GC or VM pause stops it: its keep-alive too
        data = {"action": "pause_and_revoke_selected", ACTION_CHECKBOX_NAME: [policy.pk], "confirm": "yes"}
        assert admin_client.post(reverse("admin:coordination_jobpolicy_changelist"), data).status_code == 302
        # Free at once, seconds before the stopped copy's lease would have run out.
        after = acquire_permit(name, limit=1, holder="the next copy", ttl=30)
        assert after.key == wrote["slot"] and after.token > wrote["token"]
        with fence(f"capped-export:{customer}", after):
            pass
        (pause.parent / (pause.name + ".go")).touch()

    late = wait_for_event(report, lambda e: e["event"] == "late", timeout=60, workers=[worker])
    assert late["outcome"] in ("stale_token", "lease_lost")
    assert Fence.objects.get(resource=f"capped-export:{customer}").token == after.token
    ended = Grant.objects.get(lock__key=wrote["slot"], token=wrote["token"])
    assert ended.end_reason == GrantEnd.REVOKED
    locks.release(after)
