"""A fenced execution's record commits without waiting for its WAL flush.

The record is bookkeeping (the jobs page's running executions, the tasks a
policy may name): a server crash that loses one loses no grant, token or
watermark, so it need not cost the task a second wait for the disk after its
acquire. Inside the caller's transaction it is a plain insert that commits, or
rolls back, with that transaction."""

from __future__ import annotations

import pytest
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext

from coordination import jobs, locks
from coordination.models import Execution

pytestmark = [pytest.mark.django_db(transaction=True)]


def _record(key: str) -> tuple[int, list[str]]:
    grant = locks.acquire(key, holder="A", ttl=30)
    with CaptureQueriesContext(connection) as sent:
        jobs.record_execution("app.tasks.t", grant, task_id="m1", attempt=2, worker="w:1")
    locks.release(grant)
    return grant.token, [query["sql"] for query in sent.captured_queries]


def test_the_record_is_written_with_its_defaults() -> None:
    token, sent = _record("record")
    assert len(sent) == 1  # one statement, one round trip
    row = Execution.objects.get(lock_key="record", token=token)
    assert (row.task, row.task_id, row.attempt, row.worker) == ("app.tasks.t", "m1", 2, "w:1")
    assert row.started_at is not None


@pytest.mark.postgres
def test_on_postgresql_the_record_does_not_wait_for_its_flush() -> None:
    with connection.cursor() as cursor:  # durable, as a production server is
        cursor.execute("SET synchronous_commit = on")
    _, sent = _record("record")
    assert "set_config('synchronous_commit', 'off', true)" in sent[0]
    # For that statement's own transaction only: the session's next ones wait again.
    with connection.cursor() as cursor:
        cursor.execute("SHOW synchronous_commit")
        assert cursor.fetchone()[0] == "on"
        cursor.execute("RESET synchronous_commit")


def test_inside_the_callers_transaction_it_commits_and_rolls_back_with_it() -> None:
    grant = locks.acquire("record", holder="A", ttl=30)
    with transaction.atomic():
        with CaptureQueriesContext(connection) as sent:
            jobs.record_execution("app.tasks.t", grant, task_id="m1", attempt=1, worker="w:1")
        assert "synchronous_commit" not in sent.captured_queries[-1]["sql"]
        transaction.set_rollback(True)
    assert not Execution.objects.filter(lock_key="record").exists()
    locks.release(grant)
