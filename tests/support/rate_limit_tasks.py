"""Tasks the rate-limit worker tests send to real prefork workers.

``rate_limited`` may start 4 times per 2 seconds per ``run`` over every worker
(the decorator's ``rate``); ``unlimited`` is the same body without it, the
negative control. Each body records its start (database time) and the
message's id, so the test sees every message ran exactly once.
"""

from __future__ import annotations

from typing import Any

from coordination.contrib.celery import fenced_task
from coordination.contrib.execution import current_execution
from tests.support.celery_worker_tasks import KEEPALIVE_TTL, record

RATE = (4, 2.0)


@fenced_task(
    lock="rated:{run}:{n}", ttl=KEEPALIVE_TTL, rate=RATE, rate_key="{run}", bind=True, max_retries=0,
)
def rate_limited(self: Any, run: str, n: int, *, report: str) -> int:
    execution = current_execution()
    assert execution is not None and execution.rate_started_at is not None
    record(report, "start", n=n, task_id=self.request.id, retries=self.request.retries,
           rate_start=execution.rate_started_at.isoformat())
    return n


@fenced_task(lock="unrated:{run}:{n}", ttl=KEEPALIVE_TTL, bind=True, max_retries=0)
def unlimited(self: Any, run: str, n: int, *, report: str) -> int:
    record(report, "start", n=n, task_id=self.request.id, retries=self.request.retries)
    return n


def _count(counter_id: int, step: int) -> int:
    from django.db import connection

    from project.demo.models import Account

    table = connection.ops.quote_name(Account._meta.db_table)
    with connection.cursor() as cursor:
        cursor.execute(
            f"UPDATE {table} SET balance = balance + %s WHERE id = %s RETURNING balance",
            [step, counter_id],
        )
        (value,) = cursor.fetchone()
    return int(value)


@fenced_task(lock="capped:{customer}:{n}", ttl=KEEPALIVE_TTL, on_busy="retry", bind=True, max_retries=None)
def per_customer(
    self: Any, customer: str, n: int, *, counter: int, everyone: int, report: str, hold: float
) -> int:
    """Counts itself in and out of its customer's counter and of everyone's (one
    atomic UPDATE each), so its start reports how many ran then, by the database.
    A busy cap permit retries after the holder's lease: the worker's process is
    free meanwhile for other customers."""
    import time

    running = _count(counter, +1)
    overall = _count(everyone, +1)
    record(report, "start", n=n, customer=customer, running=running, overall=overall)
    try:
        time.sleep(hold)
    finally:
        _count(counter, -1)
        _count(everyone, -1)
        record(report, "end", n=n, customer=customer)
    return running
