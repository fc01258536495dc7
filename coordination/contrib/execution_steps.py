"""The steps of one fenced execution and the two drivers that run them.

:class:`~coordination.contrib.execution.FencedExecution` and
:class:`~coordination.contrib.execution.AsyncFencedExecution` share one
generator of steps (the policy's pause, the supersede check, the acquire, the
permit, keep-alive, the body, the release): it decides, a driver does, as
:mod:`coordination.keepalive` writes its schedule once. :func:`drive` steps it
on the calling thread, :func:`adrive` from a coroutine; a step's result is sent
back, its exception thrown in at the ``yield``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Generator
from typing import Any, NamedTuple, TypeVar, cast

from ..backends.outcomes import ExecutionRecord
from ..leases import Lease

__all__ = [
    "Acquire", "Body", "Call", "Release", "Sleep", "StartKeepAlive", "Step", "Steps", "StopKeepAlive",
    "adrive", "drive",
]

_R = TypeVar("_R")


class Call(NamedTuple):
    """Step: a blocking call (policy read, log and count, record, defer); send back its result."""

    func: Callable[..., Any]
    args: tuple[Any, ...] = ()


class Acquire(NamedTuple):
    """Step: acquire ``key`` (``limit`` None) or one of its ``limit`` permits; send back the lease.
    With ``record``, the execution's record is written with the grant of ``key``."""

    key: str
    limit: int | None
    record: ExecutionRecord | None = None


class StartKeepAlive(NamedTuple):
    """Step: start keeping ``lease`` alive (marking ``linked`` lost with it); send back the keeper."""

    lease: Lease
    linked: Lease | None = None


class StopKeepAlive(NamedTuple):
    """Step: stop ``keeper`` (started by a ``StartKeepAlive`` step)."""

    keeper: Any


class Release(NamedTuple):
    """Step: release ``lease``'s own lease, never raising, to completion even if cancelled."""

    lease: Lease


class Sleep(NamedTuple):
    """Step: wait ``seconds`` (a paused execution without a way to defer)."""

    seconds: float


class Body(NamedTuple):
    """Step: run (or await) the body with ``grant`` current; send back its result."""

    grant: Lease


Step = Call | Acquire | StartKeepAlive | StopKeepAlive | Release | Sleep | Body
Steps = Generator[Step, Any, _R]


def drive(steps: Steps[_R], do: Callable[[Step], Any]) -> _R:
    """Step ``steps`` on this thread: each step's result sent back, its error thrown in."""
    result: Any = None
    error: BaseException | None = None
    while True:
        try:
            step = steps.send(result) if error is None else steps.throw(error)
        except StopIteration as stop:
            return cast(_R, stop.value)
        finally:
            error = None
        try:
            result = do(step)
        except BaseException as failure:  # thrown into the steps, which decide
            result, error = None, failure


async def adrive(steps: Steps[_R], do: Callable[[Step], Awaitable[Any]]) -> _R:
    """Step ``steps`` from a coroutine, as :func:`drive` does on a thread."""
    result: Any = None
    error: BaseException | None = None
    while True:
        try:
            step = steps.send(result) if error is None else steps.throw(error)
        except StopIteration as stop:
            return cast(_R, stop.value)
        finally:
            error = None
        try:
            result = await do(step)
        except BaseException as failure:  # a cancellation too: the steps release
            result, error = None, failure
