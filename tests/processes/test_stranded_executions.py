"""A real prefork worker SIGKILLed mid-task (all its processes, as an OOM kill of
its container does), on Redis and on the embedded default, leaves its execution
stranded: listed on the jobs page once its lease has expired by the database
clock, not before, with the worker's host and process and the last renewal its
keep-alive made. The operator's clear ends the dead lease and raises the key's
watermarks, so a write under the dead token is refused as stale."""

from __future__ import annotations

import datetime as dt
import socket
from collections.abc import Callable
from decimal import Decimal
from pathlib import Path

import pytest
from django.contrib.auth.models import User
from django.db import connection
from django.test import Client
from django.urls import reverse

from coordination import locks
from coordination.exceptions import StaleToken
from coordination.leases import Lease
from coordination.models import Grant, GrantEnd, Lock
from coordination.stranded import stranded_executions
from project.demo.models import Account
from tests.support import celery_worker_tasks as tasks
from tests.support.celery_workers import (
    RedisBroker,
    Worker,
    wait_for_event,
)
from tests.support.factories import AccountFactory
from tests.support.waiting import wait_for, wait_until_database_time_passes

pytestmark = [
    pytest.mark.legs(
        "pg", "sqlite",
        reason="a real prefork worker killed mid-task, on Redis (PostgreSQL) and on the "
        "embedded default (SQLite and the filesystem broker)",
    ),
    pytest.mark.django_db(transaction=True),
]


@pytest.fixture
def embedded() -> bool:
    """The embedded default: SQLite, and Celery's filesystem broker under var/."""
    return connection.vendor == "sqlite"


@pytest.fixture
def worker(start_workers: Callable[..., Worker], embedded: bool) -> Worker:
    return start_workers("stranded", embedded=embedded, pool="prefork", concurrency=1)


def test_a_sigkilled_worker_leaves_a_stranded_execution_the_operator_fences_out(
    worker: Worker, embedded: bool, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    account = AccountFactory(balance=Decimal("100.00"))
    key = f"account:{account.pk}"
    report, pause = tmp_path / "events.jsonl", tmp_path / "pause"
    pause.touch()
    arguments = {"report": str(report), "pause_once": str(pause)}
    if embedded:
        tasks.deposit.apply_async((account.pk, "7"), arguments, queue=worker.queue)
    else:
        broker: RedisBroker = request.getfixturevalue("broker")
        with broker.connection() as conn:
            tasks.deposit.apply_async((account.pk, "7"), arguments, queue=worker.queue, connection=conn)
    started = wait_for_event(report, lambda e: e["event"] == "acquired", workers=[worker])
    granted_at = Grant.objects.get(lock__key=key, token=started["token"]).acquired_at
    # Let the keep-alive renew at least once (every ttl/3) before the kill.
    wait_for(lambda: Lock.objects.get(key=key).expires_at
             > granted_at + dt.timedelta(seconds=tasks.KEEPALIVE_TTL + 0.5), what="a renewal")

    worker.stop()  # SIGKILL to the worker and every process of it: nothing releases

    expires_at = Lock.objects.get(key=key).expires_at
    assert stranded_executions() == []
    assert locks.database_now() < expires_at  # that was before the lease ended
    wait_until_database_time_passes(expires_at, margin=0.5)

    (found,) = stranded_executions()
    assert (found.task, found.task_id, found.key, found.token) == (
        tasks.deposit.name, started["task_id"], key, started["token"]
    )
    assert found.worker == f"{socket.gethostname()}:{started['pid']}"
    assert found.expired_at == expires_at
    assert found.last_renewal == expires_at - dt.timedelta(seconds=tasks.KEEPALIVE_TTL)
    assert found.last_renewal > granted_at  # renewed by the keep-alive before the kill

    client = Client()
    client.force_login(User.objects.create_superuser("operator", password="x"))
    page = client.get(reverse("admin:coordination_jobs")).content.decode()
    assert f'data-key="{key}" data-token="{found.token}"' in page
    cleared = client.post(
        reverse("admin:coordination_jobs_clear_stranded"),
        {"stranded": [found.pk], "confirm": "yes"},
    )
    assert cleared.status_code == 302
    assert stranded_executions() == []

    # The killed copy, had it only been paused, writes under its token: refused.
    dead = Lease(key=key, token=found.token, lease_id="x", holder="the dead worker",
                 acquired_at=granted_at, expires_at=expires_at)
    with pytest.raises(StaleToken):
        Account.objects.filter(pk=account.pk).fenced_update(dead, balance=Decimal("107.00"))
    assert Account.objects.get(pk=account.pk).balance == Decimal("100.00")
    assert Grant.objects.get(lock__key=key, token=found.token).end_reason == GrantEnd.EXPIRED
