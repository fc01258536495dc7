"""Keeping a lease alive: one schedule, stepped from a thread or from an asyncio task.

The schedule and its failure rules are written once (:class:`Renewals`):

- Schedule. The keep-alive knows, by its process's monotonic clock, an instant
  before which the lease is certainly live by the database's clock (its
  *deadline*): a renewal whose call started at local time ``t`` moves the
  expiry to the database's ``now + ttl``, read after ``t``, so the lease lasts
  at least until ``t + ttl``. The first deadline comes from a read of the
  database clock. Each renewal is due a third of ``ttl`` after the previous one
  *started*, so a slow or late renewal moves the next one earlier instead of
  letting the delays add up.
- Failures. ``LeaseLost`` from ``renew()`` (the lease expired by the database's
  clock, was revoked or taken over) is final: ``renew()`` has marked the grant
  lost and sent ``signals.lock_lost``. Any other error (the database
  unreachable, a connection reset) is retried while the deadline is ahead; the
  database itself refuses a renewal that arrives after the lease expired by
  its clock. Once the deadline passes without a renewal, the lease may have
  expired: the grant is marked lost (later fenced writes are refused) and
  ``signals.lock_lost`` is sent.

The schedule is a generator of steps (read the clock, renew, wait until);
:class:`KeepAlive` steps it on a thread of its own, :class:`AsyncKeepAlive`
from an asyncio task whose calls run on the app's threads (:mod:`coordination.aio`).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import heapq
import logging
import os
import threading
import time
from collections.abc import Callable, Generator
from concurrent.futures import Future
from contextlib import suppress
from typing import Any, ClassVar, NamedTuple, ParamSpec, TypeVar

from django.db import connections

from . import aio, renewal, signals
from .conf import app_settings
from .exceptions import LeaseLost
from .leases import Lease
from .logfields import LogFields
from .models import Grant

__all__ = ["AsyncKeepAlive", "KeepAlive", "Renewals"]

_P = ParamSpec("_P")
_R = TypeVar("_R")


class _ReadClock(NamedTuple):
    """Step: read the database clock; send back the time or the error."""


class _Renew(NamedTuple):
    """Step: renew the lease for ``ttl``; send back None or the error."""


class _WaitUntil(NamedTuple):
    """Step: wait until ``due`` (monotonic), or end the keep-alive if it is stopped."""

    due: float


_Step = _ReadClock | _Renew | _WaitUntil


class Renewals:
    """The keep-alive's schedule and failure rules (the module's), for one lease.

    ``linked``: a lease marked lost together with ``grant`` (an execution's
    key grant, for the keep-alive of its policy permit): work that needs both
    stops writing once either is lost.
    """

    logger: ClassVar[logging.Logger]

    def __init__(
        self, grant: Lease, *, ttl: float, using: str | None = None, linked: Lease | None = None
    ) -> None:
        self.grant = grant
        self.linked = linked
        self.ttl = float(ttl)
        self.interval = self.ttl / 3
        self.using = using
        #: Successful renewals, failed attempts that were retried, and the
        #: longest renew() call in seconds: for logs, tests and tuning.
        self.renewals = 0
        self.retries = 0
        self.slowest_renewal = 0.0
        # Until the clock is read: the grant was acquired just before (the
        # keep-alive starts right after the acquire), so its lease is assumed
        # to run from now.
        self._deadline = time.monotonic() + max(
            0.0, (grant.expires_at - grant.acquired_at).total_seconds()
        )

    def _schedule(self) -> Generator[_Step, dt.datetime | BaseException | None, None]:
        started = time.monotonic()
        now = yield _ReadClock()
        if isinstance(now, dt.datetime):
            # Bound the lease by the clock that decides it.
            left = (self.grant.expires_at - now).total_seconds()
            self._deadline = min(self._deadline, started + left)
        else:
            self.logger.warning(
                "keep-alive could not read the database clock %s",
                LogFields(key=self.grant.key, token=self.grant.token, error=now),
            )
        next_due = self._deadline - self.ttl + self.interval
        while True:
            yield _WaitUntil(next_due)
            started = time.monotonic()
            if started >= self._deadline:
                self._lose(TimeoutError(
                    f"no renewal succeeded within the {self.ttl:g} s lease; it may have expired"
                ))
                return
            error = yield _Renew()
            if isinstance(error, LeaseLost):
                # renew() marked the grant lost and sent lock_lost.
                if self.linked is not None:
                    self.linked.mark_lost()
                return
            if isinstance(error, BaseException):
                left = self._deadline - time.monotonic()
                if left <= 0:
                    self._lose(error)
                    return
                # A transient failure: retry while the lease is certainly live,
                # a few times before the deadline.
                self.retries += 1
                self.logger.warning(
                    "lease renewal failed, retrying %s",
                    LogFields(
                        key=self.grant.key, token=self.grant.token, error=error,
                        lease_left=f"{left:.2f}s",
                    ),
                )
                next_due = time.monotonic() + min(self.interval / 4, max(left / 3, 0.01))
                continue
            took = time.monotonic() - started
            self._deadline = started + self.ttl
            self.renewals += 1
            self.slowest_renewal = max(self.slowest_renewal, took)
            if took > self.interval:
                self.logger.warning(
                    "lease renewal slow %s",
                    LogFields(
                        key=self.grant.key, token=self.grant.token, took=f"{took:.2f}s",
                        ttl=f"{self.ttl:g}s",
                    ),
                )
            next_due = started + self.interval

    def _lose(self, error: BaseException) -> None:
        self.grant.mark_lost()
        if self.linked is not None:
            self.linked.mark_lost()
        self.logger.warning(
            "lease renewal failed, the grant is marked lost %s",
            LogFields(key=self.grant.key, token=self.grant.token, error=error),
        )
        signals.lock_lost.send(sender=Grant, grant=self.grant, error=error)


class KeepAlive(Renewals):
    """Keep ``grant``'s lease alive from a thread of its own until :meth:`stop`.

    The schedule and failure rules are the module's. The first read of the
    database clock comes half way to the first renewal (a sixth of ``ttl``
    after the start), which also opens the thread's connection well before
    that renewal is due; a body that ends sooner (most task bodies) costs no
    connection and no thread at all: until then the keep-alive only waits in
    the process's one shared starter thread, which starts the keep-alive's
    own thread at that point if :meth:`stop` has not been called. A failed
    call is retried on a fresh connection.

    Limits. A renewal needs this process to run Python: a task body inside
    one long C call that holds the GIL (``sum(range(10**9))``, some C
    extensions) stops the keep-alive until the call returns, and the lease
    is lost after ``ttl``. A renewal call stuck in the database driver is
    only judged when it returns. The lease survives any stall shorter than
    about two thirds of ``ttl``; docs/celery.md gives the shortest ``ttl``
    that is safe on a loaded machine.
    """

    logger = logging.getLogger("coordination.tasks")

    def __init__(
        self, grant: Lease, *, ttl: float, using: str | None = None, linked: Lease | None = None
    ) -> None:
        super().__init__(grant, ttl=ttl, using=using, linked=linked)
        self._stopping = threading.Event()
        # Made when it is started: most keep-alives never need one.
        self._thread: threading.Thread | None = None
        # Orders the starter's start of the thread against stop(): a keep-alive
        # stopped first never starts its thread; one started first is joined.
        self._start_lock = threading.Lock()

    def start(self) -> KeepAlive:
        """Schedule the keep-alive; its own thread starts half way to the first
        renewal (see the class's schedule), from the process's starter thread."""
        _starter().schedule(self, time.monotonic() + self.interval / 2)
        return self

    def stop(self) -> None:
        """Stop renewing; returns once a renewal in flight has finished (or ``ttl`` passed).

        A renewal stuck on an unreachable database must not hold up the task's
        exit: after ``ttl`` the lease is over anyway, and a renewal that lands
        after the release fails harmlessly.
        """
        with self._start_lock:
            self._stopping.set()
            thread = self._thread
        if thread is None:
            _starter().forget()
            return
        if thread.is_alive() and thread is not threading.current_thread():
            thread.join(max(self.ttl, 1.0))

    def _start_thread(self) -> None:
        """Called by the starter thread once the first renewal draws near: start
        renewing unless stop() came first. A thread that cannot be started
        (the process is out of threads) leaves the lease unrenewed: the grant
        is marked lost at once, so the body's later fenced writes are refused."""
        with self._start_lock:
            if self._stopping.is_set():
                return
            thread = threading.Thread(
                target=self._run, name=f"coordination-keepalive-{self.grant.key}#{self.grant.token}",
                daemon=True,
            )
            try:
                thread.start()
            except Exception as error:
                self._stopping.set()
                failed: BaseException | None = error
            else:
                self._thread = thread
                failed = None
        if failed is not None:
            self._lose(failed)

    def _run(self) -> None:
        """The thread driver of the schedule."""
        try:
            # Opening a connection costs a new server process, several times a
            # grant: only a body still running half way to the first renewal
            # pays it (the starter thread starts this one at that point).
            if self._stopping.is_set():
                return
            steps = self._schedule()
            try:
                step = next(steps)
                while True:
                    if isinstance(step, _WaitUntil):
                        if self._stopping.wait(max(0.0, step.due - time.monotonic())):
                            return
                        step = next(steps)
                        continue
                    outcome: dt.datetime | BaseException | None
                    try:
                        if isinstance(step, _ReadClock):
                            outcome = renewal.database_now(self.using)
                        else:
                            renewal.renew(self.grant, ttl=self.ttl, using=self.using)
                            outcome = None
                    except LeaseLost as lost:
                        outcome = lost
                    except Exception as error:
                        self._reset_connection()
                        outcome = error
                    step = steps.send(outcome)
            except StopIteration:
                return
            finally:
                steps.close()
        finally:
            connections.close_all()

    def _reset_connection(self) -> None:
        with suppress(Exception):  # a broken connection may fail to close
            connections[self.using or app_settings.DATABASE].close()


class AsyncKeepAlive(Renewals):
    """Keep ``grant``'s lease alive from an asyncio task until :meth:`stop`.

    The schedule and failure rules of :class:`KeepAlive` (the module's), the
    clock read at once; each call runs on the app's thread pool.

    Limit: the task runs on the event loop, so a coroutine that blocks the loop
    (CPU-bound work, a sync call without ``sync_to_async``) stops the renewals
    too; the lease survives a stall shorter than about two thirds of ``ttl``.
    """

    logger = logging.getLogger("coordination.locks")

    def __init__(
        self, grant: Lease, *, ttl: float, using: str | None = None, linked: Lease | None = None
    ) -> None:
        super().__init__(grant, ttl=ttl, using=using, linked=linked)
        self._task: asyncio.Task[None] | None = None
        self._inflight: Future[Any] | None = None

    def start(self) -> AsyncKeepAlive:
        """Start the renewing task on the running event loop."""
        self._task = asyncio.get_running_loop().create_task(
            self._run(), name=f"coordination-keepalive-{self.grant.key}#{self.grant.token}"
        )
        return self

    async def stop(self) -> None:
        """Stop renewing; returns once a renewal in flight has finished, so that it
        cannot land after the release that usually follows."""
        task, self._task = self._task, None
        if task is None:
            return
        task.cancel()
        await asyncio.wait({task})
        inflight = self._inflight
        if inflight is not None and not inflight.done():
            with suppress(Exception):
                await asyncio.shield(asyncio.wrap_future(inflight))

    async def _call(self, func: Callable[_P, _R], *args: _P.args, **kwargs: _P.kwargs) -> _R:
        self._inflight = aio.submit(func, *args, **kwargs)
        return await asyncio.wrap_future(self._inflight)

    async def _run(self) -> None:
        """The asyncio driver of the schedule (cancelled by :meth:`stop`)."""
        steps = self._schedule()
        try:
            step = next(steps)
            while True:
                if isinstance(step, _WaitUntil):
                    await asyncio.sleep(max(0.0, step.due - time.monotonic()))
                    step = next(steps)
                    continue
                outcome: dt.datetime | BaseException | None
                try:
                    if isinstance(step, _ReadClock):
                        outcome = await self._call(renewal.database_now, self.using)
                    else:
                        await self._call(renewal.renew, self.grant, ttl=self.ttl, using=self.using)
                        outcome = None
                except Exception as error:
                    outcome = error
                step = steps.send(outcome)
        except StopIteration:
            return
        finally:
            steps.close()


# --- the starter thread of KeepAlive ------------------------------------------------


class _Starter:
    """The process's one thread that starts keep-alive threads when they are due.

    Most task bodies end long before their lease needs its first renewal; a
    thread of their own would cost them its start and join on every execution
    (about 0.3 ms on an idle machine, several on a loaded one), in the task's
    own latency. Scheduled keep-alives wait here instead, in a heap by due
    time, and only those still running at their due time get a thread. A
    stopped keep-alive stays in the heap until its due time (it is skipped
    then) unless enough of them pile up to rebuild the heap without them.
    """

    def __init__(self) -> None:
        self.pid = os.getpid()
        self._wake = threading.Condition(threading.Lock())
        self._due: list[tuple[float, int, KeepAlive]] = []
        self._count = 0
        self._forgotten = 0
        self._thread = threading.Thread(
            target=self._run, name="coordination-keepalive-starter", daemon=True
        )
        self._thread.start()

    def schedule(self, keeper: KeepAlive, due: float) -> None:
        with self._wake:
            self._count += 1
            heapq.heappush(self._due, (due, self._count, keeper))
            if self._due[0][2] is keeper:
                self._wake.notify()

    def forget(self) -> None:
        """A scheduled keep-alive was stopped before its thread started."""
        with self._wake:
            self._forgotten += 1
            if self._forgotten > 64 and 2 * self._forgotten > len(self._due):
                self._due = [entry for entry in self._due if not entry[2]._stopping.is_set()]
                heapq.heapify(self._due)
                self._forgotten = 0

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._due or self._due[0][0] > time.monotonic():
                    self._wake.wait(self._due[0][0] - time.monotonic() if self._due else None)
                _due, _count, keeper = heapq.heappop(self._due)
                if keeper._stopping.is_set():
                    self._forgotten = max(0, self._forgotten - 1)
                    continue
            try:
                keeper._start_thread()
            except Exception:  # never let one keep-alive stop the starter
                KeepAlive.logger.exception("keep-alive could not be started")


_starter_lock = threading.Lock()
_the_starter: _Starter | None = None


def _starter() -> _Starter:
    """This process's starter thread, made on first use (again in a forked child,
    which inherits the object but not the thread)."""
    global _the_starter
    starter = _the_starter
    if starter is not None and starter.pid == os.getpid():
        return starter
    with _starter_lock:
        if _the_starter is None or _the_starter.pid != os.getpid():
            _the_starter = _Starter()
        return _the_starter


def _forget_starter_in_child() -> None:
    # A child forked while another thread held the lock would wait on it forever.
    global _the_starter, _starter_lock
    _the_starter = None
    _starter_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_starter_in_child)
