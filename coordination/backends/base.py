"""What a grant point does, and the rules every grant point shares.

A grant point is the one place that decides who holds a lock and issues its
tokens (rule 3 of docs/rules.md). :class:`GrantPoint` names what each backend
must do: one attempt to acquire, renew, release, revoke, read the database
clock, and the hooks that wake waiting acquires. Written once here, for every
backend:

- the grant rule (:func:`grant_refusal`): when a lock is grantable, and the
  ``LockHeld`` or ``TokenExhausted`` that says why not; and the token it issues
  (:func:`next_token`: one above the key's counter and the token floor);
- the lease rule (:func:`lease_refusal`): when a lease is still its lock's
  current one, and the ``LeaseLost`` that says why not;
- the check for "inside the caller's transaction" (:func:`in_caller_transaction`);
- the formatting of the app's SQL with its quoted table names (:func:`format_sql`).
"""

from __future__ import annotations

import abc
import datetime as dt
import logging
import secrets
from collections.abc import Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, ClassVar, NamedTuple, Protocol

from django.db import connections, models, transaction
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.models.sql import InsertQuery, Query

from ..conf import app_settings
from ..exceptions import InTransaction, LeaseLost, LockHeld, TokenExhausted
from ..leases import Lease
from ..logfields import LogFields
from ..models import (
    MAX_TOKEN,
    DatabaseNow,
    Execution,
    Grant,
    GrantMode,
    Lock,
    Ticket,
    TokenFloor,
    lease_matches,
)
from .outcomes import Acquired, Ended, ExecutionRecord, TakenOver
from .queue import FairQueue

__all__ = [
    "WAKE_UP_CHANNEL",
    "Acquired",
    "Ended",
    "ExecutionRecord",
    "GrantPoint",
    "IdleBound",
    "Listener",
    "LockSnapshot",
    "TakenOver",
    "format_sql",
    "grant_refusal",
    "in_caller_transaction",
    "lease_refusal",
    "new_lease_id",
    "next_token",
    "refuse_in_caller_transaction",
]

# The record of an execution is the tasks' bookkeeping: its failures are logged there.
logger = logging.getLogger("coordination.tasks")

WAKE_UP_CHANNEL = "coordination_lock"
"""PostgreSQL NOTIFY channel of releases and revocations; the payload is the key."""


# --- the grant rule and the lease rule ----------------------------------------------


class LockSnapshot(NamedTuple):
    """What the rules look at in a lock's row, read while the row lock is held."""

    key: str
    token: int
    holder: str
    lease_hash: str
    expires_at: dt.datetime | None
    lock_delay: float
    delay_until: dt.datetime | None

    @classmethod
    def of(cls, lock: Lock) -> LockSnapshot:
        return cls(
            lock.key, lock.token, lock.holder, lock.lease_hash, lock.expires_at,
            lock.lock_delay, lock.delay_until,
        )


def grant_refusal(
    lock: LockSnapshot, now: dt.datetime, ahead: int, floor: int
) -> LockHeld | TokenExhausted | None:
    """Why ``lock`` cannot be granted at database time ``now``, or None if it can.

    Grantable when all of these hold, and never otherwise:

    - no lease runs: the lock is free, or its lease expired (``expires_at <= now``);
    - no lock-delay runs: an expired lease's ``expires_at + lock_delay`` has
      passed, and a free lock's ``delay_until`` (set when a lease expired or
      was revoked) has passed;
    - no fair waiter's live ticket is ahead (``ahead`` is their count);
    - a token is left (rule 9 of docs/rules.md): neither the key's counter nor
      the token ``floor`` (:class:`~coordination.models.TokenFloor`) is at the
      largest 64-bit token, since the next token is above both (:func:`next_token`).

    A key never granted is a snapshot with token 0. The PostgreSQL function's
    ``WHERE`` is the SQL twin of this rule; a test checks that the two agree on a
    grid of lock states and floors.
    """
    key = lock.key
    if lock.holder:
        assert lock.expires_at is not None
        if lock.expires_at > now:
            return LockHeld(
                key, lock.holder, lock.expires_at, (lock.expires_at - now).total_seconds()
            )
        if lock.lock_delay:
            until = lock.expires_at + dt.timedelta(seconds=lock.lock_delay)
            if until > now:
                return LockHeld(
                    key, f"{lock.holder} (lock-delay after expiry)", until,
                    (until - now).total_seconds(),
                )
    elif lock.delay_until is not None and lock.delay_until > now:
        return LockHeld(
            key, "lock-delay after an expired or revoked lease", lock.delay_until,
            (lock.delay_until - now).total_seconds(),
        )
    if ahead:
        return LockHeld(
            key, f"{ahead} fair waiter(s) queued first", now, float(app_settings.POLL_INTERVAL)
        )
    if lock.token >= MAX_TOKEN:
        return TokenExhausted(
            f"lock {key!r} has issued token {lock.token}, the largest 64-bit token; "
            "tokens never wrap: retire this key"
        )
    if floor >= MAX_TOKEN:
        return TokenExhausted(
            f"the token floor is {floor}, the largest 64-bit token: no key can be issued a "
            f"token above it, {key!r} included; tokens never wrap"
        )
    return None


