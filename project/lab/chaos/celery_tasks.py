"""The Celery variant of the chaos workload: the same writes, inside a fenced task.

``coordination_chaos --celery`` starts real ``celery worker`` processes (solo
pool, so SIGSTOP pauses the task itself) that import this module, and sends them
``chaos_cycle`` tasks. The ``fenced_task`` decorator acquires the account's lock
for each execution (no keep-alive: a paused task must be able to outlive its
lease) and releases it afterwards; the body makes the workload's fenced writes
with that execution's grant, logged like the plain workers'.

In a chaos worker the environment names the worker's configuration
(``COORDINATION_CHAOS_CONFIG``); this module then points the default database at
the run's database before any connection opens.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from celery import signals as celery_signals

from coordination.contrib.celery import fenced_task

from .worker import Worker, die_with_parent

CONFIG_ENVIRONMENT = "COORDINATION_CHAOS_CONFIG"
TASK_NAME = "coordination.chaos.cycle"

_state: dict[str, Any] = {}


def _load_config() -> dict[str, Any] | None:
    path = os.environ.get(CONFIG_ENVIRONMENT)
    if not path:
        return None
    with open(path, encoding="utf-8") as source:
        config: dict[str, Any] = json.load(source)
    return config


@fenced_task(
    lock="account:{account_id}", ttl=1.0, keepalive=False, on_busy="skip", bind=True,
    ignore_result=True, name=TASK_NAME,
)
def chaos_cycle(self: Any, account_id: int) -> None:
    worker: Worker = _state["worker"]
    worker.fenced_task_execution(self.grant, account_id, _state.get("prerun", time.monotonic()))


@celery_signals.task_prerun.connect
def _note_start(sender: Any = None, **kwargs: Any) -> None:
    # Before the decorator's acquire: the acquire's invocation time in the history.
    if getattr(sender, "name", None) == TASK_NAME:
        _state["prerun"] = time.monotonic()


@celery_signals.worker_ready.connect
def _ready(**kwargs: Any) -> None:
    if "config" in _state:
        _state["worker"] = Worker(_state["config"])


def _configure_worker() -> None:
    config = _load_config()
    if config is None:
        return
    from django.conf import settings

    # In place: a connection wrapper created already shares this dict.
    settings.DATABASES["default"].update(config["database"])
    chaos_cycle.fenced_ttl = float(config["ttl"])
    chaos_cycle.fenced_wait = 2 * float(config["ttl"])
    _state["config"] = config
    die_with_parent()


_configure_worker()
