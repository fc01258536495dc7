"""Fenced tasks for Django's own task framework (``django.tasks``, Django 6.0+).

The twin of :func:`coordination.contrib.celery.fenced_task`, so a team moving
off Celery keeps its fencing::

    from coordination.contrib.tasks import fenced_task

    @fenced_task(lock="account:{account_id}", ttl=30)
    def settle(account_id):
        Account.objects.filter(pk=account_id).fenced_update(balance=new)  # this run's token

    settle.enqueue(account_id=7)

An ``async def`` task function works the same way (the lease is taken with
``locks.aacquire``, kept alive by an asyncio task and released when the
coroutine ends, a cancellation included; see docs/async.md); inside it, write
with ``afenced_update`` or ``afence``.

Each run of the task acquires a new grant of its lock (a higher token than any
earlier run), keeps the lease alive from a thread with its own database
connection, makes the grant current for fenced writes while the body runs
(``locks.current_grant()``; ``context.grant`` is not available because Django's
``TaskContext`` is frozen) and releases it on every exit path.

``django.tasks`` has no retry, so a busy lock either waits (``wait`` seconds in
the worker), is skipped (``on_busy="skip"``: the result is a
:class:`~coordination.contrib.execution.Skipped` dict, logged and signalled) or
fails the task (``on_busy="raise"``, the default: ``LockHeld``).

The task's job policy (:mod:`coordination.jobs`, looked up by the function's
``module.qualname``, the name in its holder) applies as for Celery. A paused
run is deferred by enqueueing the task again with ``run_after`` (its result is
a ``Skipped`` dict with ``coordination: "deferred"``) on a backend that
supports it; on one that does not (the immediate backend) it waits in the
worker until resumed.

This module imports on Django 5.2 too; ``fenced_task`` then raises
``ImproperlyConfigured``, since there is no ``django.tasks`` to register with.
"""

from __future__ import annotations

import datetime as dt
import functools
import inspect
from collections.abc import Callable
from typing import Any, TypeVar

from django.core.exceptions import ImproperlyConfigured
from django.utils import timezone

from .. import jobs
from ..exceptions import InvalidInput
from .execution import (
    AsyncFencedExecution,
    FencedExecution,
    LockSpec,
    deferred,
    holder_name,
    resolve_lock_key,
    validate_on_busy,
)
from .execution_limits import call_arguments, check_rate, parameters_of
from .lock_keys import check_template
from .unique import UniqueFor, UniqueGate, UniqueSpec, unique_spec
from .unique_tasks import enqueue_unique, with_context_parameter

__all__ = ["fenced", "fenced_task"]

_F = TypeVar("_F", bound=Callable[..., Any])
_E = TypeVar("_E", FencedExecution, AsyncFencedExecution)


