"""A finished execution is not run again: the record of a task id whose body completed.

With ``once=True`` a fenced task's body runs inside one database transaction
on ``COORDINATION["DATABASE"]`` together with an
:class:`~coordination.models.IdempotencyRecord` keyed by the task's name and
its message's task id (:func:`coordination.fencing.idempotent`): the body's
writes on that database and the record of its completion commit together, or
neither does. A redelivered or duplicated message of that task id finds the
record and returns the stored result without running the body; an attempt
that raised (a retry, a refused write, a lost lease) stored nothing, so its
retry runs. The records are idempotency records: ``coordination_prune``
deletes them with the rest of the history older than its cutoff.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .. import fencing, results, signals
from ..conf import app_settings
from ..logfields import LogFields
from ..models import IdempotencyRecord, JobOutcome

__all__ = ["Found", "completed", "finished", "once_key", "run_once"]

logger = logging.getLogger("coordination.tasks")

_PREFIX = "task-once:"


@dataclass(frozen=True)
class Found:
    """The stored result of a task id whose body completed before."""

    result: Any


def once_key(task: str, task_id: str) -> str:
    """The record's key: the task's name and the message's id (hashed past 255 characters)."""
    key = f"{_PREFIX}{task}:{task_id}"
    if len(key) <= 255:
        return key
    return _PREFIX + hashlib.sha256(key.encode()).hexdigest()


def completed(key: str, using: str | None = None) -> Found | None:
    """The stored outcome of ``key`` if its body completed (one indexed read), else None."""
    row = (
        IdempotencyRecord.objects.using(using or app_settings.DATABASE)
        .filter(key=key, completed=True)
        .values_list("result")
        .first()
    )
    return None if row is None else Found(results.decode(row[0]))


def run_once(key: str, body: Callable[[], Any], *, using: str | None = None) -> Any:
    """Run ``body`` in one transaction with the record of its completion; the
    body's result, or a :class:`Found` when a concurrent copy completed it first
    (this one waited on the record's row lock, then found it)."""
    ran = False

    def operation() -> Any:
        nonlocal ran
        ran = True
        return body()

    result = fencing.idempotent(key, operation, using=using)
    return result if ran else Found(result)


def finished(execution: Any, found: Found, sender: Any) -> Any:
    """A fenced execution whose task id completed before: its stored result,
    logged at INFO, counted (``JobOutcome.FINISHED``) and signalled
    (``signals.task_skipped`` with ``reason="completed"``), without running the body."""
    detail = f"task id {execution.task_id} completed before; its stored result is returned"
    logger.info("task not run again %s", LogFields(task=execution.label, detail=detail))
    execution._tally(JobOutcome.FINISHED)
    signals.task_skipped.send(
        sender=sender, task=execution.task, key=execution.key, reason="completed", error=None
    )
    return found.result
