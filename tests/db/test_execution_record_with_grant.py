"""A fenced execution's record is written with its grant.

The jobs page's running executions, stranded executions and ``known_tasks``
read the records (``Execution`` rows). Without permits, an execution writes its
record in the acquire itself: on PostgreSQL in the grant's own statement (one
round trip, one transaction, so the record is as durable as the grant and never
there without it); on the other backends right after the grant. With a
``max_running`` permit, a cap or a rate, it is written once those are taken.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from coordination import jobs, locks
from coordination.backends.outcomes import ExecutionRecord
from coordination.contrib.execution import AsyncFencedExecution, FencedExecution
from coordination.exceptions import LockHeld
from coordination.holders import this_process
from coordination.models import Execution, Grant, JobPolicy

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("uncached_policies")]

TASK = "tests.records.settle"


def execute(key: str, **options: Any) -> Any:
    return FencedExecution(
        key, holder="records", ttl=12, name=TASK, task_id="m-7", attempt=3, **options
    ).run(lambda: locks.current_grant())


def test_an_execution_records_its_task_message_worker_and_grant(grant_point: str) -> None:
    grant = execute("records:a")

    row = Execution.objects.get(lock_key="records:a", token=grant.token)
    assert (row.task, row.task_id, row.attempt, row.worker) == (TASK, "m-7", 3, this_process())
    assert (row.permit_key, row.permit_token) == ("", None)
    assert row.ttl == pytest.approx(12.0)
    assert row.started_at is not None


def test_an_async_execution_records_itself_the_same_way() -> None:
    async def body() -> Any:
        return locks.current_grant()

    grant = asyncio.run(
        AsyncFencedExecution("records:f", holder="records", ttl=12, name=TASK, task_id="m-1").run(body)
    )

    row = Execution.objects.get(lock_key="records:f", token=grant.token)
    assert (row.task, row.task_id, row.attempt, row.worker) == (TASK, "m-1", 1, this_process())


def test_a_refused_acquire_records_nothing(grant_point: str) -> None:
    holder = locks.acquire("records:b", holder="someone else", ttl=30)
    record = ExecutionRecord.of(TASK, "m-8", 1, "w:1")

    with pytest.raises(LockHeld):
        jobs.acquire_execution("records:b", record, holder="records", ttl=5)

    assert not Execution.objects.filter(lock_key="records:b").exclude(token=holder.token).exists()
    locks.release(holder)
    grant = jobs.acquire_execution("records:b", record, holder="records", ttl=5, wait=1)
    assert list(Execution.objects.filter(lock_key="records:b").values_list("token", "task_id")) == [
        (grant.token, "m-8")
    ]
    locks.release(grant)


def test_with_a_max_running_permit_the_record_names_the_permit() -> None:
    JobPolicy(task=TASK, max_running=2).save(changed_by="tester", via="test")

    grant = execute("records:c")

    row = Execution.objects.get(lock_key="records:c", token=grant.token)
    assert row.permit_key.startswith(f"task:{TASK}@") and row.permit_token is not None


def test_values_too_long_for_their_columns_are_cut_and_nul_characters_dropped() -> None:
    record = ExecutionRecord.of("t" * 300, "i\x00d" * 100, 1, "w" * 300)

    grant = jobs.acquire_execution("records:d", record, holder="records", ttl=5)
    locks.release(grant)

    row = Execution.objects.get(lock_key="records:d", token=grant.token)
    assert (len(row.task), len(row.task_id), len(row.worker)) == (255, 200, 200)
    assert "\x00" not in row.task_id


@pytest.mark.postgres
def test_on_postgresql_the_record_is_part_of_the_grants_own_transaction() -> None:
    record = ExecutionRecord.of(TASK, "m-9", 1, "w:1")
    with CaptureQueriesContext(connection) as sent:
        grant = jobs.acquire_execution("records:e", record, holder="records", ttl=5)

    # Nothing after the grant's own call: no statement of the record's own...
    assert sent.captured_queries == []
    # ...and the grant's row and the record's were written by one transaction,
    # which commits durably as every grant does.
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT e.xmin::text = g.xmin::text FROM coordination_execution AS e, coordination_grant AS g "
            "WHERE e.lock_key = %s AND e.token = %s AND g.id = %s",
            ["records:e", grant.token, Grant.objects.get(lock__key="records:e", token=grant.token).pk],
        )
        assert cursor.fetchone() == (True,)
    locks.release(grant)


def test_a_record_the_database_refuses_never_fails_the_grant(
    grant_point: str, caplog: pytest.LogCaptureFixture
) -> None:
    # A negative attempt breaks the column's check: on PostgreSQL the grant's own
    # statement rolls back and the grant is made alone; elsewhere the insert after it fails.
    record = ExecutionRecord(TASK, "m-10", -1, "w:1")

    with caplog.at_level(logging.WARNING, logger="coordination.tasks"):
        grant = jobs.acquire_execution("records:g", record, holder="records", ttl=5)

    assert Grant.objects.filter(lock__key="records:g", token=grant.token, ended_at=None).exists()
    assert not Execution.objects.filter(lock_key="records:g").exists()
    assert any("execution not recorded" in line.getMessage() for line in caplog.records)
    locks.release(grant)
