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
  skips, ``max_running`` takes a fenced permit beside the key's lock, and
  ``ttl`` and ``on_busy`` overrides replace the decorator's.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import inspect
import logging
import os
import random
import socket
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, Literal, Required, TypedDict, TypeVar, Unpack, cast, get_args

from .. import aio, jobs, locks, signals
from ..conf import app_settings
from ..exceptions import InvalidInput, LeaseLost, LockHeld
from ..holders import task_holder
from ..keepalive import AsyncKeepAlive, KeepAlive
from ..leases import Lease
from ..logfields import LogFields
from ..models import HOLDER_MAX_LENGTH, JobOutcome, WhenPaused, validate_key
from ..semaphores import aacquire_permit, acquire_permit, permit_keys

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

#: A lock key template over the task's arguments (``"account:{account_id}"``) or a
#: callable taking the task's arguments and returning the key.
LockSpec = str | Callable[..., str]

OnBusy = Literal["retry", "skip", "raise"]

_T = TypeVar("_T")


def resolve_lock_key(
    spec: LockSpec, signature: Any, args: Sequence[Any], kwargs: Mapping[str, Any]
) -> str:
    """The lock key of one call: ``spec`` formatted with the call's bound arguments.

    ``signature`` is the task function's :class:`inspect.Signature`; defaults
    count, so ``"report:{day}"`` works when ``day`` has a default. Raises
    ``InvalidInput`` when the template names an argument the call lacks or the
    result is not a valid key.
    """
    if callable(spec):
        key = spec(*args, **kwargs)
    else:
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError as error:
            raise InvalidInput(f"cannot build lock key {spec!r}: {error}") from None
        bound.apply_defaults()
        arguments = dict(bound.arguments)
        for parameter in signature.parameters.values():
            # **kwargs of the task are usable by name in the template.
            if parameter.kind is parameter.VAR_KEYWORD:
                arguments.update(arguments.pop(parameter.name, {}))
        try:
            key = spec.format(**arguments)
        except (KeyError, IndexError, AttributeError) as error:
            raise InvalidInput(
                f"lock key template {spec!r} names {error}, which this call does not have"
            ) from None
    return validate_key(key)


def lock_key_for(
    spec: LockSpec, func: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any]
) -> str:
    """The lock key of calling ``func`` with ``args`` and ``kwargs`` (see resolve_lock_key)."""
    return resolve_lock_key(spec, _signature(func), args, kwargs)


@functools.cache
def _cached_signature(func: Callable[..., Any]) -> inspect.Signature:
    return inspect.signature(func)


def _signature(func: Callable[..., Any]) -> inspect.Signature:
    try:
        return _cached_signature(func)
    except TypeError:  # unhashable callables (bound methods are hashable)
        return inspect.signature(func)


def holder_name(task_name: str, task_id: str | None, attempt: int) -> str:
    """Who holds a task's lock: host, process, task and attempt, at most 200 characters.

    The task id alone is not a holder identity (retries and redeliveries share
    it); the attempt number and process tell the executions apart in the admin.
    """
    return task_holder(task_name, task_id, attempt, max_length=HOLDER_MAX_LENGTH)


class Skipped(dict[str, Any]):
    """The result of an execution that did not run its body: skipped or superseded.

    A dict (JSON-serialisable for any result backend) with ``coordination`` set to
    ``"skipped"``, ``reason`` (``"lock_held"``, ``"superseded"`` or ``"paused"``),
    ``key`` and ``detail``: never mistaken for a silent success. An execution
    deferred by a paused policy where the integration sends a new message
    (``django.tasks``) has ``coordination`` set to ``"deferred"``.
    """


def skipped(reason: str, key: str, detail: str) -> Skipped:
    return Skipped(coordination="skipped", reason=reason, key=key, detail=detail)


def deferred(key: str, detail: str) -> Skipped:
    return Skipped(coordination="deferred", reason="paused", key=key, detail=detail)




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


class _Execution:
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
                worker=f"{socket.gethostname()}:{os.getpid()}", permit=self.permit, using=self.using,
            )


