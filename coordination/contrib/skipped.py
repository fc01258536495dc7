"""What a fenced execution hands back when it does not run its body, and the
small rules both decorators share: who holds a task's lock, ``on_busy`` and
the countdown of a retry after a busy lock."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any, Literal, cast, get_args

from ..exceptions import InvalidInput, LockHeld
from ..holders import task_holder
from ..models import HOLDER_MAX_LENGTH

__all__ = [
    "OnBusy", "Skipped", "deferred", "holder_name", "retry_countdown", "skipped", "validate_on_busy",
]

OnBusy = Literal["retry", "skip", "raise"]


def holder_name(task_name: str, task_id: str | None, attempt: int) -> str:
    """Who holds a task's lock: host, process, task and attempt, at most 200 characters.

    The task id alone is not a holder identity (retries and redeliveries share
    it); the attempt number and process tell the executions apart in the admin.
    """
    return task_holder(task_name, task_id, attempt, max_length=HOLDER_MAX_LENGTH)


class Skipped(dict[str, Any]):
    """The result of an execution that did not run its body: skipped or superseded.

    A dict (JSON-serialisable for any result backend) with ``coordination`` set to
    ``"skipped"``, ``reason`` (``"lock_held"``, ``"superseded"``, ``"paused"`` or ``"duplicate"``),
    ``key`` and ``detail`` (a duplicate's also ``existing``, the holder's id):
    never mistaken for a silent success. An execution
    deferred by a paused policy where the integration sends a new message
    (``django.tasks``) has ``coordination`` set to ``"deferred"``.
    """


def skipped(reason: str, key: str, detail: str) -> Skipped:
    return Skipped(coordination="skipped", reason=reason, key=key, detail=detail)


def deferred(key: str, detail: str) -> Skipped:
    return Skipped(coordination="deferred", reason="paused", key=key, detail=detail)


def retry_countdown(held: LockHeld) -> float:
    """Seconds before retrying a busy lock: the holder's own remaining lease
    (database time), plus jitter so that tasks waiting for the same key do not
    all come back at once."""
    return held.retry_after + random.uniform(0.05, 0.05 + min(1.0, 0.25 * held.retry_after))


def validate_on_busy(on_busy: object, choices: Sequence[str] = get_args(OnBusy)) -> OnBusy:
    """``on_busy`` if it is one of ``choices``, else ``InvalidInput``."""
    if on_busy not in choices:
        raise InvalidInput(f"on_busy must be one of {', '.join(map(repr, choices))}, not {on_busy!r}")
    return cast(OnBusy, on_busy)