def next_token(lock: LockSnapshot, floor: int) -> int:
    """The token a grant of ``lock`` issues: above its counter and above the floor.

    A key never granted (counter 0) starts at ``floor + 1``; a counter below the
    floor (raised since by a restore guard) jumps over it. Call it only when
    :func:`grant_refusal` found the lock grantable.
    """
    return max(lock.token, floor) + 1


def is_current_lease(lock: LockSnapshot, grant: Lease) -> bool:
    """Whether ``grant`` is the lock's current lease (held or expired), by token and secret."""
    return (
        bool(lock.holder)
        and lock.token == grant.token
        and lease_matches(lock.lease_hash, grant.lease_id)
    )


def lease_refusal(lock: LockSnapshot, grant: Lease, now: dt.datetime) -> LeaseLost | None:
    """Why ``grant`` is not ``lock``'s live lease at database time ``now``, or None if it is."""
    if not lock.holder:
        return LeaseLost(
            f"lock {lock.key!r} is free: the lease of token {grant.token} was released "
            "or revoked"
        )
    if lock.token != grant.token:
        return LeaseLost(
            f"lock {lock.key!r} was taken over: token {lock.token} ({lock.holder}) is "
            f"current, not {grant.token}"
        )
    if not lease_matches(lock.lease_hash, grant.lease_id):
        return LeaseLost(f"lease_id does not match the lease of {lock.key!r} token {grant.token}")
    assert lock.expires_at is not None
    if lock.expires_at <= now:
        return LeaseLost(
            f"lease of {lock.key!r} token {grant.token} expired at "
            f"{lock.expires_at.isoformat()} (database time)"
        )
    return None


def never_granted(key: str) -> LeaseLost:
    return LeaseLost(f"lock {key!r} has never been granted")


def new_lease_id() -> str:
    """A fresh lease secret (256 random bits, URL-safe)."""
    return secrets.token_urlsafe(32)


# --- the caller's transaction -------------------------------------------------------


def in_caller_transaction(connection: BaseDatabaseWrapper) -> bool:
    """Whether ``connection`` is inside a transaction its caller opened.

    ``transaction.atomic()`` blocks count, and so does autocommit turned off by
    hand; the blocks a ``TestCase`` opens around each test do not (a test's
    grants and records stay inside the test's rollback).
    """
    if not connection.in_atomic_block:
        return not connection.get_autocommit()
    return any(not getattr(block, "_from_testcase", False) for block in connection.atomic_blocks)


def refuse_in_caller_transaction(connection: BaseDatabaseWrapper) -> None:
    """Raise ``InTransaction`` inside the caller's transaction.

    A grant must be durable when the grant point returns: inside an outer
    transaction a rollback would un-issue a token the caller may already have
    used, and the next acquire would issue it again (rule 3 of docs/rules.md).
    """
    if in_caller_transaction(connection):
        raise InTransaction()


# --- the app's SQL ----------------------------------------------------------------------

APP_TABLES: Mapping[str, type[models.Model]] = {
    "lock": Lock, "grant": Grant, "ticket": Ticket, "floor": TokenFloor, "execution": Execution,
}
_SQL_TEXT: dict[tuple[str, str], str] = {}


def format_sql(
    template: str,
    connection: BaseDatabaseWrapper,
    *,
    tables: Mapping[str, type[models.Model]] | None = None,
) -> str:
    """The app's SQL for ``connection``: ``{lock}``, ``{grant}``, ``{ticket}`` and
    ``{floor}`` replaced by the quoted names of their tables.

    ``tables`` maps those names to other models (a migration's historical
    ones); by default they are the app's own, and the text is kept per
    template and database vendor.
    """
    if tables is not None:
        return _format(template, connection, tables)
    cache_key = (template, connection.vendor)
    text = _SQL_TEXT.get(cache_key)
    if text is None:
        text = _SQL_TEXT[cache_key] = _format(template, connection, APP_TABLES)
    return text


