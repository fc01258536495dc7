"""A fenced task's uniqueness: its key over the task's arguments, its scope, and
the worker's gate that keeps a duplicate from running its body.

Both decorators (:mod:`coordination.contrib.celery`, :mod:`coordination.contrib.tasks`)
declare ``unique="report:{customer_id}"`` and ``unique_for=`` one of
``"queued"``, ``"running"``, ``"succeeded"`` or a number of seconds; the claims
themselves are :mod:`coordination.unique`'s.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .. import jobs, signals, unique
from ..exceptions import InvalidInput
from ..leases import Lease
from ..logfields import LogFields
from ..models import JobOutcome, UniqueScope
from . import execution_steps as steps
from .lock_keys import LockSpec, check_template, lock_key_for
from .skipped import Skipped

__all__ = ["UniqueFor", "UniqueGate", "UniqueSpec", "unique_spec"]

logger = logging.getLogger("coordination.tasks")

#: ``"queued"``, ``"running"``, ``"succeeded"``, or seconds.
UniqueFor = str | float | int

_NAMED = (UniqueScope.QUEUED.value, UniqueScope.RUNNING.value, UniqueScope.SUCCEEDED.value)


@dataclass(frozen=True)
class UniqueSpec:
    """A task's uniqueness: its key template (or callable) and how long a claim holds."""

    key: LockSpec
    scope: str
    seconds: float | None = None

    def key_for(self, func: Callable[..., Any], args: Any, kwargs: Any) -> str:
        return lock_key_for(self.key, func, tuple(args or ()), dict(kwargs or {}))


def unique_spec(
    key: LockSpec | None, unique_for: UniqueFor, func: Callable[..., Any], *, bound: bool = False
) -> UniqueSpec | None:
    """The declared uniqueness of ``func``, checked when the task is declared
    (a template naming an argument the function lacks, an unknown scope)."""
    if key is None:
        return None
    if not (isinstance(key, str) or callable(key)):
        raise InvalidInput("unique=... must be a key template or a callable")
    check_template(key, func, bound=bound)
    wrong = f"unique_for must be one of {', '.join(_NAMED)} or seconds, not {unique_for!r}"
    if isinstance(unique_for, bool) or not isinstance(unique_for, (str, int, float)):
        raise InvalidInput(wrong)
    if isinstance(unique_for, str):
        if unique_for not in _NAMED:
            raise InvalidInput(wrong)
        return UniqueSpec(key, unique_for)
    if not 0 < unique_for <= 366 * 86400:
        raise InvalidInput(f"unique_for={unique_for!r}: seconds must be more than 0 and at most a year")
    return UniqueSpec(key, UniqueScope.SECONDS.value, float(unique_for))


class UniqueGate:
    """The steps one execution of a unique task runs instead of its body alone:
    claim the key under the grant (a duplicate returns a ``Skipped`` result with
    reason ``"duplicate"``, logged, counted and signalled as other skips are),
    run the body, then end the claim as its scope says. ``retrying`` are the
    exceptions that mean another attempt was sent (its claim was kept)."""

    def __init__(
        self, spec: UniqueSpec, key: str, *, name: str, task_id: str, label: str, task: Any,
        sender: Any, using: str | None = None, retrying: tuple[type[BaseException], ...] = (),
    ) -> None:
        self.spec, self.key, self.name, self.task_id = spec, key, name, task_id
        self.label, self.task, self.sender, self.using, self.retrying = label, task, sender, using, retrying

    def steps(self, grant: Lease) -> steps.Steps[Any]:
        duplicate = yield steps.Call(self.start, (grant,))
        if duplicate is not None:
            return duplicate
        try:
            outcome = yield steps.Body(grant)
        except BaseException as error:
            if not isinstance(error, self.retrying):
                yield steps.Call(self.end, (grant,))
            raise
        yield steps.Call(self.end, (grant,))
        return outcome

    def start(self, grant: Lease) -> Skipped | None:
        holder = unique.claim_start(
            self.key, task=self.name, task_id=self.task_id, scope=self.spec.scope, grant=grant,
            seconds=self.spec.seconds, using=self.using,
        )
        if holder is None:
            return None
        detail = f"unique key {self.key!r} is held by {holder} ({self.spec.scope}); not running"
        logger.info("task skipped %s", LogFields(task=self.label, reason="duplicate", detail=detail))
        jobs.tally(self.name, JobOutcome.SKIPPED, using=self.using)
        signals.task_skipped.send(
            sender=self.sender, task=self.task, key=self.key, reason="duplicate", error=None
        )
        return Skipped(
            coordination="skipped", reason="duplicate", key=self.key, detail=detail, existing=holder
        )

    def end(self, grant: Lease) -> None:
        if self.spec.scope in (UniqueScope.RUNNING, UniqueScope.SUCCEEDED):
            unique.end_claim(self.key, grant=grant, using=self.using)