class FencedExecution(_Execution):
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
    body runs, :func:`current_execution` returns this execution.
    """

    def __init__(self, key: str, **options: Unpack[_ExecutionOptions]) -> None:
        super().__init__(key, **options)
        self._keeper: KeepAlive | None = None
        self._permit_keeper: KeepAlive | None = None
        self._contexts: list[AbstractContextManager[Any]] = []
        self._running: contextvars.Token[FencedExecution | None] | None = None
        self._ended = False

    def acquire(self) -> Lease:
        """The execution's grant: of ``key`` itself, or with ``concurrency=N`` one
        of the N permits of the semaphore ``key`` (the lease of its slot's key,
        ``<key>@<slot>``, whose tokens fence the body's writes). ``LockHeld``
        when none is granted within ``wait``, either way."""
        if self.concurrency is None:
            grant = locks.acquire(
                self.key, holder=self.holder, ttl=self.ttl, wait=self.wait, using=self.using
            )
        else:
            grant = acquire_permit(
                self.key, limit=self.concurrency, holder=self.holder, ttl=self.ttl,
                wait=self.wait, using=self.using,
            )
        if self.max_running is not None and self.name is not None:
            # The key's lock first: a busy key then never holds a task permit,
            # even for a moment, that an execution of another key could use.
            if self.keepalive and self.wait > 0:
                # The wait for a permit may outlast the key's lease: keep it alive.
                self._keeper = KeepAlive(grant, ttl=self.ttl, using=self.using).start()
            try:
                self.permit = acquire_permit(
                    jobs.permit_name(self.name), limit=self.max_running, holder=self.holder,
                    ttl=self.ttl, wait=self.wait, using=self.using,
                )
            except BaseException:
                if self._keeper is not None:
                    self._keeper.stop()
                    self._keeper = None
                release_quietly(grant, using=self.using)
                raise
        self.grant = grant
        self._record()
        return grant

    def __enter__(self) -> Lease:
        grant = self.grant if self.grant is not None else self.acquire()
        if self.keepalive:
            if self._keeper is None:
                self._keeper = KeepAlive(grant, ttl=self.ttl, using=self.using).start()
            if self.permit is not None:
                # The permit's loss (revoked, or expired in a pause) marks the key's
                # grant lost too: the body's later fenced writes are refused.
                self._permit_keeper = KeepAlive(
                    self.permit, ttl=self.ttl, using=self.using, linked=grant
                ).start()
        context = locks.use_grant(grant)
        context.__enter__()
        self._contexts.append(context)
        self._running = _current_execution.set(self)
        return grant

    def __exit__(self, *exc_info: Any) -> None:
        try:
            if self._running is not None:
                _current_execution.reset(self._running)
                self._running = None
            while self._contexts:
                self._contexts.pop().__exit__(*exc_info)
        finally:
            self.end()

    def end(self) -> None:
        """End this execution's lease, once: stop the keep-alive, then release the
        grant's own lease (never a newer holder's), never raising.

        Called on exit, and by a Celery ``retry()`` before the retry message is
        sent, so the retry never finds the lock held by the execution that sent it.
        """
        if self._ended or self.grant is None:
            return
        self._ended = True
        # The keep-alive stops first, so it cannot renew (and fail on) a released lease.
        if self._keeper is not None:
            self._keeper.stop()
        if self._permit_keeper is not None:
            self._permit_keeper.stop()
        release_quietly(self.grant, using=self.using)
        if self.permit is not None:
            release_quietly(self.permit, using=self.using)

    def run(
        self,
        body: Callable[[], _T],
        *,
        on_busy: OnBusy = "raise",
        retry: Callable[[LockHeld, float], Any] | None = None,
        superseded: Callable[[], Skipped | None] | None = None,
        sender: Any = None,
        defer: Callable[[float], Any] | None = None,
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
        """
        on_busy = self._read_policy(on_busy)
        waited = False
        while self.policy is not None and self.policy.paused:
            if self.policy.when_paused == WhenPaused.SKIP:
                return self._skip_paused(sender)
            if not waited:
                logger.info("task deferred %s", LogFields(task=self.label, detail=self._paused_detail()))
                self._tally(JobOutcome.DEFERRED)
            if defer is not None:
                return cast(_T | Skipped, defer(self.policy.defer_seconds))
            # No way to send the execution again: it waits in this worker.
            waited = True
            time.sleep(self._pause_poll())
            on_busy = self._read_policy(on_busy)
        if superseded is not None and (passed := superseded()) is not None:
            self._tally(JobOutcome.SKIPPED)
            return passed
        try:
            self.acquire()
        except LockHeld as held:
            return self._busy(held, on_busy, retry, sender)
        with self:
            if superseded is not None and (passed := superseded()) is not None:
                self._tally(JobOutcome.SKIPPED)
                return passed
            return body()

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