def _format(
    template: str, connection: BaseDatabaseWrapper, tables: Mapping[str, type[models.Model]]
) -> str:
    quote = connection.ops.quote_name
    return template.format(**{name: quote(model._meta.db_table) for name, model in tables.items()})


# --- the backend ------------------------------------------------------------------------


class Listener(Protocol):
    """A waiter's wake-up connection (see :meth:`GrantPoint.listen`)."""

    def wait(self, keys: Collection[str], timeout: float) -> bool:
        """Block until a release or revocation of one of ``keys`` is announced
        (True) or ``timeout`` seconds pass (False). Raises if the connection is lost."""
        ...

    def close(self) -> None: ...


IDLE_BOUND = 5.0
"""Seconds a grant point's own transaction may wait for its client's next
statement, where the database bounds that (its statements follow each other
within milliseconds; only a paused or hung client waits that long)."""


class IdleBound(Protocol):
    """What a grant point asks of its database's dialect, which makes it and hands
    itself over (``Dialect.grant_point``): the bound on an idle transaction, and
    the insert of bookkeeping that need not wait for the disk."""

    def bound_idle_transaction(self, connection: BaseDatabaseWrapper, seconds: float) -> None:
        ...

    def insert_without_flush_wait(self, connection: BaseDatabaseWrapper, record: models.Model) -> None:
        ...


