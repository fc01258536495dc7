"""Tasks of the end-to-end Celery bench (``manage.py coordination_bench --only celery``).

Imported by the bench's own worker only (``celery -A project worker -I
project.lab.bench_tasks``), never by the site: at import it points the worker's
``COORDINATION`` settings at the bench database that the producer describes in
``COORDINATION_BENCH_DATABASE`` (the alias's settings as JSON: the bench schema
on PostgreSQL, the bench file on SQLite), so the worker writes the tables the
producer created and drops. The tasks write the same demo Account row; the
fenced ones under lock ``account:<id>`` (the same key for every execution: one
worker runs them one at a time, so they never contend). ``work_ms`` stands for
the body's own work before its write (a sleep, as an API call would wait).

Completion is recorded after the task has returned (for the fenced task: after
its lease is released) by ``task_postrun``, which pushes ``[name, sent_at,
done_at, state]`` to the Redis list the producer named in the ``report`` argument.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from celery import shared_task
from celery.signals import task_postrun
from django.apps import apps
from django.conf import settings
from django.db import connections

from coordination.conf import app_settings
from coordination.contrib.celery import fenced_task

DATABASE_ENV = "COORDINATION_BENCH_DATABASE"
REPORT_ENV = "COORDINATION_BENCH_REPORT_URL"
ALIAS = "coordination_bench"
FENCED = "coordination.bench.e2e_fenced"
UNFENCED = "coordination.bench.e2e_unfenced"
FENCED_ONCE = "coordination.bench.e2e_fenced_once"

_raw = os.environ.get(DATABASE_ENV)
if _raw and ALIAS not in connections.databases:
    connections.databases[ALIAS] = json.loads(_raw)
    settings.COORDINATION = {
        **getattr(settings, "COORDINATION", {}), "DATABASE": ALIAS, "RECORD_WRITES": False
    }
    app_settings.reload()

_redis: Any = None


def _rows() -> Any:
    return apps.get_model("demo", "Account")._default_manager.using(ALIAS)


@fenced_task(lock="account:{account_id}", ttl=30, name=FENCED)
def e2e_fenced(
    account_id: int, amount: int, *, sent_at: float, report: str, work_ms: float = 0
) -> None:
    if work_ms:
        time.sleep(work_ms / 1000)  # the body's own work (an API call, say) before its write
    _rows().filter(pk=account_id).fenced_update(balance=amount)


@fenced_task(lock="account:{account_id}", ttl=30, once=True, name=FENCED_ONCE)
def e2e_fenced_once(
    account_id: int, amount: int, *, sent_at: float, report: str, work_ms: float = 0
) -> None:
    """The fenced task with ``once=True``: its body and its record in one transaction."""
    if work_ms:
        time.sleep(work_ms / 1000)
    _rows().filter(pk=account_id).fenced_update(balance=amount)


@shared_task(name=UNFENCED)
def e2e_unfenced(
    account_id: int, amount: int, *, sent_at: float, report: str, work_ms: float = 0
) -> None:
    if work_ms:
        time.sleep(work_ms / 1000)
    _rows().filter(pk=account_id).update(balance=amount)


@task_postrun.connect
def _report(
    sender: Any = None, kwargs: dict[str, Any] | None = None, state: str = "", **_: Any
) -> None:
    global _redis
    name = getattr(sender, "name", "")
    if name not in (FENCED, UNFENCED, FENCED_ONCE) or not kwargs:
        return
    done_at = time.time()
    if _redis is None:
        import redis

        _redis = redis.Redis.from_url(os.environ[REPORT_ENV])
    _redis.rpush(kwargs["report"], json.dumps([name, kwargs["sent_at"], done_at, state]))
