"""Celery tasks that carry their fencing token into the writes they make.

::

    from coordination.contrib.celery import fenced_task

    @fenced_task(lock="account:{account_id}", ttl=30)
    def settle(account_id):
        ...   # long work: the lease is kept alive meanwhile
        Account.objects.filter(pk=account_id).fenced_update(balance=new)  # this execution's token

Every execution (first run, retry, autoretry, broker redelivery) acquires a new
grant, so a copy that stalled past its lease (GC, VM pause, SIGSTOP) and wakes up
late writes with an older token than the copy that ran after it, and the fence
refuses it. See ``docs/celery.md`` for the options and what fencing does not do.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from typing import Any, Concatenate, Literal, NoReturn, ParamSpec, TypeVar, cast, overload

from celery import Task, current_app, shared_task
from celery._state import _task_stack  # type: ignore[attr-defined]
from celery.exceptions import Retry
from celery.signals import worker_init, worker_ready
from celery.utils import uuid
from celery.utils.imports import gen_task_name

from .. import jobs, locks, signals
from .. import unique as unique_claims
from ..conf import app_settings
from ..exceptions import (
    DuplicateWrite,
    InvalidInput,
    LeaseLost,
    StaleInstance,
    StaleToken,
    UnfencedWrite,
)
from ..leases import Lease
from ..logfields import LogFields
from ..models import Lock
from ..semaphores import MAX_PERMITS
from .execution import (
    FencedExecution,
    LockSpec,
    OnBusy,
    Skipped,
    current_execution,
    holder_name,
    lock_key_for,
    skipped,
    validate_on_busy,
)
from .execution_limits import call_arguments, check_rate, parameters_of
from .lock_keys import check_template, signature_of
from .unique import UniqueFor, UniqueGate, UniqueSpec, unique_spec

__all__ = ["ENQUEUE_TOKEN_HEADER", "REFUSALS", "FencedTask", "Skipped", "fenced_task", "supersede_key"]

logger = logging.getLogger("coordination.tasks")

ENQUEUE_TOKEN_HEADER = "coordination_enqueue_token"
"""Message header of a supersede-mode task: the token its producer took at enqueue."""

_F = TypeVar("_F", bound=Callable[..., Any])
_P = ParamSpec("_P")
_R = TypeVar("_R")

#: What a fenced task raises when a late write is refused: expected, so Celery logs
#: them at INFO without a traceback ("raised expected"), not at ERROR.
REFUSALS: tuple[type[Exception], ...] = (
    StaleToken, DuplicateWrite, StaleInstance, UnfencedWrite, LeaseLost,
)


def supersede_key(key: str) -> str:
    """The lock whose tokens number the enqueues of ``key`` in supersede mode."""
    return f"supersede:{key}"


class FencedTask(Task[_P, _R]):
    """Base class of fenced tasks: each execution runs under a new grant of its lock.

    Configured by class attributes, which ``fenced_task`` sets from its arguments:
    ``fenced_lock`` (template or callable over the task's arguments),
    ``fenced_ttl``, ``fenced_wait``, ``fenced_on_busy``, ``fenced_keepalive``,
    ``fenced_supersede``, ``fenced_once_per_slot``, ``fenced_concurrency`` and
    ``fenced_once`` and ``fenced_unique`` (a :class:`~coordination.contrib.unique.UniqueSpec`).
    """

    fenced_lock: LockSpec | None = None
    fenced_ttl: float | None = None
    fenced_wait: float = 0.0
    fenced_on_busy: OnBusy = "retry"
    fenced_keepalive: bool = True
    fenced_supersede: bool = False
    fenced_once_per_slot: bool = False
    fenced_concurrency: int | None = None
    fenced_once: bool = False
    fenced_unique: UniqueSpec | None = None
    fenced_rate: Any = None
    fenced_rate_key: str = ""

    throws = REFUSALS
    """Refused late writes are what a fencing token is for: Celery logs them as
    expected (INFO, no traceback). ``throws=()`` on the decorator logs them as
    errors with their traceback; a tuple of your own replaces this one (add
    ``REFUSALS`` to it to keep them expected)."""

    @property
    def grant(self) -> Lease | None:
        """The lease of this task's execution running now, or None outside it."""
        execution = current_execution()
        return execution.grant if execution is not None and execution.task is self else None

    def lock_key(self, args: Any = (), kwargs: Any = None) -> str:
        """The lock key of a call with ``args`` and ``kwargs``."""
        if self.fenced_lock is None:
            raise InvalidInput(f"fenced task {self.name} declares no lock")
        return lock_key_for(self.fenced_lock, self.run, tuple(args or ()), dict(kwargs or {}))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.request_stack.top is None:
            # Called as a plain function: set up the request the way Task.__call__
            # does. From a worker the tracer has pushed the real request (with the
            # id, retries and headers), and Task.__call__ would hide it behind an
            # empty one, so the body is run directly.
            _task_stack.push(self)
            self.push_request(args=args, kwargs=kwargs)
            try:
                return self._run_fenced(args, kwargs)
            finally:
                self.pop_request()
                _task_stack.pop()
        return self._run_fenced(args, kwargs)

    def apply_async(self, args: Any = None, kwargs: Any = None, **options: Any) -> Any:  # type: ignore[override]
        """Send the task; in supersede mode, first number this enqueue of its key.

        A retry keeps the number of the enqueue it retries (it travels in the
        request's headers), so a later enqueue supersedes the retry too.

        A unique task (``unique=``) first claims its key for the message's task
        id; a duplicate is not sent: the result is the ``AsyncResult`` of the
        execution holding the key, with ``duplicate`` set to True (False on a
        message sent), and the duplicate is logged ("task enqueue deduplicated").
        """
        if self.fenced_unique is not None:
            return self._apply_unique(self.fenced_unique, args, kwargs, options)
        return self._send(args, kwargs, options)

    def _send(self, args: Any, kwargs: Any, options: dict[str, Any]) -> Any:
        if self.fenced_supersede:
            headers = dict(options.get("headers") or {})
            if ENQUEUE_TOKEN_HEADER not in headers:
                key = self.lock_key(args, kwargs)
                # A short lease, released at once: only its token matters.
                ticket = locks.acquire(
                    supersede_key(key),
                    holder=f"enqueue {self.name}",
                    ttl=max(5.0, float(app_settings.MIN_TTL)),
                    wait=min(10.0, float(app_settings.MAX_WAIT)),
                )
                locks.release(ticket)
                headers[ENQUEUE_TOKEN_HEADER] = ticket.token
                options["headers"] = headers
        return super().apply_async(args, kwargs, **options)

    def _apply_unique(self, spec: UniqueSpec, args: Any, kwargs: Any, options: dict[str, Any]) -> Any:
        key = spec.key_for(self.run, args, kwargs)
        task_id = options.setdefault("task_id", None) or uuid()
        options["task_id"] = task_id
        countdown = options.get("countdown")
        holder = unique_claims.claim_enqueue(
            key, task=self.name, task_id=task_id, scope=spec.scope, seconds=spec.seconds,
            countdown=float(countdown) if isinstance(countdown, (int, float)) else 0.0,
        )
        if holder is not None:
            logger.info(
                "task enqueue deduplicated %s",
                LogFields(task=self.name, key=key, existing=holder, scope=spec.scope),
            )
            existing: Any = self.AsyncResult(holder)
            existing.duplicate = True
            return existing
        try:
            sent = self._send(args, kwargs, options)
        except BaseException:
            unique_claims.release_enqueue(key, task_id=task_id)
            raise
        sent.duplicate = False
        return sent

    # --- one execution ----------------------------------------------------------

    def _run_fenced(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        request = self.request
        key = self.lock_key(args, kwargs)
        execution = FencedExecution(
            key,
            holder=holder_name(self.name, request.id, request.retries + 1),
            ttl=self.fenced_ttl,
            wait=self.fenced_wait,
            keepalive=self.fenced_keepalive,
            task=self,
            label=f"{self.name}[{request.id}]",
            concurrency=self.fenced_concurrency,
            name=self.name,
            task_id=request.id,
            attempt=request.retries + 1,
            once=self.fenced_once,
            # Bound only if a policy's or the rate's key template is rendered.
            arguments=lambda: call_arguments(signature_of(self.run), args, kwargs),
            rate=self.fenced_rate,
            rate_key=self.fenced_rate_key,
        )
        body: Callable[[], Any] = lambda: self.run(*args, **kwargs)  # noqa: E731
        if self.fenced_once_per_slot:
            from .beat import once_per_slot

            run_body = body
            body = lambda: once_per_slot(run_body)  # noqa: E731
        return execution.run(
            body,
            on_busy=self.fenced_on_busy,
            retry=lambda held, countdown: self.retry(exc=held, countdown=countdown),
            superseded=(lambda: self._superseded(key)) if self.fenced_supersede else None,
            sender=type(self),
            # Called directly or eagerly there is no message to send again: a
            # paused task then waits in the caller until resumed.
            defer=None if request.called_directly or request.is_eager
            else lambda countdown, why="paused": self._defer(args, kwargs, countdown, why),
            unique=self._unique_gate(args, kwargs),
        )

    def _unique_gate(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A unique task's claim around its body (None: not unique, or called as a
        plain function, with no message to be a duplicate of)."""
        spec, request = self.fenced_unique, self.request
        if spec is None or request.called_directly or not request.id:
            return None
        return UniqueGate(
            spec, spec.key_for(self.run, args, kwargs), name=self.name, task_id=request.id,
            label=f"{self.name}[{request.id}]", task=self, sender=type(self), retrying=(Retry,),
        ).steps

    def _defer(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], countdown: float, why: str = "paused"
    ) -> NoReturn:
        """Send this message again in ``countdown`` seconds: paused by its job policy,
        or over its rate limit (``why="rate_limited"``).

        The copy keeps the task id, the retry count and the headers (a
        supersede number, a beat slot), so a deferral never spends
        ``max_retries`` and the execution it becomes is the same task to its
        caller. ``Retry`` ends this execution as Celery's own retry does: the
        worker acknowledges the message only after the copy was sent.
        """
        signature = self.signature_from_request(self.request, args, kwargs, countdown=countdown)
        signature.apply_async()
        reason = "over its rate limit" if why == "rate_limited" else "paused by its job policy"
        raise Retry(
            f"deferred: {reason}; asks again in {countdown:g} s",
            when=cast(Any, countdown), sig=signature,
        )

    def retry(self, *args: Any, **kwargs: Any) -> Any:
        """``Task.retry``, after ending this execution's lease.

        The retry message is sent before the body's exception unwinds; releasing
        first means the retry (with ``countdown=0`` on another process, say) never
        finds the lock held by the execution that sent it. ``autoretry_for``
        retries come through here too.
        """
        execution = current_execution()
        if execution is not None and execution.task is self:
            spec = self.fenced_unique
            if spec is not None and spec.scope == "succeeded" and execution.grant is not None:
                # Until it succeeded: the key stays claimed between the attempts.
                countdown = kwargs.get("countdown")
                unique_claims.requeue(
                    spec.key_for(self.run, self.request.args, self.request.kwargs),
                    grant=execution.grant,
                    countdown=float(countdown) if isinstance(countdown, (int, float)) else 0.0,
                )
            execution.end()
        return super().retry(*args, **kwargs)

    def _superseded(self, key: str) -> Skipped | None:
        ticket = self._enqueue_token()
        if ticket is None:
            return None
        latest = (
            Lock.objects.using(app_settings.DATABASE)
            .filter(key=supersede_key(key))
            .values_list("token", flat=True)
            .first()
        )
        if latest is None or ticket >= latest:
            return None
        detail = f"enqueue {ticket} of {key!r} was superseded by enqueue {latest}; not running"
        logger.info("task superseded %s", LogFields(task=self.name, id=self.request.id, detail=detail))
        signals.task_skipped.send(sender=type(self), task=self, key=key, reason="superseded", error=None)
        return skipped("superseded", key, detail)

    def _enqueue_token(self) -> int | None:
        request = self.request
        value = request.get(ENQUEUE_TOKEN_HEADER) or (request.headers or {}).get(ENQUEUE_TOKEN_HEADER)
        try:
            return None if value is None else int(value)
        except (TypeError, ValueError):
            logger.warning(
                "task header malformed %s",
                LogFields(task=self.name, id=request.id, header=ENQUEUE_TOKEN_HEADER, value=value),
            )
            return None


@overload
def fenced_task(__func: _F) -> NoReturn: ...


@overload
def fenced_task(
    *,
    lock: LockSpec,
    ttl: float | None = None,
    wait: float = 0.0,
    on_busy: OnBusy = "retry",
    keepalive: bool = True,
    supersede: bool = False,
    once_per_slot: bool = False,
    concurrency: int | None = None,
    once: bool = False,
    unique: LockSpec | None = None,
    unique_for: UniqueFor = "succeeded",
    rate: Any = None,
    rate_key: str = "",
    app: Any = None,
    bind: Literal[False] = False,
    **options: Any,
) -> Callable[[Callable[_P, _R]], FencedTask[_P, _R]]: ...


@overload
def fenced_task(
    *,
    lock: LockSpec,
    ttl: float | None = None,
    wait: float = 0.0,
    on_busy: OnBusy = "retry",
    keepalive: bool = True,
    supersede: bool = False,
    once_per_slot: bool = False,
    concurrency: int | None = None,
    once: bool = False,
    unique: LockSpec | None = None,
    unique_for: UniqueFor = "succeeded",
    rate: Any = None,
    rate_key: str = "",
    app: Any = None,
    bind: Literal[True],
    **options: Any,
) -> Callable[[Callable[Concatenate[Any, _P], _R]], FencedTask[_P, _R]]: ...


def fenced_task(
    __func: Callable[..., Any] | None = None,
    *,
    lock: LockSpec | None = None,
    ttl: float | None = None,
    wait: float = 0.0,
    on_busy: OnBusy = "retry",
    keepalive: bool = True,
    supersede: bool = False,
    once_per_slot: bool = False,
    concurrency: int | None = None,
    once: bool = False,
    unique: LockSpec | None = None,
    unique_for: UniqueFor = "succeeded",
    rate: Any = None,
    rate_key: str = "",
    app: Any = None,
    bind: bool = False,
    **options: Any,
) -> Any:
    """Declare a Celery task whose every execution runs under a new grant of ``lock``.

    - ``lock``: key template over the task's arguments (``"account:{account_id}"``)
      or a callable taking the task's arguments and returning the key.
    - ``ttl``: lease in seconds (default ``COORDINATION["DEFAULT_TTL"]``), renewed
      every ``ttl / 3`` by a keep-alive thread unless ``keepalive=False``.
    - ``wait``: seconds to wait for a busy lock in the worker before ``on_busy``.
    - ``on_busy``: ``"retry"`` (default: ``task.retry`` with a countdown of the
      holder's remaining lease plus jitter, counted against ``max_retries``),
      ``"skip"`` (return a :class:`Skipped` result, log, send
      ``signals.task_skipped``) or ``"raise"`` (fail with ``LockHeld``).
    - ``supersede``: the producer numbers each enqueue of the key (a message
      header); a worker runs a message only if no later enqueue of the key
      exists, and acks older ones with a ``Skipped`` result (latest wins).
    - ``once_per_slot``: for tasks sent by ``coordination.contrib.beat.FencedScheduler``:
      the body runs once per beat slot (the message's ``coordination_slot``
      header), its database writes committing with its stored result; a
      redelivered message of the same slot returns that result
      (:func:`coordination.contrib.beat.once_per_slot`).
    - ``concurrency``: at most this many executions of the same key run at
      once. Each execution takes one of the N permits of the semaphore named by
      the key (:func:`coordination.semaphores.acquire_permit`): its grant is
      the lease of one slot's key, ``<key>@<slot>``, and its fenced writes
      carry that slot's token, so a copy paused past its lease is refused by
      the fences keyed by its slot once another execution took the slot over.
      Fence the body's writes by the slot's key (``self.grant.key``), not by
      ``key``. An execution that gets no permit within ``wait`` is handled by
      ``on_busy`` exactly as a busy lock is. Default None: one lock, exclusive.
    - ``once``: a finished execution is not run again. The body runs in one
      transaction on ``COORDINATION["DATABASE"]`` with the record of its
      completion, keyed by the task's name and the message's task id; a
      redelivered or duplicated message of a task id whose body completed
      returns the stored result (JSON, as :func:`coordination.fencing.idempotent`
      stores it) without running the body (logged at INFO, counted as
      ``"finished"``, ``signals.task_skipped`` with ``reason="completed"``). An
      attempt that raised stored nothing: its retry runs. Opt-in, because the
      whole body is then one database transaction: a long body, one that must
      commit as it goes, or a body of more than a moment on SQLite (whose single
      writer the transaction holds, blocking other workers and the lease
      renewals) cannot take that. Effects outside the database are not in the transaction: send
      them through the outbox. The records are pruned with the grant history
      (``coordination_prune``).
    - ``unique``: a unique job: a key template over the task's arguments (as
      ``lock``, checked here) naming what must not be enqueued or run twice
      at once; ``unique_for`` says for how long: ``"queued"`` (from the enqueue
      until the message starts), ``"running"`` (while an execution runs: its
      lease), ``"succeeded"`` (default: from the enqueue, through retries,
      until the body succeeded or failed for good) or a number of seconds
      from the enqueue. A duplicate ``delay()``/``apply_async()`` sends
      nothing and returns the ``AsyncResult`` of the execution holding the key,
      with ``.duplicate`` True; a duplicate message that reaches a worker anyway
      returns a :class:`Skipped` result (reason ``"duplicate"``, ``existing``
      the holder's id) without running its body. The claims are decided by
      the database and its clock (:mod:`coordination.unique`): a killed
      worker's claim ends with its lease, a lost message's after
      ``COORDINATION["UNIQUE_QUEUED_FOR"]`` seconds.
    - ``rate``: at most this many executions start per period over every worker
      (``"10/m"``, ``"100/h"``, ``"10/30s"``: units as Django REST framework's
      throttle rates), per ``rate_key``: a template over the task's arguments
      (``"{customer_id}"``; default: one count for the task). Decided by the
      database (:mod:`coordination.ratelimits`): no window of the period holds
      more starts. An execution over it gives its lock back and is deferred by
      the countdown the limiter computed (a copy of the message, as a paused
      task's; never lost, never spending ``max_retries``). Not Celery's
      ``rate_limit``, which each worker counts alone. A job policy's
      ``rate_limit`` replaces it.
    - ``app``: register on this Celery app (default: ``shared_task``).

    Other keyword arguments are Celery task options (``bind``, ``acks_late``,
    ``max_retries``, ``autoretry_for``, ``throws``...). A template naming an
    argument the function does not take is refused here, when the task is
    declared, not in the worker. Typed as ``FencedTask[P, R]`` (a Celery
    ``Task[P, R]``) over the function, so ``.delay()`` and ``.apply_async()``
    are checked. In a bound task, ``self.grant`` is the
    execution's grant; in any task, ``locks.current_grant()`` is, and the fenced
    writes of :mod:`coordination.fencing` use it when given none.
    """
    if __func is not None:
        raise TypeError("fenced_task needs a lock: @fenced_task(lock='account:{account_id}')")
    if lock is None:
        # key= is what the storages' and other libraries' examples call it; without
        # this it would reach Celery as a task option and say nothing useful.
        given = next((name for name in ("key", "lock_key") if name in options), None)
        raise InvalidInput(
            "fenced_task needs lock=..., a key template over the task's arguments "
            "(lock='report:{customer_id}') or a callable"
            + (f"; {given}= is not one of its options, write lock={options[given]!r}" if given else "")
        )
    if not (isinstance(lock, str) or callable(lock)):
        raise InvalidInput("fenced_task(lock=...) must be a key template or a callable")
    validate_on_busy(on_busy)
    if concurrency is not None and (
        isinstance(concurrency, bool) or not isinstance(concurrency, int)
        or not 0 < concurrency <= MAX_PERMITS
    ):
        raise InvalidInput(f"fenced_task(concurrency=...) must be an integer from 1 to {MAX_PERMITS}")
    if options.get("base") is not None and not issubclass(options["base"], FencedTask):
        raise InvalidInput("a fenced task's base must be a subclass of FencedTask")
    options.setdefault("base", FencedTask)
    options.update(
        fenced_lock=staticmethod(lock) if callable(lock) else lock,
        fenced_ttl=ttl,
        fenced_wait=wait,
        fenced_on_busy=on_busy,
        fenced_keepalive=keepalive,
        fenced_supersede=supersede,
        fenced_once_per_slot=once_per_slot,
        fenced_concurrency=concurrency,
        fenced_once=bool(once),
        fenced_rate_key=rate_key,
    )
    register = shared_task if app is None else app.task

    def decorate(func: Callable[..., Any]) -> Any:
        check_template(lock, func, bound=bind)
        spec = unique_spec(unique, unique_for, func, bound=bind)
        signature = inspect.signature(func)
        if bind:
            signature = signature.replace(parameters=list(signature.parameters.values())[1:])
        options["fenced_rate"] = check_rate(rate, rate_key, signature, "fenced_task")
        # The name Celery gives it, without evaluating a shared task's proxy.
        name = options.get("name") or gen_task_name(app or current_app, func.__name__, func.__module__)
        jobs.declare_task(name, parameters_of(signature))
        return register(bind=bind, fenced_unique=spec, **options)(func)

    return decorate



@worker_init.connect(dispatch_uid="coordination.contrib.celery.check_at_worker_start")
def check_at_worker_start(sender: Any = None, **kwargs: Any) -> None:
    """Run the app's system checks when a worker with fenced tasks starts.

    Celery's Django fixup runs Django's checks at worker start but drops their
    result, so a worker would start on a configuration that ``runserver``
    refuses (a SQLite grant point without IMMEDIATE transactions fails most of
    its grants with "database is locked"). Warnings are logged; errors stop the
    worker before it takes a task, naming each one. ``CELERY_SKIP_CHECKS``
    skips this as it skips Celery's own run.
    """
    import os

    from django.core.checks import ERROR, run_checks

    if os.environ.get("CELERY_SKIP_CHECKS"):
        return
    messages = [
        message
        for message in run_checks()
        if str(message.id or "").startswith("coordination.") and not message.is_silenced()
    ]
    for message in messages:
        logger.log(logging.ERROR if message.level >= ERROR else logging.WARNING, "%s", message)
    errors = [message for message in messages if message.level >= ERROR]
    if errors:
        listed = "\n".join(str(message) for message in errors)  # each with its hint
        # SystemExit: Celery logs and swallows ordinary exceptions of signal receivers.
        raise SystemExit(f"coordination: the worker does not start, system checks failed:\n{listed}")


@worker_ready.connect(dispatch_uid="coordination.contrib.celery.report_fenced_tasks")
def report_fenced_tasks(sender: Any = None, **kwargs: Any) -> None:
    """Tell the site which fenced tasks this worker runs, once it is ready: the web
    process, which does not import the tasks, lists them on the jobs page and
    accepts job policies for them (:func:`coordination.jobs.report_tasks`)."""
    app = getattr(sender, "app", None)
    if app is None:
        return
    names = sorted(name for name, task in app.tasks.items() if isinstance(task, FencedTask))
    if names:
        jobs.report_tasks(names)