class GrantPoint(FairQueue):
    """A grant point on one database alias: the base class of the backends.

    Every method that changes a lock does it in one atomic state change of the
    lock's row, decided while its row lock is held and with the database clock
    read after that (rule 11 of docs/rules.md), in a transaction of its own
    that has committed when the method returns; inside the caller's
    transaction each raises ``InTransaction``. :func:`coordination.backends.get_backend`
    picks one backend per alias.
    """

    name: ClassVar[str]
    """The backend's name: ``"postgresql"`` (functions), ``"orm"`` or ``"sqlite"``."""

    def __init__(self, alias: str, dialect: IdleBound) -> None:
        self.alias = alias
        self.dialect = dialect
        """The hooks of this alias's database it was made by (its ``Dialect``)."""
        self._clock_expression = DatabaseNow()
        self._clock: tuple[str, list[Any]] | None = None

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name} on {self.alias!r}>"

    @property
    def connection(self) -> BaseDatabaseWrapper:
        """This thread's connection to the alias."""
        return connections[self.alias]

    # --- what each backend does -------------------------------------------------

    @abc.abstractmethod
    def acquire(
        self, key: str, holder: str, ttl: float, lock_delay: float, ticket: int | None
    ) -> Acquired:
        """One attempt to grant ``key`` to ``holder`` for ``ttl`` seconds.

        ``ticket`` is the caller's place in the key's fair queue, or None (then
        every live ticket of the key is ahead). A granted lease closes the expired
        lease it takes over, records the new grant and consumes the ticket.
        Raises the :func:`grant_refusal` of the lock when it is not grantable.
        """

    def acquire_recorded(
        self, key: str, holder: str, ttl: float, lock_delay: float, ticket: int | None,
        record: ExecutionRecord,
    ) -> Acquired:
        """:meth:`acquire` for a fenced execution, which also writes its ``record``
        under the grant: only with a grant, and never failing it. By default
        the record is written after the grant (:meth:`write_record`); a backend
        may write it in the grant's own transaction instead."""
        acquired = self.acquire(key, holder, ttl, lock_delay, ticket)
        self.write_record(record, acquired.lease)
        return acquired

    def write_record(
        self, record: ExecutionRecord, grant: Lease, permit: Lease | None = None,
        cap_permit: Lease | None = None,
    ) -> None:
        """Record that a fenced execution started under ``grant`` (and ``permit``,
        ``max_running``'s, and ``cap_permit``, the cap per key's):
        one INSERT, whose commit does not wait for its flush where the database
        allows (a crash may lose a record, never a grant). Never raises: a
        failure is logged, and the execution only goes unseen on the jobs page."""
        try:
            row = Execution(
                task=record.task, task_id=record.task_id, attempt=record.attempt,
                worker=record.worker, lock_key=grant.key, token=grant.token,
                permit_key=permit.key if permit is not None else "",
                permit_token=permit.token if permit is not None else None,
                cap_permit_key=cap_permit.key if cap_permit is not None else "",
                cap_permit_token=cap_permit.token if cap_permit is not None else None,
                ttl=(grant.expires_at - grant.acquired_at).total_seconds(),
            )
            self.dialect.insert_without_flush_wait(self.connection, row)
        except Exception as error:
            logger.warning(
                "execution not recorded %s",
                LogFields(task=record.task, key=grant.key, token=grant.token, error=error),
            )

    @abc.abstractmethod
    def grant_in_transaction(
        self, key: str, holder: str, ttl: float, lock_delay: float, ticket: int | None
    ) -> Acquired:
        """:meth:`acquire` without its transaction: the same grant, made in the
        transaction the grant point opened around it (:meth:`acquire_many`).

        Never call it in a transaction of the caller's: a rollback there would
        un-issue a token the caller may have used (rule 3 of docs/rules.md).
        """

    def acquire_many(
        self, keys: Sequence[str], holder: str, ttl: float, lock_delay: float
    ) -> list[Acquired]:
        """Grant every key of ``keys`` to ``holder``, or none: one transaction.

        The keys are granted one by one with the grant rule of each
        (:meth:`grant_in_transaction`, the code path of a single acquire), in
        sorted order, inside one transaction of the grant point's own: the first
        refusal rolls back the grants made before it (their tokens were never
        seen outside the transaction, so no token is issued twice) and is raised.
        Row locks are taken in the one order every caller uses, so two
        overlapping sets never wait for each other in a cycle; a refusal is
        decided at once (a held lease is not waited for inside the transaction),
        so the row locks are held only for the few statements of the grants.
        No fair-queue ticket: every live ticket of a key is ahead of this call.
        """
        ordered = sorted(set(keys))
        with self.transaction():
            # The promotion guard may lock the token floor's row: first, before any
            # lock row, as a single acquire takes it. Taken by the first key's
            # grant instead, after other sets' lock rows, two sets could deadlock.
            self.guard_promotion()
            return [
                self.grant_in_transaction(key, holder, ttl, lock_delay, None)
                for key in ordered
            ]

    def renew(self, grant: Lease, ttl: float) -> dt.datetime:
        """Move the live ``grant``'s end to ``ttl`` seconds from now; return the new end.

        A writer's lease is renewed by :meth:`renew_exclusive`, a reader's by
        :meth:`renew_shared`. Raises ``LeaseLost`` if it is not a live lease.
        """
        if grant.mode == GrantMode.SHARED:
            return self.renew_shared(grant, ttl)
        return self.renew_exclusive(grant, ttl)

    def release(self, grant: Lease) -> Ended:
        """End ``grant``, a writer's (:meth:`release_exclusive`) or a reader's
        (:meth:`release_shared`); never another holder's lease. Raises ``LeaseLost``
        if it is not a current lease (after ending it as expired, if it ran out)."""
        if grant.mode == GrantMode.SHARED:
            return self.release_shared(grant)
        return self.release_exclusive(grant)

    @abc.abstractmethod
    def renew_exclusive(self, grant: Lease, ttl: float) -> dt.datetime:
        """Move the live writer ``grant``'s end to ``ttl`` seconds from now; return the new end.

        Raises the :func:`lease_refusal` (``LeaseLost``) if it is not the live lease.
        """

    @abc.abstractmethod
    def release_exclusive(self, grant: Lease) -> Ended:
        """End the writer ``grant`` and free its lock; never a newer holder's lease.

        Raises ``LeaseLost`` if it is not the lock's current lease. A current
        lease that has expired is still ended (as expired) and its lock freed;
        :attr:`Ended.expired_at` then says when it ran out.
        """

    @abc.abstractmethod
    def revoke(self, key: str) -> Grant | None:
        """End the current lease of ``key`` (held or expired) as revoked and wake
        its waiters; for a key held by readers, every reader's lease. Returns the
        revoked Grant row (the newest reader's), or None if the lock was free."""

    # --- shared (read) leases -----------------------------------------------------
    #
    # Readers of a key share its lock row and its token counter with the writers
    # (coordination.backends.shared, mixed into every backend).

    @abc.abstractmethod
    def acquire_shared(
        self, key: str, holder: str, ttl: float, lock_delay: float, ticket: int | None = None
    ) -> Acquired:
        """One attempt to grant ``key`` to ``holder`` as one more reader, with the
        key's next token. ``ticket`` as for :meth:`acquire`. Raises the
        :func:`grant_refusal` of the lock (a writer holds it, its lock-delay runs,
        a fair waiter is ahead, no token left)."""

    @abc.abstractmethod
    def renew_shared(self, grant: Lease, ttl: float) -> dt.datetime:
        """:meth:`renew` of a reader's lease (and of its group's with it)."""

    @abc.abstractmethod
    def release_shared(self, grant: Lease) -> Ended:
        """:meth:`release` of a reader's lease; the last reader's frees the lock."""

    # --- the database clock ----------------------------------------------------

    def now(self) -> dt.datetime:
        """The database server's current time (aware, UTC): the only clock leases use.

        The SQL is :class:`~coordination.models.DatabaseNow` compiled for this
        database (``clock_timestamp()`` on PostgreSQL), converted as Django
        converts a ``DateTimeField``.
        """
        connection = self.connection
        expression = self._clock_expression
        if self._clock is None:
            sql, params = Query(None).get_compiler(connection=connection).compile(expression)
            self._clock = (f"SELECT {sql}", list(params))
        sql, params = self._clock
        with connection.cursor() as cursor:
            cursor.execute(sql, params)
            (value,) = cursor.fetchone()
        # This thread's connection converts (SQLite returns text).
        for converter in (
            connection.ops.get_db_converters(expression) + expression.get_db_converters(connection)
        ):
            value = converter(value, expression, connection)
        assert isinstance(value, dt.datetime)
        return value.astimezone(dt.UTC)

    def guard_promotion(self) -> None:
        """Inside a grant's transaction, before any row is locked: run the promotion
        guard where the backend has one (PostgreSQL's functions; see
        docs/high-availability.md), so grants made outside the acquire function
        (readers' shared grants) never reuse a token after a failover either."""
        return None  # no guard: SQLite, and the portable ORM grant point

    @contextmanager
    def transaction(self) -> Iterator[BaseDatabaseWrapper]:
        """A transaction of the grant point's own, committed when the block ends.

        It holds the lock row(s) it decides on. Where the database bounds it
        (:meth:`Dialect.bound_idle_transaction`, PostgreSQL) it may wait at most
        ``IDLE_BOUND`` seconds for the client's next statement: a client paused
        inside it (SIGSTOP, a GC or VM pause) has its session ended by the
        server, the transaction rolled back and the rows freed, instead of
        keeping the key ungrantable for everyone until it wakes. The paused
        client then gets ``GrantPointUnavailable`` from its call.
        """
        connection = self.connection
        refuse_in_caller_transaction(connection)
        with transaction.atomic(using=self.alias, durable=True):
            self.dialect.bound_idle_transaction(connection, IDLE_BOUND)
            yield connection

    # --- waking waiters ----------------------------------------------------------
    #
    # A waiting acquire retries when the lease it waits for ends, after a back-off
    # step, or when it is woken. Backends that can announce releases override
    # these; the others leave waiters to poll. A wake-up is only a hint to try
    # again: the grant point decides.

    def listen(self) -> Listener | None:
        """A connection of the waiter's own on which releases and revocations are
        announced, opened before its next attempt; None: the waiter polls."""
        return None

    def ask_to_wake(self, key: str, seconds: float) -> bool:
        """Ask releases of ``key`` to announce themselves for the next ``seconds``.
        False if they will not (no lock row yet, or no wake-ups here)."""
        return False

    def wake(self, key: str) -> None:
        """Announce that ``key`` may be grantable now (inside a transaction: at commit)."""
        return None  # nothing to announce on: waiters poll

    # --- records that survive the caller's rollback ---------------------------------

    def save_surviving_rollback(self, record: models.Model) -> None:
        """Save ``record`` so that the caller's rollback cannot erase it.

        Outside the caller's transaction it commits at once; inside one it is
        inserted through a second, short-lived connection in autocommit.
        """
        if in_caller_transaction(self.connection):
            _insert_on_own_connection(record, self.alias)
        else:
            record.save(using=self.alias)


def _insert_on_own_connection(record: models.Model, alias: str) -> None:
    """Insert ``record`` through a short-lived second connection, in autocommit.

    Refusals are rare, so a connection per record costs little and leaves no
    idle connection behind in worker threads.
    """
    own = connections.create_connection(alias)
    try:
        fields = [f for f in record._meta.concrete_fields if not f.primary_key]
        query = InsertQuery(type(record))
        query.insert_values(fields, [record])
        with own.cursor() as cursor:
            for sql, params in query.get_compiler(connection=own).as_sql():
                cursor.execute(sql, params)
    finally:
        own.close()
