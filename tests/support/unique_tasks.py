"""Unique tasks the worker tests send to real ``celery worker`` processes.

Each body reports ``ran`` to the file its ``report`` argument names (the test
reads it); a duplicate skipped by the worker reports ``skipped`` through
``signals.task_skipped`` (tests.support.celery_worker_tasks). The lock key has
the message's number in it, so the lock never serialises two copies: only the
uniqueness decides. The producer processes: tests.support.unique_producer.
"""

from __future__ import annotations

import time
from typing import Any

from coordination.contrib.celery import fenced_task
from tests.support.celery_worker_tasks import KEEPALIVE_TTL, pause_here_once, record


@fenced_task(
    lock="uq:{run}:{n}", unique="uq:{run}", unique_for="succeeded", ttl=KEEPALIVE_TTL, bind=True,
)
def until_succeeded(self: Any, run: str, n: int, *, report: str, hold: float = 0.0) -> int:
    record(report, "ran", n=n, task_id=self.request.id, token=self.grant.token)
    time.sleep(hold)
    return n


@fenced_task(
    lock="ur:{run}:{n}", unique="ur:{run}", unique_for="running", ttl=KEEPALIVE_TTL, bind=True,
)
def while_running(self: Any, run: str, n: int, *, report: str, pause_once: str = "") -> int:
    record(report, "ran", n=n, task_id=self.request.id, token=self.grant.token,
           expires_at=self.grant.expires_at.isoformat())
    pause_here_once(pause_once)
    return n
