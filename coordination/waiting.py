"""Waiting for a grant: the one wait loop of every acquire, sync and async.

``locks.acquire``, ``locks.acquire_many``, ``shared.acquire_shared`` and
``semaphores.acquire_permit`` differ only in their attempt (one call of the
grant point that grants or raises ``LockHeld``). What happens between attempts
is written once, in :func:`grant_loop`: the first attempt runs at once (free at
once is the common case: no wake-up connection, no ticket); a refusal ends the
call when it may not wait, else opens the wait (:class:`Waiter`: a wake-up
connection where the backend announces releases, a ticket in the fair queue),
pauses (:class:`Pace`) and tries again until granted or ``wait`` is over.

The loop is a generator stepped by a driver, as kazoo writes each recipe once
over a handler: :func:`wait_for_grant` steps it on this thread, inside
:func:`grant_point_call` (a dropped connection is ``GrantPointUnavailable``),
sleeping on the waiter's wake-up connection; :func:`await_grant` steps it from
a coroutine, running each attempt on the app's threads and sleeping with
``asyncio.sleep`` (async waiters poll).

Also here, because every kind of acquire shares them: the checks of a grant's
timings (:func:`grant_timings`) and the announcement of a grant (its log line
and signals, :func:`announce_grant`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import re
import time
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from concurrent.futures import Future
from contextlib import contextmanager, nullcontext, suppress
from typing import Any, NamedTuple, TypeVar, cast

from django.db import DatabaseError, InterfaceError, InternalError, OperationalError, connections
from django.db.migrations.loader import MigrationLoader

from . import aio, signals
from .backends import dialect_of
from .backends.base import Acquired, GrantPoint, Listener, in_caller_transaction
from .conf import app_settings
from .exceptions import GrantPointUnavailable, InvalidInput, LeaseLost, LockHeld, NotMigrated
from .leases import Lease
from .logfields import LogFields
from .models import Grant

__all__ = [
    "Attempt",
    "Pace",
    "Pause",
    "Waiter",
    "announce_grant",
    "await_grant",
    "grant_loop",
    "grant_point_call",
    "grant_timings",
    "validate_seconds",
    "validate_ttl",
    "wait_for_grant",
]

# The lines of a grant, its wait and its wake-ups are the grant point's own.
logger = logging.getLogger("coordination.locks")

_R = TypeVar("_R")


# --- the loop -------------------------------------------------------------------


class Attempt(NamedTuple):
    """Step of :func:`grant_loop`: run one attempt with ``ticket`` (the caller's
    place in the fair queue, or None) and send back its grant or its ``LockHeld``."""

    ticket: int | None


class Pause(NamedTuple):
    """Step of :func:`grant_loop`: sleep ``seconds`` (woken early where the
    waiter listens), then step on."""

    seconds: float


def grant_loop(wait: float, waiter: Waiter | None) -> Generator[Attempt | Pause, Any, Any]:
    """The wait loop, once for every acquire: yields what to do next and returns
    the grant; raises the last ``LockHeld`` once ``wait`` seconds have passed
    (at once if ``wait`` is 0). ``waiter`` (None: plain polling, the async
    driver's) is entered at the first refusal and left however the loop ends,
    its ticket consumed by the grant."""
    started = time.monotonic()
    # Free at once is the common case: no wake-up connection, no ticket.
    outcome = yield Attempt(None)
    if not isinstance(outcome, LockHeld):
        return outcome
    if wait <= 0:
        raise outcome
    pace = Pace(wait, since=started)
    with waiter if waiter is not None else nullcontext():
        while isinstance(outcome, LockHeld):
            woken = waiter is not None and waiter.woken_by_notify
            yield Pause(pace.pause(outcome, woken=woken))
            outcome = yield Attempt(None if waiter is None else waiter.ticket)
        if waiter is not None:
            waiter.ticket = None  # consumed by the grant
        return outcome


def wait_for_grant(
    attempt: Callable[[int | None], _R],
    *,
    wait: float,
    waiter: Waiter,
    key: str,
    using: str | None,
) -> _R:
    """Step :func:`grant_loop` on this thread until ``attempt`` grants: the sync
    driver of every waiting acquire. Runs inside :func:`grant_point_call`, so a
    dropped connection during any attempt, the wait's own queries included,
    raises ``GrantPointUnavailable`` (``key`` names the call in it)."""
    with grant_point_call("acquire", key, using):
        loop = grant_loop(wait, waiter)
        try:
            step = next(loop)
            while True:
                if isinstance(step, Pause):
                    waiter.sleep(step.seconds)
                    step = next(loop)
                    continue
                try:
                    outcome: object = attempt(step.ticket)
                except LockHeld as held:
                    outcome = held
                step = loop.send(outcome)
        except StopIteration as done:
            return cast(_R, done.value)
        finally:
            loop.close()  # an error mid-wait leaves the queue and closes the wake-ups


class Pace:
    """When a caller that waits for a grant tries again: back-off with jitter from
    POLL_INTERVAL up to MAX_POLL_INTERVAL, never past the holder's remaining lease
    (``retry_after``) nor past the caller's ``wait``."""

    def __init__(self, wait: float, *, since: float | None = None) -> None:
        self.deadline = (time.monotonic() if since is None else since) + wait
        self.backoff = float(app_settings.POLL_INTERVAL)
        self.ceiling = float(app_settings.MAX_POLL_INTERVAL)

    def pause(self, refusal: LockHeld, *, woken: bool = False) -> float:
        """Seconds to sleep before the next attempt; raises ``refusal`` once the
        wait is over. ``woken``: a release or revoke notified the waiter, so it
        sleeps to the lease's end (the ceiling a safety net for a lost
        notification) instead of backing off."""
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise refusal
        if woken:
            return max(min(refusal.retry_after + 0.002, remaining, self.ceiling), 0.001)
        # Until the lease ends or the back-off step, whichever is first; jitter
        # spreads contending waiters.
        pause = min(self.backoff * random.uniform(0.5, 1.0), refusal.retry_after + 0.002, remaining)
        self.backoff = min(self.backoff * 2, self.ceiling)
        return max(pause, 0.001)


# --- wake-ups and the fair queue -------------------------------------------------


class Waiter:
    """A waiting acquire: its wake-up connection and its fair-queue ticket.

    Where the backend announces releases (PostgreSQL LISTEN/NOTIFY), the waiter
    listens on a connection of its own, opened before its next attempt, so
    that a release committed after an attempt has read the lock always wakes
    it (announcements queue on the connection until read). A wake-up is only
    a hint to try again: the grant point decides. Nothing is opened until the
    waiter is entered.
    """

    def __init__(
        self,
        backend: GrantPoint,
        key: str,
        holder: str,
        *,
        fair: bool,
        wait: float = 0.0,
        wake_keys: Sequence[str] | None = None,
    ) -> None:
        self.backend, self.key, self.holder, self.fair = backend, key, holder, fair
        # ``key`` names the queue the ticket is taken in (and the announcement a
        # leaving or granted waiter makes); ``wake_keys`` the locks whose
        # releases wake this waiter: the key itself for one lock, every slot for
        # a permit (whose queue, ``key``, has no lock row), every key of a set.
        self.wake_keys = tuple(wake_keys) if wake_keys is not None else (key,)
        self.announced = frozenset((*self.wake_keys, key))
        self.alias = backend.alias
        self.wait = wait
        self.ticket: int | None = None
        self.listening: Listener | None = None
        self.registered = False
        self._wake_until = 0.0
        self._heartbeat_at = 0.0

    @property
    def woken_by_notify(self) -> bool:
        return self.listening is not None and self.registered

    def __enter__(self) -> Waiter:
        self._wake_until = time.monotonic() + self.wait
        self.listening = self.backend.listen()
        if self.listening is not None:
            self._register()
        if self.fair:
            self._take_ticket()
        return self

    def _register(self) -> None:
        """Ask releases of the key to announce themselves until this waiter gives
        up (and a second more). Until it has (no lock row yet), the waiter polls."""
        seconds = max(self._wake_until - time.monotonic(), 0.0) + 1.0
        try:
            # Ask on every lock row (a list: no short cut). A key with no row yet
            # was never granted, so it is free: whatever refuses this waiter is
            # another key's lease (or the queue), whose end or announcement wakes
            # it; a missed hint costs at most the lease's end or MAX_POLL_INTERVAL.
            asked = [self.backend.ask_to_wake(key, seconds) for key in self.wake_keys]
            self.registered = any(asked)
        except Exception as error:
            logger.warning("cannot ask for wake-ups, polling instead: %s", error)
            self.registered = False

    def __exit__(self, *exc_info: object) -> None:
        if self.listening is not None:
            self.listening.close()
        if self.ticket is not None:
            # Gave up (or failed): leave the queue at once, and let the next
            # waiter know it may be first now.
            with suppress(Exception):
                self.backend.leave_queue(self.key, self.ticket)

    def sleep(self, pause: float) -> None:
        if self.fair:
            # Keep the ticket alive: wake up in time to renew it.
            pause = min(pause, float(app_settings.TICKET_TTL) / 3)
        if self.listening is not None and self.registered:
            self._wait_for_wake_up(pause)
        else:
            time.sleep(pause)
            if self.listening is not None:
                self._register()  # before the next attempt, so its release announces
        if self.fair and time.monotonic() >= self._heartbeat_at:
            self._heartbeat()

    def _wait_for_wake_up(self, pause: float) -> None:
        assert self.listening is not None
        try:
            self.listening.wait(self.announced, pause)
        except Exception as error:
            # The hint is lost, not the lock: poll from here on.
            logger.warning("wake-up connection lost, polling instead: %s", error)
            self.listening.close()
            self.listening = None

    def _take_ticket(self) -> None:
        self.ticket = self.backend.take_ticket(self.key, self.holder)
        self._heartbeat_at = time.monotonic() + float(app_settings.TICKET_TTL) / 3

    def _heartbeat(self) -> None:
        assert self.ticket is not None
        if not self.backend.keep_ticket(self.ticket):
            # Expired and removed by nobody, or deleted: queue again, at the back.
            self._take_ticket()
        self._heartbeat_at = time.monotonic() + float(app_settings.TICKET_TTL) / 3


# --- the call around it ------------------------------------------------------------


@contextmanager
def grant_point_call(action: str, key: str, using: str | None) -> Iterator[None]:
    """Turn a lost database connection into ``GrantPointUnavailable`` (outcome
    unknown) and close the connection, so the next call connects again: with a
    multi-host URL, to whichever server accepts writes now (a new primary)."""
    try:
        yield
    except DatabaseError as error:
        alias = using or app_settings.DATABASE
        connection = connections[alias]
        if (
            _MISSING_OBJECT.search(str(error)) and not in_caller_transaction(connection)
            and (missing := _unapplied_migrations(alias))
        ):
            raise NotMigrated(
                f"the {action} of {key!r} failed on the grant point's database ({alias!r}), "
                f"which lacks {len(missing)} of coordination's migrations (the latest missing: "
                f"{missing[-1]}): run python manage.py migrate"
                + ("" if alias == "default" else f" --database {alias}")
                + f". Nothing was granted, renewed or released. The database said: {error}",
                action=action, key=key,
            ) from error
        if not isinstance(error, (OperationalError, InterfaceError, InternalError)):
            raise  # 25P03 (idle in transaction) is an InternalError
        if connection.in_atomic_block or not dialect_of(connection).connection_lost(connection, error):
            raise  # the caller's transaction owns the connection; or a statement's own error
        with suppress(Exception):
            connection.close()
        raise GrantPointUnavailable(
            f"the grant point's database ({alias!r}) failed during the {action} of {key!r}; "
            f"the outcome is unknown: {error}".strip()
            + (" No lease was returned: do not act as the holder; retry the acquire."
               if action == "acquire" else " Treat the lease as possibly lost."),
            action=action, key=key,
        ) from error


# What each database says of a table, column, function or procedure it lacks; only
# then are the migrations read (never on the path of a grant, a refusal or a
# lost connection).
_MISSING_OBJECT = re.compile(
    r"no such (table|column|function)|does not exist|doesn't exist|unknown column", re.IGNORECASE
)


def _unapplied_migrations(alias: str) -> list[str]:
    """The app's migrations not applied on ``alias``, in order, read only after a
    grant point call failed: a site that forgot ``migrate`` (or upgraded without
    it) gets an answer naming the fix, not a missing table's error or a retry.
    Empty when the database cannot tell (a lost connection: the caller's own
    handling applies)."""
    try:
        loader = MigrationLoader(connections[alias], ignore_no_migrations=True)
        leaf = loader.graph.leaf_nodes("coordination")[-1]
        return [
            name for app, name in loader.graph.forwards_plan(leaf)
            if app == "coordination" and (app, name) not in loader.applied_migrations
        ]
    except Exception:  # the database cannot tell: not this error's cause
        return []


# --- what every acquire shares -----------------------------------------------------


def announce_grant(acquired: Acquired, holder: str, waited: float, **fields: Any) -> Lease:
    """Log a grant at DEBUG (``fields`` added to the line) and send its signals:
    ``lock_expired`` first when it took over a lease that had run out, then
    ``lock_acquired``. Returns the lease."""
    lease, taken_over = acquired
    # DEBUG: a line per grant costs a busy grant point a fifth of its throughput at
    # INFO; refusals, losses and revocations are the lines an operator acts on.
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug(
            "lock acquired %s",
            LogFields(
                key=lease.key, token=lease.token, holder=holder, **fields,
                expires_at=lease.expires_at.isoformat(),
            ),
        )
    if taken_over is not None:
        signals.lock_expired.send(sender=Grant, key=lease.key, **taken_over._asdict())
    signals.lock_acquired.send(sender=Grant, grant=lease, waited=waited)
    return lease


def grant_timings(
    ttl: object, wait: object, lock_delay: object
) -> tuple[float, float, float]:
    """A grant's (ttl, wait, lock_delay) in seconds, defaults filled in from the
    settings; ``InvalidInput`` for any out of its bounds."""
    return (
        validate_ttl(app_settings.DEFAULT_TTL if ttl is None else ttl),
        validate_seconds(wait, "wait", upper=float(app_settings.MAX_WAIT)),
        validate_seconds(
            app_settings.LOCK_DELAY if lock_delay is None else lock_delay,
            "lock_delay", upper=float(app_settings.MAX_TTL),
        ),
    )


def validate_ttl(ttl: object) -> float:
    return validate_seconds(
        ttl,
        "ttl",
        lower=float(app_settings.MIN_TTL),
        upper=float(app_settings.MAX_TTL),
    )


def validate_seconds(
    value: object, name: str, *, lower: float = 0.0, upper: float
) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidInput(f"{name} must be a number of seconds, not {type(value).__name__}")
    seconds = float(value)
    if not math.isfinite(seconds):
        raise InvalidInput(f"{name} must be a finite number of seconds")
    if seconds < lower or seconds > upper or (name == "ttl" and seconds <= 0):
        raise InvalidInput(f"{name} must be between {lower:g} and {upper:g} seconds, not {seconds:g}")
    return seconds


# --- waiting for a grant --------------------------------------------------------


async def await_grant(
    attempt: Callable[[], _R], *, wait: float, release: Callable[[Lease], object]
) -> _R:
    """The async driver of the wait loop (:func:`coordination.grant_loop`):
    run ``attempt`` (one grant, ``wait=0``, inside the grant point's call
    wrapper) on the app's threads until it is not refused with ``LockHeld`` or
    ``wait`` seconds pass, sleeping between attempts with ``asyncio.sleep``
    (polling: back-off with jitter, up to the holder's remaining lease),
    holding no thread while it waits.

    Cancelled while an attempt runs, the attempt still completes on its thread
    (a database call cannot be interrupted half way), and the lease (or dict
    of leases) it granted is handed to ``release`` there at once: never left
    held. Cancelled before a thread took the attempt, nothing runs.
    """
    wait = validate_seconds(wait, "wait", upper=float(app_settings.MAX_WAIT))
    loop = grant_loop(wait, None)
    try:
        step = next(loop)
        while True:
            if isinstance(step, Pause):
                await asyncio.sleep(step.seconds)
                step = next(loop)
                continue
            try:
                outcome: object = await _attempt(attempt, release)
            except LockHeld as held:
                outcome = held
            step = loop.send(outcome)
    except StopIteration as done:
        return cast(_R, done.value)
    finally:
        loop.close()


async def _attempt(attempt: Callable[[], _R], release: Callable[[Lease], object]) -> _R:
    running = aio.submit(attempt)
    try:
        return await asyncio.shield(asyncio.wrap_future(running))
    except asyncio.CancelledError:
        # Not started: it never will. Started (or even done, if the cancellation
        # arrived as it finished): what it grants goes back at once.
        if not running.cancel():
            running.add_done_callback(lambda done: _give_back(done, release))
        raise


# The grant point's own lines: a grant given back is the grant's story.
_grants_logger = logging.getLogger("coordination.locks")


def _give_back(attempt: Future[Any], release: Callable[[Lease], object]) -> None:
    if attempt.cancelled() or attempt.exception() is not None:
        return
    granted = attempt.result()
    _grants_logger.info("a grant made for a cancelled coroutine is given back: %r", granted)
    leases = list(granted.values()) if isinstance(granted, Mapping) else [granted]
    try:
        aio.submit(_release_quietly, leases, release)
    except RuntimeError:  # the pool was closed meanwhile: the lease(s) expire on their own
        _grants_logger.warning(
            "could not give back %r, granted to a cancelled coroutine; it expires", granted
        )


def _release_quietly(leases: list[Lease], release: Callable[[Lease], object]) -> None:
    for lease in leases:
        try:
            release(lease)
        except LeaseLost:
            pass
        except Exception:
            _grants_logger.exception(
                "could not release; the lease will expire %s",
                LogFields(key=lease.key, token=lease.token, expires_at=lease.expires_at.isoformat()),
            )
