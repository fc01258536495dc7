"""The tasks a jobs chaos run sends, each recording its effects as rows.

Every effect is a row of ``coordination_chaos_job_effect`` with the database's
clock (``clock_timestamp()``), written in the transaction of the write it
stands for, so the checker (:mod:`project.lab.chaos.jobs`) judges what
committed, in database time:

- ``job_capped(key, seconds)``: "at most N at once per key". Fenced, it is
  ``fenced_task(concurrency=N)`` and writes its start and its end through the
  slot's fence (``fence(f"chaos-cap-slot:{grant.key}", grant)``), so a copy
  paused past its slot's lease has its end refused; its interval is from the
  start row to the end row.
- ``job_once(index)``: "a completed task id never runs its body again".
  Fenced, it is ``fenced_task(once=True)``: its body's row commits with the
  completion record. After the body, ``COORDINATION_JOBS_ACK_DELAY`` seconds
  pass before the worker acknowledges the message, so the controller can kill
  the worker between the commit and the ack.

- ``job_unique(key, copy, seconds)``: "no duplicate of a unique job runs".
  Fenced, it is ``fenced_task(unique="chaos-u:{key}", unique_for=UNIQUE_FOR)``
  under a lock of its own per copy (so only the claim keeps the copies
  apart); the controller sends several copies of one key at once, straight
  to the broker, as a message sent around the enqueue's check would be.
- ``job_rated(key, copy)``: "no window of the period holds more than N
  starts". Fenced, it is ``fenced_task(rate=RATE, rate_key="{key}")``, each
  copy under a lock of its own.

With ``COORDINATION_JOBS_FENCED=0`` (the negative control) the same bodies run
without the feature: ``job_capped`` as a plain task, ``job_once`` with
``once=False``, ``job_unique`` without ``unique``, ``job_rated`` without
``rate``.
"""

from __future__ import annotations

import os
import time
from typing import Any

from celery import shared_task
from celery import signals as celery_signals
from django.db import connection, transaction

from coordination.contrib.celery import fenced_task
from coordination.fencing import fence

CAPPED = "coordination_chaos.job_capped"
ONCE = "coordination_chaos.job_once"
UNIQUE = "coordination_chaos.job_unique"
RATED = "coordination_chaos.job_rated"
TABLE = "coordination_chaos_job_effect"

FENCED = os.environ.get("COORDINATION_JOBS_FENCED", "1") == "1"
CAP = int(os.environ.get("COORDINATION_JOBS_CAP", "2"))
TTL = float(os.environ.get("COORDINATION_JOBS_TTL", "2"))
RUN = os.environ.get("COORDINATION_JOBS_RUN", "")
#: Seconds a unique key stays taken from its first start: longer than a round.
UNIQUE_FOR = float(os.environ.get("COORDINATION_JOBS_UNIQUE_FOR", "60"))
RATE = os.environ.get("COORDINATION_JOBS_RATE", "2/3s")


def record(scenario: str, key: str, phase: str, task_id: str | None, token: int | None) -> None:
    """One effect row, in the caller's transaction (or its own)."""
    with connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {TABLE} (run, scenario, key, phase, task_id, token, pid, at) "
            "VALUES (%s, %s, %s, %s, %s, %s, %s, clock_timestamp())",
            [RUN, scenario, key, phase, task_id or "", token, os.getpid()],
        )


def _capped_body(task: Any, key: str, seconds: float) -> None:
    grant = getattr(task, "grant", None)
    if grant is None:  # the negative control: nothing guards the key
        record("cap", key, "start", task.request.id, None)
        time.sleep(seconds)
        record("cap", key, "end", task.request.id, None)
        return
    resource = f"chaos-cap-slot:{grant.key}"
    with fence(resource, grant):
        record("cap", key, "start", task.request.id, grant.token)
    time.sleep(seconds)
    with fence(resource, grant):
        record("cap", key, "end", task.request.id, grant.token)


if FENCED:
    @fenced_task(lock="chaos-cap:{key}", concurrency=CAP, ttl=TTL, wait=0, on_busy="retry",
                 bind=True, name=CAPPED, ignore_result=True, max_retries=None)
    def job_capped(self: Any, key: str, seconds: float) -> None:
        _capped_body(self, key, seconds)
else:
    @shared_task(bind=True, name=CAPPED, ignore_result=True)
    def job_capped(self: Any, key: str, seconds: float) -> None:
        _capped_body(self, key, seconds)


# The feature is opt-in: the negative control leaves it at its default, off.
ONCE_OPTIONS: dict[str, Any] = {"once": True} if FENCED else {}


@fenced_task(lock="chaos-once:{index}", **ONCE_OPTIONS, ttl=TTL, wait=0, on_busy="retry",
             bind=True, name=ONCE, max_retries=None)
def job_once(self: Any, index: int, seconds: float) -> int:
    # With once=True the body runs in one transaction with its completion
    # record; without, its row commits on its own, as an unprotected body's would.
    with transaction.atomic():
        record("once", f"once:{index}", "body", self.request.id, self.grant.token)
    time.sleep(seconds)
    return index


# The features are off in the negative control: the same decorator without them.
UNIQUE_OPTIONS: dict[str, Any] = {"unique": "chaos-u:{key}", "unique_for": UNIQUE_FOR} if FENCED else {}
RATE_OPTIONS: dict[str, Any] = {"rate": RATE, "rate_key": "{key}"} if FENCED else {}


@fenced_task(lock="chaos-unique:{key}:{copy}", **UNIQUE_OPTIONS, ttl=TTL, wait=0, on_busy="retry",
             bind=True, name=UNIQUE, ignore_result=True, max_retries=None)
def job_unique(self: Any, key: str, copy: int, seconds: float) -> None:
    record("unique", key, "body", self.request.id, self.grant.token)
    time.sleep(seconds)


@fenced_task(lock="chaos-rate:{key}:{copy}", **RATE_OPTIONS, ttl=TTL, wait=0, on_busy="retry",
             bind=True, name=RATED, ignore_result=True, max_retries=None)
def job_rated(self: Any, key: str, copy: int) -> None:
    record("rate", key, "body", self.request.id, self.grant.token)


@celery_signals.task_postrun.connect(dispatch_uid="coordination_chaos.job_once_ack_delay")
def _delay_ack(sender: Any = None, task_id: Any = None, state: Any = None, **kwargs: Any) -> None:
    # Between the body's commit and the ack: where a lost worker leaves a
    # finished task's message to be delivered again.
    if getattr(sender, "name", None) == ONCE and state == "SUCCESS":
        record("once", "", "done", task_id, None)
        time.sleep(float(os.environ.get("COORDINATION_JOBS_ACK_DELAY", "1.5")))