def fenced(
    *,
    lock: LockSpec,
    ttl: float | None = None,
    wait: float = 0.0,
    on_busy: str = "raise",
    keepalive: bool = True,
    takes_context: bool = False,
    using: str | None = None,
    registered: Callable[[], Any] | None = None,
    once: bool = False,
    unique: UniqueSpec | None = None,
    hide_context: bool = False,
    rate: Any = None,
    rate_key: str = "",
) -> Callable[[_F], _F]:
    """Wrap a task function so that each call runs under a new grant of ``lock``.

    The building block of :func:`fenced_task`; use it directly under another
    task decorator (``@task(...)`` of a third-party backend) if needed. With
    ``takes_context=True`` the first argument (Django's ``TaskContext``) is not
    part of the lock key template. ``registered`` returns the ``django.tasks``
    Task the function became, which a paused run enqueues again (None: a
    paused run waits in the worker). ``once``: as for the Celery
    ``fenced_task``, keyed by the run's result id, which only the
    ``TaskContext`` carries: it needs ``takes_context=True`` and a synchronous
    function (a transaction cannot span the awaits of an ``async def`` body).
    ``unique``: the task's uniqueness, checked
    when a run starts (it needs the run's id: the context). ``hide_context``:
    the wrapper takes the context first, the function does not. ``rate`` and ``rate_key``: as for the
    Celery ``fenced_task``; a run over the rate is enqueued again to run after
    the limiter's countdown (or waits it out in the worker where it cannot be).
    """
    if not (isinstance(lock, str) or callable(lock)):
        raise InvalidInput("fenced(lock=...) must be a key template or a callable")
    busy = validate_on_busy(on_busy, ("skip", "raise"))

    def decorate(func: _F) -> _F:
        check_template(lock, func, bound=takes_context and not hide_context)
        if once and (not takes_context or inspect.iscoroutinefunction(func)):
            raise InvalidInput(
                "fenced(once=True) needs takes_context=True (the run's id is in its context) "
                "and a synchronous function (a transaction cannot span awaits)"
            )
        signature = _key_signature(func, takes_context and not hide_context)
        name = f"{func.__module__}.{func.__qualname__}"
        checked_rate = check_rate(rate, rate_key, signature, "fenced")
        jobs.declare_task(name, parameters_of(signature))

        def call(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            return func(*(args[1:] if hide_context else args), **kwargs)

        def gate(run: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            """A unique task's claim around the body (None: not unique, or no run id)."""
            if unique is None or run.task_id is None:
                return None
            key_args = args[1:] if takes_context else args
            return UniqueGate(
                unique, resolve_lock_key(unique.key, signature, key_args, kwargs), name=name,
                task_id=run.task_id, label=run.label, task=func, sender=fenced, using=using,
            ).steps

        def execution(args: tuple[Any, ...], kwargs: dict[str, Any], kind: type[_E]) -> _E:
            key_args = args[1:] if takes_context else args
            key = resolve_lock_key(lock, signature, key_args, kwargs)
            task_id, attempt = _identity(args[0] if takes_context and args else None)
            return kind(
                key, holder=holder_name(name, task_id, attempt), ttl=ttl, wait=wait,
                keepalive=keepalive, using=using, task=func, label=f"{func.__qualname__}[{task_id}]",
                name=name, task_id=task_id, attempt=attempt, once=once,
                arguments=call_arguments(signature, key_args, kwargs), rate=checked_rate,
                rate_key=rate_key,
            )

        def deferrer(
            key: str, args: tuple[Any, ...], kwargs: dict[str, Any]
        ) -> Callable[..., Any] | None:
            """Enqueue the run again with ``run_after``, or None where the backend cannot."""
            task = registered() if registered is not None else None
            if task is None or not getattr(task.get_backend(), "supports_defer", False):
                return None

            def defer(countdown: float, why: str = "paused") -> Any:
                again = task.using(
                    run_after=timezone.now() + dt.timedelta(seconds=countdown)
                ).enqueue(*(args[1:] if takes_context else args), **kwargs)
                reason = "over its rate limit" if why == "rate_limited" else "paused by its job policy"
                result = deferred(
                    key, f"{reason}; enqueued again as {again.id}, to run in {countdown:g} s",
                )
                result["reason"] = why
                return result

            return defer

        if inspect.iscoroutinefunction(func):
            # Wrapped by a coroutine function in turn, so that django.tasks awaits
            # the body (and the lease's whole life) instead of a bare coroutine
            # object returned after the lease was released.
            @functools.wraps(func)
            async def arun(*args: Any, **kwargs: Any) -> Any:
                run = execution(args, kwargs, AsyncFencedExecution)
                return await run.run(
                    lambda: call(args, kwargs), on_busy=busy, sender=fenced,
                    defer=deferrer(run.key, args, kwargs), unique=gate(run, args, kwargs),
                )

            if hide_context:
                with_context_parameter(arun, func)
            return arun  # type: ignore[return-value]

        @functools.wraps(func)
        def run(*args: Any, **kwargs: Any) -> Any:
            one = execution(args, kwargs, FencedExecution)
            return one.run(
                lambda: call(args, kwargs), on_busy=busy, sender=fenced,
                defer=deferrer(one.key, args, kwargs), unique=gate(one, args, kwargs),
            )

        if hide_context:
            with_context_parameter(run, func)
        return run  # type: ignore[return-value]

    return decorate


def fenced_task(
    *,
    lock: LockSpec,
    ttl: float | None = None,
    wait: float = 0.0,
    on_busy: str = "raise",
    keepalive: bool = True,
    takes_context: bool = False,
    using: str | None = None,
    once: bool = False,
    unique: LockSpec | None = None,
    unique_for: UniqueFor = "succeeded",
    rate: Any = None,
    rate_key: str = "",
    **task_options: Any,
) -> Callable[[Callable[..., Any]], Any]:
    """Declare a ``django.tasks`` task whose every run holds a new grant of ``lock``.

    ``lock``, ``ttl``, ``wait``, ``keepalive``: as for the Celery ``fenced_task``.
    ``on_busy``: ``"raise"`` (default; the task fails with ``LockHeld``) or
    ``"skip"``. ``once``: a run whose body completed is not run again (as for
    the Celery ``fenced_task``: opt-in, the body is one database transaction);
    it needs ``takes_context=True``. ``rate``, ``rate_key``: as for the Celery
    ``fenced_task`` (``rate="10/m"``). Other keyword arguments (``priority``, ``queue_name``,
    ``backend``) go to ``django.tasks.task``. Raises ``ImproperlyConfigured`` on
    a Django without ``django.tasks``.

    ``unique`` and ``unique_for``: a unique job, as for the Celery
    ``fenced_task``. A run that starts while another execution holds the key
    returns a ``Skipped`` dict (reason ``"duplicate"``, ``existing`` the
    holder's result id) without running the body. On a backend that queues
    (every one but the immediate backend, which runs the task inside
    ``enqueue()``), a duplicate ``enqueue()`` queues nothing and returns the
    holder's result (``backend.get_result``) with ``duplicate`` True; where the
    backend cannot fetch results, the duplicate is queued and its run is the
    ``Skipped`` one. The task is registered with ``takes_context=True`` (its
    run's id is its claim's), the context passed on only if asked for.
    """
    try:
        from django.tasks import task
    except ImportError:  # Django < 6.0
        raise ImproperlyConfigured(
            "coordination.contrib.tasks.fenced_task needs django.tasks (Django 6.0 or newer); "
            "on older Django use coordination.contrib.celery.fenced_task"
        ) from None
    register: Any = task  # its overloads need takes_context as a literal
    def decorate(func: Callable[..., Any]) -> Any:
        spec = unique_spec(unique, unique_for, func, bound=takes_context)
        context = takes_context or spec is not None
        made: list[Any] = []  # the Task, once registered: a paused run enqueues it again
        wrap = fenced(
            lock=lock, ttl=ttl, wait=wait, on_busy=on_busy, keepalive=keepalive,
            takes_context=context, using=using, registered=lambda: made[0] if made else None,
            unique=spec, hide_context=context and not takes_context, once=once,
            rate=rate, rate_key=rate_key,
        )
        made.append(register(takes_context=context, **task_options)(wrap(func)))
        if spec is not None:
            made[0] = enqueue_unique(made[0], spec, func, using=using, takes_context=takes_context)
        return made[0]

    return decorate


def _key_signature(func: Callable[..., Any], takes_context: bool) -> inspect.Signature:
    signature = inspect.signature(func)
    if takes_context:
        signature = signature.replace(parameters=list(signature.parameters.values())[1:])
    return signature


def _identity(context: Any) -> tuple[str | None, int]:
    result = getattr(context, "task_result", None)
    if result is None:
        return None, 1
    return str(result.id), int(getattr(context, "attempt", 1) or 1)
