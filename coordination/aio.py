"""Where async code's grant-point calls run: a bounded pool of threads of the app's own.

Django's ORM is synchronous, so ``aacquire``, ``arenew``, ``arelease``,
``afenced_update`` and ``afence`` run their synchronous twins on a thread and
await the result. Which threads is the decision this module makes
(docs/async.md measures it):

- ``sync_to_async(thread_sensitive=True)`` runs every call of a request on the
  request's one thread (Django's ASGI handler gives each request its own
  single-thread executor) and every call outside a request on one thread of
  the whole process: a grant point called by 500 coroutines outside requests
  queues behind one thread, and inside requests it opens one thread and one
  database connection per concurrent request, with no bound.
- ``sync_to_async(thread_sensitive=False)`` runs calls on the event loop's
  default executor, shared with everything else the process runs there, whose
  threads open connections that no ``request_finished`` ever closes.
- Here: a pool of at most ``COORDINATION["ASYNC_THREADS"]`` threads of the
  app's own. Each thread keeps its own connection and tidies it before and
  after every call the way Django does around a request
  (``close_if_unusable_or_obsolete``: ``CONN_MAX_AGE`` is obeyed, a broken
  connection is replaced), and closes it when the pool is closed. At most
  ``ASYNC_THREADS`` connections, however many coroutines call at once.

The pool never runs a call inside a transaction of the caller: its threads
open none, so the grant point commits every grant on its own (rule 3 of
docs/rules.md), as it does in sync code, where it refuses to run inside
``transaction.atomic()`` with ``InTransaction``.

A call handed to the pool always runs to its end, even when the awaiting
coroutine is cancelled meanwhile: a thread cannot be interrupted half way
through a database call. :func:`run_sync` lets a cancelled caller go at once
(the call finishes on its own); :func:`run_to_completion` runs a call that
must finish even if not yet started (a release), and lets the caller go at
once too. Neither ever blocks the event loop.
"""

from __future__ import annotations

import asyncio
import contextvars
import itertools
import logging
import os
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, ParamSpec, TypeVar

from django.core.signals import setting_changed
from django.db import connections
from django.dispatch import receiver

from .conf import app_settings

__all__ = [
    "GrantPointThreads", "close_threads", "run_sync", "run_to_completion", "submit",
    "threads",
]

logger = logging.getLogger("coordination.aio")

_P = ParamSpec("_P")
_R = TypeVar("_R")
_Work = tuple[Future[Any], Callable[[], Any]]


class GrantPointThreads:
    """At most ``size`` threads running synchronous calls for async callers.

    Threads start when calls arrive and no thread is idle, up to ``size``; each
    keeps its database connections between calls (as ``CONN_MAX_AGE`` allows)
    and closes them when :meth:`close` stops it.
    """

    def __init__(self, size: int) -> None:
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"COORDINATION['ASYNC_THREADS'] must be a positive integer, not {size!r}")
        self.size = size
        self._queue: queue.SimpleQueue[_Work | None] = queue.SimpleQueue()
        self._idle = threading.Semaphore(0)
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._numbers = itertools.count(1)
        self._closed = False
        self.pid = os.getpid()

    def submit(self, call: Callable[[], _R]) -> Future[_R]:
        """Queue ``call``; its future is done when a thread has run it."""
        future: Future[_R] = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("the grant point's async threads are closed")
            self._queue.put((future, call))
            if not self._idle.acquire(blocking=False) and len(self._threads) < self.size:
                thread = threading.Thread(
                    target=self._work, name=f"coordination-async-{next(self._numbers)}", daemon=True
                )
                thread.start()
                self._threads.append(thread)
        return future

    @property
    def started(self) -> int:
        """Threads started so far (at most ``size``)."""
        return len(self._threads)

    def close(self, timeout: float = 30.0) -> None:
        """Let the queued calls finish, then stop every thread, closing its connections."""
        with self._lock:
            self._closed = True
            threads, self._threads = self._threads, []
            for _ in threads:
                self._queue.put(None)
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join(timeout)

    def _work(self) -> None:
        try:
            while True:
                work = self._queue.get()
                if work is None:
                    return
                future, call = work
                if future.set_running_or_notify_cancel():
                    _tidy_connections()
                    try:
                        result = call()
                    except BaseException as error:
                        future.set_exception(error)
                    else:
                        future.set_result(result)
                    finally:
                        _tidy_connections()
                self._idle.release()
        finally:
            connections.close_all()


def _tidy_connections() -> None:
    """What Django does at a request's start and end: close a connection that is
    broken, left in a failed transaction state, or older than ``CONN_MAX_AGE``."""
    for connection in connections.all(initialized_only=True):
        connection.close_if_unusable_or_obsolete()


_pool: GrantPointThreads | None = None
_pool_lock = threading.Lock()


def threads() -> GrantPointThreads:
    """The process's pool, started on first use with ``COORDINATION["ASYNC_THREADS"]``."""
    global _pool
    pool = _pool
    # A forked child (a prefork worker) inherits the parent's pool but none of its threads.
    if pool is None or pool.pid != os.getpid():
        with _pool_lock:
            if _pool is None or _pool.pid != os.getpid():
                _pool = GrantPointThreads(app_settings.ASYNC_THREADS)
            pool = _pool
    return pool


def close_threads(timeout: float = 30.0) -> None:
    """Stop the pool and close its connections (at shutdown, or after a test);
    the next async call starts a new one."""
    global _pool
    with _pool_lock:
        pool, _pool = _pool, None
    if pool is not None:
        pool.close(timeout)


@receiver(setting_changed)
def _close_on_change(*, setting: str, **kwargs: Any) -> None:
    if setting in {"COORDINATION", "DATABASES"}:
        close_threads()


def submit(func: Callable[_P, _R], *args: _P.args, **kwargs: _P.kwargs) -> Future[_R]:
    """Queue ``func(*args, **kwargs)`` on the pool, in a copy of the caller's
    context (``current_grant()`` is the same in the thread); its future."""
    # The caller's context goes along: current_grant() is the same in the thread.
    context = contextvars.copy_context()
    return threads().submit(lambda: context.run(func, *args, **kwargs))


async def run_sync(func: Callable[_P, _R], *args: _P.args, **kwargs: _P.kwargs) -> _R:
    """Run ``func`` on the pool and await its result.

    If the caller is cancelled before a thread took the call, the call never
    runs; once it runs, it runs to its end and its result is dropped.
    """
    return await asyncio.wrap_future(submit(func, *args, **kwargs))


async def run_to_completion(
    func: Callable[_P, _R], *args: _P.args, **kwargs: _P.kwargs
) -> _R:
    """Run ``func`` on the pool; a cancelled caller leaves at once, and the call
    still runs to its end (a release must never be lost to a cancellation, nor
    make the cancelled coroutine wait)."""
    future = submit(func, *args, **kwargs)
    try:
        return await asyncio.shield(asyncio.wrap_future(future))
    except asyncio.CancelledError:
        future.add_done_callback(_log_failure(func))
        raise


def _log_failure(func: Callable[..., Any]) -> Callable[[Future[Any]], None]:
    def log(future: Future[Any]) -> None:
        error = future.exception()
        if error is not None:
            logger.warning("%s, finished after its caller was cancelled, failed: %s",
                           getattr(func, "__qualname__", func), error)

    return log
