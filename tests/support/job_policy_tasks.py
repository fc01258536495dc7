"""Tasks the job-policy worker tests send to a real prefork worker.

Each body counts itself in and out of a counter row in the database (one
atomic ``UPDATE ... RETURNING``), so the number it reports at its start is how
many bodies ran at that moment, counted by the database, whatever the
workers' clocks say.
"""

from __future__ import annotations

import time
from typing import Any

from django.db import connection

from coordination.contrib.celery import fenced_task
from coordination.contrib.execution import current_execution
from coordination.exceptions import LeaseLost, StaleToken
from coordination.fencing import fence
from project.demo.models import Account
from tests.support.celery_worker_tasks import KEEPALIVE_TTL, pause_here_once, record


def _count(counter_id: int, step: int) -> int:
    table = connection.ops.quote_name(Account._meta.db_table)
    with connection.cursor() as cursor:
        cursor.execute(
            f"UPDATE {table} SET balance = balance + %s WHERE id = %s RETURNING balance",
            [step, counter_id],
        )
        (value,) = cursor.fetchone()
    return int(value)


@fenced_task(lock="jobrun:{run}:{n}", ttl=KEEPALIVE_TTL, wait=60, bind=True, max_retries=None)
def counted_body(self: Any, run: str, n: int, *, counter: int, report: str, hold: float) -> int:
    """Hold ``hold`` seconds between counting in and out; waits up to 60 s in the
    worker for a permit of its job policy's cap, so capped messages queue, not retry."""
    running = _count(counter, +1)
    record(report, "start", n=n, running=running, task_id=self.request.id)
    try:
        time.sleep(hold)
    finally:
        _count(counter, -1)
        record(report, "end", n=n)
    return running


@fenced_task(lock="capwrite:{customer}:{n}", ttl=KEEPALIVE_TTL, bind=True, max_retries=0)
def cap_slot_writer(self: Any, customer: str, n: int, *, report: str, pause_once: str) -> None:
    """Writes a resource its cap permit's slot guards (its job policy has a cap per
    ``{customer}``), stops at ``pause_once`` until the test lets it go, then writes
    it again, late, and reports how that write ended."""
    execution = current_execution()
    assert execution is not None and execution.cap_permit is not None
    slot = execution.cap_permit
    with fence(f"capped-export:{customer}", slot):
        pass
    record(report, "wrote", n=n, slot=slot.key, token=slot.token)
    pause_here_once(pause_once)
    try:
        with fence(f"capped-export:{customer}", slot):
            record(report, "late", outcome="written")
    except (StaleToken, LeaseLost) as refused:
        record(report, "late", outcome=refused.code)
