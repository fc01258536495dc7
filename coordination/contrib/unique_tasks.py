"""Unique ``django.tasks`` tasks: the enqueue that claims the key first.

A :class:`UniqueTask` is the ``django.tasks`` ``Task`` a unique
:func:`coordination.contrib.tasks.fenced_task` becomes. Its ``enqueue()``
claims the key before the backend queues the run (pending until the backend
names its id); a duplicate queues nothing and returns the holder's result as a
:class:`DuplicateTaskResult` (``duplicate`` True). The immediate backend runs
the task inside ``enqueue()``, so there the run's own check decides, and a
backend that cannot fetch a result by id queues the duplicate, whose run is
skipped. This module imports on Django 5.2, where there is nothing to define.
"""

from __future__ import annotations

import inspect
import logging
import uuid
from collections.abc import Callable
from dataclasses import fields
from typing import Any

from django.utils import timezone

from .. import unique as claims
from ..logfields import LogFields
from .lock_keys import resolve_lock_key
from .unique import UniqueSpec

__all__ = ["DuplicateTaskResult", "UniqueTask", "enqueue_unique", "with_context_parameter"]

logger = logging.getLogger("coordination.tasks")

#: Per task function: its uniqueness, key signature, name and database alias.
_SPECS: dict[Callable[..., Any], tuple[UniqueSpec, inspect.Signature, str, str | None]] = {}


def with_context_parameter(wrapper: Callable[..., Any], func: Callable[..., Any]) -> None:
    """Give ``wrapper`` the signature ``(context, <func's parameters>)``: django.tasks
    checks that a task taking its context names it first."""
    signature = inspect.signature(func)
    context = inspect.Parameter("context", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    wrapper.__signature__ = signature.replace(  # type: ignore[attr-defined]
        parameters=[context, *signature.parameters.values()]
    )


try:
    from django.tasks import Task, TaskResult
    from django.tasks.backends.immediate import ImmediateBackend
    from django.tasks.exceptions import TaskResultDoesNotExist
except ImportError:  # Django < 6.0: fenced_task refuses before any of this is used
    pass
else:

    class DuplicateTaskResult(TaskResult):  # type: ignore[type-arg]
        """The result of the execution that holds the key, returned to a duplicate
        ``enqueue()``: ``duplicate`` is True (a result actually queued has none)."""

        duplicate = True

    class UniqueTask(Task):  # type: ignore[type-arg]
        """A unique fenced task: ``enqueue()`` claims its key first."""

        def enqueue(self, *args: Any, **kwargs: Any) -> Any:
            backend = self.get_backend()
            spec, signature, name, using = _SPECS[self.func]
            if isinstance(backend, ImmediateBackend):
                return Task.enqueue(self, *args, **kwargs)  # runs now: its own check decides
            key = resolve_lock_key(spec.key, signature, args, kwargs)
            pending = f"{claims.PENDING}{uuid.uuid4().hex}"
            later = (self.run_after - timezone.now()).total_seconds() if self.run_after else 0.0
            holder = claims.claim_enqueue(
                key, task=name, task_id=pending, scope=spec.scope, seconds=spec.seconds,
                countdown=later, using=using,
            )
            if holder is not None:
                existing = _existing(backend, holder)
                logger.info(
                    "task enqueue deduplicated %s",
                    LogFields(task=name, key=key, existing=holder, scope=spec.scope,
                              queued=existing is None),
                )
                if existing is not None:
                    return existing
            try:
                result = Task.enqueue(self, *args, **kwargs)
            except BaseException:
                if holder is None:
                    claims.release_enqueue(key, task_id=pending, using=using)
                raise
            if holder is None:
                claims.name_claim(key, pending=pending, task_id=str(result.id), using=using)
            return result

    def _existing(backend: Any, holder: str) -> Any:
        """The holder's result, as a DuplicateTaskResult, or None where the backend
        cannot fetch it (the duplicate is then queued, and its run skipped)."""
        try:
            found = backend.get_result(holder)
        except (NotImplementedError, TaskResultDoesNotExist):
            return None
        duplicate = DuplicateTaskResult(
            **{field.name: getattr(found, field.name) for field in fields(found) if field.init}
        )
        object.__setattr__(duplicate, "_return_value", getattr(found, "_return_value", None))
        return duplicate


def enqueue_unique(
    task: Any, spec: UniqueSpec, func: Callable[..., Any], *, using: str | None, takes_context: bool
) -> Any:
    """``task`` (a registered django.tasks Task) as a :class:`UniqueTask`."""
    signature = inspect.signature(func)
    if takes_context:
        signature = signature.replace(parameters=list(signature.parameters.values())[1:])
    _SPECS[task.func] = (spec, signature, f"{func.__module__}.{func.__qualname__}", using)
    return UniqueTask(**{field.name: getattr(task, field.name) for field in fields(task) if field.init})
