"""One fenced execution of a task: acquire, keep the lease alive, expose, release.

The Celery decorator (:mod:`coordination.contrib.celery`) and its twin for
Django's ``django.tasks`` (:mod:`coordination.contrib.tasks`) both run their
task bodies through :class:`FencedExecution`, so both behave the same way:

- every execution acquires its own grant (a new, higher token), because the
  task id is not a holder identity: retries and broker redeliveries share it;
- the grant is the current one for fenced writes (``locks.use_grant``) while
  the body runs, and only then;
- a :class:`~coordination.keepalive.KeepAlive` thread with its own database connection renews the
  lease a third of ``ttl`` after each renewal started, retries a failed one
  while the lease is certainly live, and marks the grant lost once it may
  have expired, so later fenced writes of the body are refused instead of
  applied;
- the grant's own lease is released on every exit path (and before a Celery
  retry is sent: :meth:`FencedExecution.end`). A process that dies without
  getting there (SIGKILL, hard time limit) leaves a lease that simply expires:
  nothing to clean up by hand;
- a busy lock is handled the same way: ``on_busy="raise"`` (``LockHeld``),
  ``"skip"`` (a :class:`Skipped` result, logged and signalled) or ``"retry"``
  (the integration's own retry, after the holder's remaining lease);
- the task's job policy (:mod:`coordination.jobs`), read at each execution,
  applies the same way: a paused task defers (the integration's ``defer``) or
  skips, ``max_running`` and ``key_cap`` take fenced permits beside the key's
  lock, a rate limit defers the executions over it, and ``ttl`` and
  ``on_busy`` overrides replace the decorator's (:mod:`.execution_limits`).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from collections.abc import Awaitable, Callable
from contextlib import AbstractContextManager
from typing import Any, Required, TypedDict, TypeVar, Unpack, cast

from .. import aio, jobs, locks, signals
from ..backends.outcomes import ExecutionRecord
from ..conf import app_settings
from ..exceptions import InvalidInput, LockHeld
from ..holders import this_process
from ..keepalive import AsyncKeepAlive, KeepAlive
from ..leases import Lease
from ..logfields import LogFields
from ..models import JobOutcome, WhenPaused
from ..semaphores import aacquire_permit, acquire_permit, permit_keys
from . import execution_steps as steps
from .execution_limits import RateLimited, _Limits
from .lock_keys import LockSpec, lock_key_for, resolve_lock_key
from .once import Found, completed, finished, once_key, run_once
from .release import release_quietly
from .skipped import OnBusy, Skipped, deferred, holder_name, retry_countdown, skipped, validate_on_busy

__all__ = [
    "AsyncFencedExecution",
    "FencedExecution",
    "KeepAlive",
    "LockSpec",
    "OnBusy",
    "Skipped",
    "current_execution",
    "deferred",
    "holder_name",
    "lock_key_for",
    "release_quietly",
    "resolve_lock_key",
    "skipped",
    "validate_on_busy",
]

logger = logging.getLogger("coordination.tasks")

_T = TypeVar("_T")
_R = TypeVar("_R")


class _ExecutionOptions(TypedDict, total=False):
    holder: Required[str]
    ttl: float | None
    wait: float
    keepalive: bool
    using: str | None
    task: Any
    label: str | None
    concurrency: int | None
    name: str | None
    task_id: str | None
    attempt: int
    once: bool
    arguments: Any
    rate: Any
    rate_key: str


class _Execution(_Limits):
    """What both kinds of execution are given: the key, who holds it, for how long,
    how long to wait for it, and the grant once there is one."""

    def __init__(
        self,
        key: str,
        *,
        holder: str,
        ttl: float | None = None,
        wait: float = 0.0,
        keepalive: bool = True,
        using: str | None = None,
        task: Any = None,
        label: str | None = None,
        concurrency: int | None = None,
        name: str | None = None,
        task_id: str | None = None,
        attempt: int = 1,
        once: bool = False,
        arguments: Any = None,
        rate: Any = None,
        rate_key: str = "",
    ) -> None:
        if concurrency is not None:
            permit_keys(key, concurrency)  # InvalidInput for a bad limit, before any grant
        self.key = key
        self.holder = holder
        self.ttl = float(app_settings.DEFAULT_TTL if ttl is None else ttl)
        self.wait = wait
        self.keepalive = keepalive
        self.using = using
        self.task = task
        self.label = label or holder
        self.concurrency = concurrency
        #: The task's name, which its job policy is looked up by (None: no policy).
        self.name = name
        #: The message's id and attempt, recorded with the execution's grant.
        self.task_id = task_id
        self.attempt = attempt
        #: With ``once``: the record of this task id's completed body (None: no record).
        self.once_key = once_key(name or self.label, task_id) if once and task_id else None
        #: The call's arguments by name, and the decorator's rate (see _Limits).
        self.arguments, self.rate, self.rate_key = arguments, rate, rate_key
        self.policy: jobs.Policy | None = None
        #: With a policy's ``max_running``: the cap and the execution's permit.
        self.max_running: int | None = None
        self.permit: Lease | None = None
        self.grant: Lease | None = None

    def _read_policy(self, on_busy: OnBusy) -> OnBusy:
        """Read the task's job policy (cached per process) and apply its overrides;
        returns the ``on_busy`` in force. Called before the acquire, on the thread
        that runs the execution (a database read at most every refresh)."""
        if self.name is None:
            return on_busy
        self.policy = policy = jobs.policy_for(self.name, using=self.using)
        if policy is None:
            return on_busy
        if policy.ttl is not None:
            self.ttl = policy.ttl
        self.max_running = policy.max_running
        return cast(OnBusy, policy.on_busy) if policy.on_busy else on_busy

    def _paused_detail(self) -> str:
        assert self.policy is not None
        return (
            f"task {self.name} is paused by job policy {self.policy.task!r}; "
            f"{'skipped' if self.policy.when_paused == WhenPaused.SKIP else 'deferred'}"
        )

    def _skip_busy(self, held: LockHeld, sender: Any) -> Skipped:
        """``on_busy="skip"``: the one way both kinds of execution log, count and
        signal a task skipped because its lock (or every permit) stayed held."""
        logger.warning("task skipped %s", LogFields(task=self.label, detail=held.detail))
        self._tally(JobOutcome.SKIPPED)
        signals.task_skipped.send(
            sender=sender, task=self.task, key=self.key, reason="lock_held", error=held
        )
        return skipped("lock_held", self.key, held.detail)

    def _skip_paused(self, sender: Any) -> Skipped:
        detail = self._paused_detail()
        logger.info("task skipped %s", LogFields(task=self.label, detail=detail))
        self._tally(JobOutcome.SKIPPED)
        signals.task_skipped.send(
            sender=sender, task=self.task, key=self.key, reason="paused", error=None
        )
        return skipped("paused", self.key, detail)

    def _pause_poll(self) -> float:
        assert self.policy is not None
        return max(0.05, min(self.policy.defer_seconds, float(app_settings.JOB_POLICY_REFRESH)))

    def _tally(self, outcome: JobOutcome) -> None:
        if self.name is not None:
            jobs.tally(self.name, outcome, using=self.using)

    def _record(self) -> None:
        """Record the execution under its grant (and permit): the jobs page's running
        executions are these records, never a holder name any client may choose."""
        if self.name is not None and self.grant is not None:
            jobs.record_execution(
                self.name, self.grant, task_id=self.task_id, attempt=self.attempt,
                worker=this_process(), permit=self.permit, cap_permit=self.cap_permit,
                using=self.using,
            )

    def _record_with_grant(self) -> ExecutionRecord | None:
        """The record to write with the key's grant itself (one round trip on
        PostgreSQL), or None when it is written after the permits and limits: a
        ``max_running`` permit goes into the record, and an execution over a cap
        or a rate gives its grant back without running."""
        if self.name is None or self.concurrency is not None or self.max_running is not None or self._limited:
            return None
        return ExecutionRecord.of(self.name, self.task_id, self.attempt, this_process())


class _Machine(_Execution):
    """The execution's steps, once for both drivers: the policy's pause (defer or
    skip, logged and counted), the supersede check, the acquire with ``on_busy``,
    the policy permit, keep-alive, the body and the release."""

    def __init__(self, key: str, **options: Unpack[_ExecutionOptions]) -> None:
        super().__init__(key, **options)
        self._keeper: Any = None
        self._permit_keeper: Any = None
        self._cap_keeper: Any = None
        self._ended = False

    def _steps(
        self,
        *,
        on_busy: OnBusy,
        retry: Callable[[LockHeld, float], Any] | None,
        superseded: Callable[[], Skipped | None] | None,
        sender: Any,
        defer: Callable[..., Any] | None,
        unique: Callable[[Lease], steps.Steps[Any]] | None = None,
    ) -> steps.Steps[Any]:
        once = self.once_key
        if once is not None and (found := (yield steps.Call(completed, (once, self.using)))):
            return (yield steps.Call(finished, (self, found, sender)))
        on_busy = yield steps.Call(self._read_policy, (on_busy,))
        waited = False
        while self.policy is not None and self.policy.paused:
            if self.policy.when_paused == WhenPaused.SKIP:
                return (yield steps.Call(self._skip_paused, (sender,)))
            if not waited:
                yield steps.Call(self._defer_paused)
            if defer is not None:
                # Its result, or its exception (Celery's Retry), is the outcome.
                return (yield steps.Call(defer, (self.policy.defer_seconds,)))
            # No way to send the execution again: it waits in this worker.
            waited = True
            yield steps.Sleep(self._pause_poll())
            on_busy = yield steps.Call(self._read_policy, (on_busy,))
        if superseded is not None and (passed := (yield steps.Call(superseded))) is not None:
            yield steps.Call(self._tally, (JobOutcome.SKIPPED,))
            return passed
        while True:
            try:
                grant = yield from self._acquire_steps()
            except LockHeld as held:
                return (yield steps.Call(self._busy, (held, on_busy, retry, sender)))
            except RateLimited as limited:
                yield steps.Call(self._defer_rate, (limited,))
                if defer is not None:
                    return (yield steps.Call(defer, (limited.countdown, "rate_limited")))
                yield steps.Sleep(limited.countdown)  # no way to send it again: it waits here
                continue
            break
        try:
            yield from self._keepalive_steps(grant)
            if superseded is not None and (passed := (yield steps.Call(superseded))) is not None:
                yield steps.Call(self._tally, (JobOutcome.SKIPPED,))
                return passed
            if unique is not None:  # a unique task's claim around its body
                outcome = yield from unique(grant)
            else:
                outcome = yield steps.Body(grant)
            if isinstance(outcome, Found):  # a concurrent copy completed it meanwhile
                return (yield steps.Call(finished, (self, outcome, sender)))
            return outcome
        finally:
            yield from self._end_steps()

    def _acquire_steps(self) -> steps.Steps[Lease]:
        record = self._record_with_grant()
        grant: Lease = yield steps.Acquire(self.key, self.concurrency, record)
        if self.max_running is not None and self.name is not None:
            # The key's lock first: a busy key then never holds a task permit,
            # even for a moment, that an execution of another key could use.
            if self.keepalive and self.wait > 0:
                # The wait for a permit may outlast the key's lease: keep it alive.
                self._keeper = yield steps.StartKeepAlive(grant)
            try:
                self.permit = yield steps.Acquire(jobs.permit_name(self.name), self.max_running)
            except BaseException:
                try:
                    if self._keeper is not None:
                        keeper, self._keeper = self._keeper, None
                        yield steps.StopKeepAlive(keeper)
                finally:
                    yield steps.Release(grant)
                raise
        yield from self._limit_steps(grant)
        self.grant = grant
        if record is None:
            yield steps.Call(self._record)
        return grant

    def _keepalive_steps(self, grant: Lease) -> steps.Steps[None]:
        if not self.keepalive:
            return
        if self._keeper is None:
            self._keeper = yield steps.StartKeepAlive(grant)
        if self.permit is not None:
            # The permit's loss (revoked, or expired in a pause) marks the key's
            # grant lost too: the body's later fenced writes are refused.
            self._permit_keeper = yield steps.StartKeepAlive(self.permit, grant)
        if self.cap_permit is not None:
            self._cap_keeper = yield steps.StartKeepAlive(self.cap_permit, grant)

    def _end_steps(self) -> steps.Steps[None]:
        """Once: stop the keep-alives (so they cannot renew, and fail on, a released
        lease), then release the grant's own lease and the permit's."""
        if self._ended or self.grant is None:
            return
        self._ended = True
        try:
            for keeper in (self._keeper, self._permit_keeper, self._cap_keeper):
                if keeper is not None:
                    yield steps.StopKeepAlive(keeper)
        finally:
            try:
                yield steps.Release(self.grant)
            finally:
                for permit in (self.permit, self.cap_permit):
                    if permit is not None:
                        yield steps.Release(permit)

    def _acquire_lease(self, key: str, limit: int | None, record: ExecutionRecord | None) -> Lease:
        if record is not None:
            return jobs.acquire_execution(
                key, record, holder=self.holder, ttl=self.ttl, wait=self.wait, using=self.using
            )
        if limit is None:
            return locks.acquire(key, holder=self.holder, ttl=self.ttl, wait=self.wait, using=self.using)
        return acquire_permit(
            key, limit=limit, holder=self.holder, ttl=self.ttl, wait=self.wait, using=self.using
        )

    async def _aacquire_lease(self, key: str, limit: int | None, record: ExecutionRecord | None) -> Lease:
        if record is not None:
            return await jobs.aacquire_execution(
                key, record, holder=self.holder, ttl=self.ttl, wait=self.wait, using=self.using
            )
        if limit is None:
            return await locks.aacquire(
                key, holder=self.holder, ttl=self.ttl, wait=self.wait, using=self.using
            )
        return await aacquire_permit(
            key, limit=limit, holder=self.holder, ttl=self.ttl, wait=self.wait, using=self.using
        )

    def _defer_paused(self) -> None:
        logger.info("task deferred %s", LogFields(task=self.label, detail=self._paused_detail()))
        self._tally(JobOutcome.DEFERRED)

    def _busy(
        self,
        held: LockHeld,
        on_busy: OnBusy,
        retry: Callable[[LockHeld, float], Any] | None,
        sender: Any,
    ) -> Skipped:
        if on_busy == "skip":
            return self._skip_busy(held, sender)
        if on_busy == "retry" and retry is not None:
            countdown = retry_countdown(held)
            logger.info(
                "task retries %s",
                LogFields(task=self.label, countdown=f"{countdown:.2f}s", detail=held.detail),
            )
            raise retry(held, countdown)
        raise held


class FencedExecution(_Machine):
    """One execution of a task body under a new grant of ``key``: the one path the
    Celery decorator and its ``django.tasks`` twin both run their bodies through.

    :meth:`run` does it all (supersede check, acquire, ``on_busy``, keep-alive,
    ``use_grant``, release on every exit path). The parts, for callers that need
    them: ``acquire()`` (may raise ``LockHeld``), then ``with execution:``
    (keep-alive and ``use_grant`` on entry, :meth:`end` on exit)::

        execution = FencedExecution(key, holder=..., ttl=30)
        grant = execution.acquire()          # may raise LockHeld
        with execution:                      # keep-alive + use_grant, release on exit
            ...

    ``task`` is what runs under it (the Celery task, the function); while the
    body runs, :func:`current_execution` returns this execution. The steps are
    :class:`AsyncFencedExecution`'s, run on the calling thread.
    """

    def __init__(self, key: str, **options: Unpack[_ExecutionOptions]) -> None:
        super().__init__(key, **options)
        self._contexts: list[AbstractContextManager[Any]] = []
        self._running: contextvars.Token[FencedExecution | None] | None = None
        self._body: Callable[[], Any] | None = None
        self._in_once = False

    def acquire(self) -> Lease:
        """The execution's grant: of ``key`` itself, or with ``concurrency=N`` one
        of the N permits of the semaphore ``key`` (the lease of its slot's key,
        ``<key>@<slot>``, whose tokens fence the body's writes). ``LockHeld``
        when none is granted within ``wait``, either way."""
        return steps.drive(self._acquire_steps(), self._do)

    def __enter__(self) -> Lease:
        grant = self.grant if self.grant is not None else self.acquire()
        steps.drive(self._keepalive_steps(grant), self._do)
        self._expose(grant)
        return grant

    def __exit__(self, *exc_info: Any) -> None:
        try:
            self._unexpose(*exc_info)
        finally:
            self.end()

    def _expose(self, grant: Lease) -> None:
        context = locks.use_grant(grant)
        context.__enter__()
        self._contexts.append(context)
        self._running = _current_execution.set(self)

    def _unexpose(self, *exc_info: Any) -> None:
        if self._running is not None:
            _current_execution.reset(self._running)
            self._running = None
        while self._contexts:
            self._contexts.pop().__exit__(*exc_info)

    def end(self) -> None:
        """End this execution's lease, once: stop the keep-alive, then release the
        grant's own lease (never a newer holder's), never raising.

        Called on exit, and by a Celery ``retry()`` before the retry message is
        sent, so the retry never finds the lock held by the execution that sent it.
        Not inside the body's transaction of ``once``: the release would roll back
        with the body; the lease is released once the transaction has ended.
        """
        if self._in_once:
            return
        steps.drive(self._end_steps(), self._do)

    def run(
        self,
        body: Callable[[], _T],
        *,
        on_busy: OnBusy = "raise",
        retry: Callable[[LockHeld, float], Any] | None = None,
        superseded: Callable[[], Skipped | None] | None = None,
        sender: Any = None,
        defer: Callable[..., Any] | None = None,
        unique: Callable[[Lease], steps.Steps[Any]] | None = None,
    ) -> _T | Skipped:
        """Run ``body`` under a new grant; the outcome is the body's.

        - The task's job policy (``name``) is read first. Paused: with
          ``when_paused="skip"`` the result is a :class:`Skipped` (reason
          ``"paused"``); else the execution is deferred: ``defer(countdown)`` is
          called and its result (or exception: Celery's ``Retry``) is the
          outcome; without ``defer`` the execution waits here, reading the
          policy again every ``JOB_POLICY_REFRESH`` seconds, until resumed.
        - ``superseded``: asked before the acquire and again under the new lease; a
          :class:`Skipped` it returns is the result, without running the body.
        - ``on_busy`` when the lock (or every permit of the policy's
          ``max_running``) stays held for ``wait`` seconds: ``"raise"``
          (``LockHeld``), ``"skip"`` (log, ``signals.task_skipped(sender=sender,
          task=..., reason="lock_held")``, a :class:`Skipped` result) or ``"retry"``:
          ``raise retry(held, countdown)``, the countdown being the holder's
          remaining lease (database time) plus jitter.
        - ``unique(grant)``: the steps run instead of the body step alone (a
          unique task's claim, :class:`~coordination.contrib.unique.UniqueGate`).
        - Over a rate limit (the policy's or the decorator's ``rate``), after the
          grant and permits were taken and given back: ``defer(countdown,
          "rate_limited")`` with the limiter's countdown; without ``defer`` it
          waits that long here and asks again.
        """
        self._body = body
        plan = self._steps(
            on_busy=on_busy, retry=retry, superseded=superseded, sender=sender, defer=defer,
            unique=unique,
        )
        return cast(_T | Skipped, steps.drive(plan, self._do))

    def _do(self, step: steps.Step) -> Any:
        """The thread driver's step: each blocking call made here, on this thread."""
        match step:
            case steps.Call(func, args):
                return func(*args)
            case steps.Acquire(key, limit, record):
                return self._acquire_lease(key, limit, record)
            case steps.StartKeepAlive(lease, linked):
                return KeepAlive(lease, ttl=self.ttl, using=self.using, linked=linked).start()
            case steps.StopKeepAlive(keeper):
                keeper.stop()
            case steps.Release(lease):
                release_quietly(lease, using=self.using)
            case steps.Sleep(seconds):
                time.sleep(seconds)
            case steps.Body(grant):
                assert self._body is not None
                self._expose(grant)
                try:
                    if self.once_key is None:
                        return self._body()
                    self._in_once = True
                    try:
                        return run_once(self.once_key, self._body, using=self.using)
                    finally:
                        self._in_once = False
                finally:
                    self._unexpose(None, None, None)
        return None


class AsyncFencedExecution(_Machine):
    """:class:`FencedExecution` for an ``async def`` task body: the same steps,
    driven from the event loop.

    The grant comes from ``locks.aacquire``, an :class:`~coordination.keepalive.AsyncKeepAlive`
    task keeps the lease alive while the body is awaited, the grant is current
    for fenced writes (``current_grant()``, ``afenced_update``) in the body's
    context only, and the lease is released on every exit path, a cancellation
    included (the release completes on the app's thread pool even if the
    coroutine is cancelled again meanwhile). A release that fails is logged,
    never raised: the outcome is the body's.
    """

    async def run(
        self,
        body: Callable[[], Awaitable[_T]],
        *,
        on_busy: OnBusy = "raise",
        sender: Any = None,
        defer: Callable[..., Any] | None = None,
        unique: Callable[[Lease], steps.Steps[Any]] | None = None,
    ) -> _T | Skipped:
        """Await ``body`` under a new grant; ``on_busy`` is ``"raise"`` or ``"skip"``.

        The job policy applies as in :meth:`FencedExecution.run`, with the same
        logs and counts (``defer`` runs on the app's thread pool; without it a
        paused execution waits with ``asyncio.sleep``). The permit of a
        policy's ``max_running`` is kept alive beside the grant and released
        with it. No ``once``: a transaction cannot span the awaits of a body."""
        if self.once_key is not None:
            raise InvalidInput("once=True needs a synchronous body: a transaction cannot span awaits")
        plan = self._steps(
            on_busy=on_busy, retry=None, superseded=None, sender=sender, defer=defer, unique=unique
        )

        async def do(step: steps.Step) -> Any:
            """The asyncio driver's step: blocking calls on the app's threads."""
            match step:
                case steps.Call(func, args):
                    return await aio.run_sync(func, *args)
                case steps.Acquire(key, limit, record):
                    return await self._aacquire_lease(key, limit, record)
                case steps.StartKeepAlive(lease, linked):
                    return AsyncKeepAlive(lease, ttl=self.ttl, using=self.using, linked=linked).start()
                case steps.StopKeepAlive(keeper):
                    await keeper.stop()
                case steps.Release(lease):
                    await aio.run_to_completion(release_quietly, lease, using=self.using)
                case steps.Sleep(seconds):
                    await asyncio.sleep(seconds)
                case steps.Body(grant):
                    with locks.use_grant(grant):
                        return await body()
            return None

        return cast(_T | Skipped, await steps.adrive(plan, do))


_current_execution: contextvars.ContextVar[FencedExecution | None] = contextvars.ContextVar(
    "coordination_current_execution", default=None
)


def current_execution() -> FencedExecution | None:
    """The fenced execution whose body is running in this context, if any."""
    return _current_execution.get()