class AsyncFencedExecution(_Execution):
    """:class:`FencedExecution` for an ``async def`` task body: the same rules,
    on the event loop.

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
        defer: Callable[[float], Any] | None = None,
    ) -> _T | Skipped:
        """Await ``body`` under a new grant; ``on_busy`` is ``"raise"`` or ``"skip"``.

        The job policy applies as in :meth:`FencedExecution.run` (``defer`` runs
        on the app's thread pool; without it a paused execution waits with
        ``asyncio.sleep``). The permit of a policy's ``max_running`` is kept
        alive beside the grant and released with it."""
        on_busy = await aio.run_sync(self._read_policy, on_busy)
        waited = False
        while self.policy is not None and self.policy.paused:
            if self.policy.when_paused == WhenPaused.SKIP:
                return await aio.run_sync(self._skip_paused, sender)
            if not waited:
                await aio.run_sync(self._tally, JobOutcome.DEFERRED)
            if defer is not None:
                return cast(_T | Skipped, await aio.run_sync(defer, self.policy.defer_seconds))
            waited = True
            await asyncio.sleep(self._pause_poll())
            on_busy = await aio.run_sync(self._read_policy, on_busy)
        try:
            if self.concurrency is None:
                self.grant = grant = await locks.aacquire(
                    self.key, holder=self.holder, ttl=self.ttl, wait=self.wait, using=self.using
                )
            else:
                self.grant = grant = await aacquire_permit(
                    self.key, limit=self.concurrency, holder=self.holder, ttl=self.ttl,
                    wait=self.wait, using=self.using,
                )
            if self.max_running is not None and self.name is not None:
                # The wait for a permit may outlast the key's lease: keep it alive.
                waiting = (
                    AsyncKeepAlive(grant, ttl=self.ttl, using=self.using).start()
                    if self.keepalive and self.wait > 0 else None
                )
                try:
                    try:
                        self.permit = await aacquire_permit(
                            jobs.permit_name(self.name), limit=self.max_running,
                            holder=self.holder, ttl=self.ttl, wait=self.wait, using=self.using,
                        )
                    finally:
                        if waiting is not None:
                            await waiting.stop()
                except BaseException:
                    await aio.run_to_completion(release_quietly, grant, using=self.using)
                    raise
        except LockHeld as held:
            if on_busy == "skip":
                return await aio.run_sync(self._skip_busy, held, sender)
            raise
        await aio.run_sync(self._record)
        leases = [grant] if self.permit is None else [grant, self.permit]
        keepers = [
            AsyncKeepAlive(lease, ttl=self.ttl, using=self.using).start() for lease in leases
        ] if self.keepalive else []
        try:
            with locks.use_grant(grant):
                return await body()
        finally:
            try:
                for keeper in keepers:
                    await keeper.stop()
            finally:
                for lease in leases:
                    await aio.run_to_completion(release_quietly, lease, using=self.using)


_current_execution: contextvars.ContextVar[FencedExecution | None] = contextvars.ContextVar(
    "coordination_current_execution", default=None
)


def current_execution() -> FencedExecution | None:
    """The fenced execution whose body is running in this context, if any."""
    return _current_execution.get()


def retry_countdown(held: LockHeld) -> float:
    """Seconds before retrying a busy lock: the holder's own remaining lease
    (database time), plus jitter so that tasks waiting for the same key do not
    all come back at once."""
    return held.retry_after + random.uniform(0.05, 0.05 + min(1.0, 0.25 * held.retry_after))


def release_quietly(grant: Lease, *, using: str | None = None) -> None:
    """Release ``grant``'s own lease, never a newer holder's, and never raise.

    A task's outcome is its body's: a lease that ran out or a database that is
    down at release time is logged, and the lease expires on its own.
    """
    try:
        locks.release(grant, using=using)
    except LeaseLost as lost:
        logger.warning(
            "task ran past its lease, its fenced writes were still checked %s",
            LogFields(key=grant.key, token=grant.token, detail=lost.detail),
        )
    except Exception:
        logger.exception(
            "could not release, the lease will expire %s",
            LogFields(key=grant.key, token=grant.token, expires_at=grant.expires_at.isoformat()),
        )


def validate_on_busy(on_busy: object, choices: Sequence[str] = get_args(OnBusy)) -> OnBusy:
    """``on_busy`` if it is one of ``choices``, else ``InvalidInput``."""
    if on_busy not in choices:
        raise InvalidInput(f"on_busy must be one of {', '.join(map(repr, choices))}, not {on_busy!r}")
    return cast(OnBusy, on_busy)
