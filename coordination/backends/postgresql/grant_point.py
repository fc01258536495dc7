"""The grant points on PostgreSQL: the ORM transaction with LISTEN/NOTIFY
wake-ups, and the one-function-call grant point over it."""

from __future__ import annotations

import datetime as dt
import logging
import time
from collections.abc import Collection
from contextlib import suppress
from typing import Any
from weakref import WeakKeyDictionary

from django.core.exceptions import ImproperlyConfigured
from django.db import DatabaseError, ProgrammingError
from django.db.backends.base.base import BaseDatabaseWrapper

from ...conf import app_settings
from ...exceptions import LeaseLost, TokenExhausted
from ...leases import Lease
from ...models import MAX_TOKEN, GrantEnd, hash_lease_id
from ..base import (
    WAKE_UP_CHANNEL,
    Acquired,
    Ended,
    ExecutionRecord,
    IdleBound,
    Listener,
    LockSnapshot,
    TakenOver,
    format_sql,
    grant_refusal,
    lease_refusal,
    never_granted,
    new_lease_id,
    refuse_in_caller_transaction,
)
from ..orm import OrmGrantPoint
from .calls import DIRECT, PreparedCalls
from .functions import (
    _LOST_PREPARED,
    _UNPREPARED,
    ACQUIRE,
    ACQUIRE_RECORDED,
    FAILOVER_GUARD_FUNCTION,
    FAILOVER_MARGIN,
    FLOOR_EXHAUSTED,
    IDLE,
    LISTEN,
    NOTIFY,
    RECORD_REFUSED,
    RELEASE,
    UNDEFINED_FUNCTION,
    WAKE_ME,
    _sqlstate,
)

logger = logging.getLogger("coordination.locks")



class _PgListener:
    """A LISTENing connection of a waiter's own (psycopg, autocommit)."""

    def __init__(self, connection: Any) -> None:
        self._connection = connection

    def wait(self, keys: Collection[str], timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            for note in self._connection.notifies(timeout=left, stop_after=1):
                if note.payload in keys:
                    return True
        return False

    def close(self) -> None:
        with suppress(Exception):
            self._connection.close()


class PostgreSQLOrmGrantPoint(OrmGrantPoint):
    """The ORM transaction on PostgreSQL, with LISTEN/NOTIFY wake-ups.

    ``COORDINATION["GRANT_POINT"] = "orm"``: for databases where the app may not
    create functions. Eight statements per acquire (BEGIN to COMMIT) and six per
    release, instead of one call each.
    """

    name = "orm"

    def __init__(self, alias: str, dialect: IdleBound) -> None:
        super().__init__(alias, dialect)
        # One psycopg cursor per Django connection (per thread), for the
        # statements below; dropped with the connection object.
        self._cursors: WeakKeyDictionary[BaseDatabaseWrapper, Any] = WeakKeyDictionary()

    def execute(self, template: str, params: dict[str, object] | tuple[object, ...]) -> Any:
        """Run one of this module's statements and return its first row (or None).

        The one executor of the grant point's SQL. With
        ``COORDINATION["PREPARED_STATEMENTS"]`` True (the default) a statement is
        prepared on its second execution on a connection, and from then on the
        server neither parses nor plans it again: the parse and plan of a
        function call cost the server about as much as the call's own work (a
        short-lived connection that runs each statement once prepares nothing,
        and pays no extra round trip). None prepares as the connection does
        (Django's ``OPTIONS["prepare_threshold"]``), False never.

        A transaction-pooling proxy that cannot keep prepared statements
        (PgBouncer before 1.21 in transaction mode, or with
        ``max_prepared_statements = 0``) answers that a prepared statement does
        not exist, or already exists: the statement was then not run (the error
        comes before it executes), so outside a transaction it is run again
        unprepared; the connection prepares nothing more, and a warning says
        to set the setting to False. Inside a caller's transaction the error
        aborts that transaction and is raised.
        """
        connection = self.connection
        sql = format_sql(template, connection)
        with connection.wrap_database_errors:
            cursor = self._cursor(connection)
            raw = cursor.connection
            prepare = app_settings.PREPARED_STATEMENTS
            if prepare is None:
                prepare = raw.prepare_threshold is not None
            if not prepare or raw in _UNPREPARED:
                cursor.execute(sql, params, prepare=False)
                return cursor.fetchone()
            try:
                if DIRECT and type(params) is tuple:
                    return PreparedCalls.of(cursor).run(sql, params)
                self._execute_preparing(cursor, sql, params)
            except Exception as error:
                # Outside a transaction the refused statement left the session idle.
                if _sqlstate(error) not in _LOST_PREPARED or raw.info.transaction_status != IDLE:
                    raise
                _UNPREPARED.add(raw)
                logger.warning(
                    "the server lost the grant point's prepared statement (%s): a "
                    "transaction-pooling proxy? This connection prepares no more; set "
                    "COORDINATION['PREPARED_STATEMENTS'] = False for database %r",
                    error, self.alias,
                )
                cursor.execute(sql, params, prepare=False)
            return cursor.fetchone()

    @staticmethod
    def _execute_preparing(cursor: Any, sql: str, params: Any) -> None:
        """Execute, preparing the statement from its second execution on this
        connection (psycopg counts executions per statement while the
        connection's threshold is set; every other statement of the connection
        keeps the connection's own threshold)."""
        raw = cursor.connection
        threshold, raw.prepare_threshold = raw.prepare_threshold, 1
        try:
            cursor.execute(sql, params)
        finally:
            raw.prepare_threshold = threshold

    def _cursor(self, connection: BaseDatabaseWrapper) -> Any:
        """A psycopg cursor of the connection's own (server-side binding, unlike
        Django's cursors), kept until the connection is replaced.

        Its timestamps load as the same aware UTC datetimes Django's do. Django
        loads ``timestamptz`` with a Python loader that sets the tzinfo Django
        uses (a few microseconds per value, and a loader object per column per
        statement); when that is UTC and the session's time zone is UTC too,
        psycopg's own loader (in C) returns equal values with the same
        ``timezone.utc``, so this cursor uses it. Any other zone keeps Django's.
        """
        import psycopg

        raw = connection.connection
        if raw is None:
            connection.ensure_connection()
            raw = connection.connection
        cursor = self._cursors.get(connection)
        if cursor is None or cursor.connection is not raw:
            cursor = psycopg.Cursor(raw)
            if connection.timezone is dt.UTC and raw.info.timezone is dt.UTC:
                from psycopg.types.datetime import TimestamptzLoader

                # The cursor's own copy of the adapters: the connection's stay Django's.
                cursor.adapters.register_loader("timestamptz", TimestamptzLoader)
            self._cursors[connection] = cursor
        return cursor

    # --- wake-ups: LISTEN/NOTIFY -------------------------------------------------

    def listen(self) -> Listener | None:
        if not app_settings.WAKE_UPS:
            return None
        import psycopg

        params = self.connection.get_connection_params()
        for django_only in ("cursor_factory", "context", "server_side_binding"):
            params.pop(django_only, None)
        try:
            listening = psycopg.connect(**params, autocommit=True)
            listening.execute(LISTEN)
        except Exception as error:
            logger.warning("cannot LISTEN for wake-ups, polling instead: %s", error)
            return None
        return _PgListener(listening)

    def ask_to_wake(self, key: str, seconds: float) -> bool:
        if not app_settings.WAKE_UPS:
            return False
        return self.execute(WAKE_ME, {"key": key, "seconds": seconds}) is not None

    def wake(self, key: str) -> None:
        if app_settings.WAKE_UPS:
            self.execute(NOTIFY, (WAKE_UP_CHANNEL, key))


class PostgreSQLGrantPoint(PostgreSQLOrmGrantPoint):
    """The default on PostgreSQL: acquire and release are one function call each."""

    name = "postgresql"

    def call(self, template: str, params: tuple[object, ...]) -> Any:
        """One call of a grant-point function; a missing function says what to do."""
        try:
            return self.execute(template, params)
        except DatabaseError as error:
            if _sqlstate(error) == FLOOR_EXHAUSTED:
                raise TokenExhausted(
                    f"the token floor was raised to the largest 64-bit token: {error}; "
                    "tokens never wrap"
                ) from error
            if not isinstance(error, ProgrammingError) or _sqlstate(error) != UNDEFINED_FUNCTION:
                raise
            raise ImproperlyConfigured(
                f"the grant point's functions are missing in database {self.alias!r} ({error}). "
                "Run migrate; if the app may not create functions there, set "
                "COORDINATION['GRANT_POINT'] = 'orm'."
            ) from error

    def guard_promotion(self) -> None:
        self.call(f"SELECT {FAILOVER_GUARD_FUNCTION}(%s, %s)", (FAILOVER_MARGIN, MAX_TOKEN))

    def acquire(
        self, key: str, holder: str, ttl: float, lock_delay: float, ticket: int | None
    ) -> Acquired:
        # One autocommit call: the function's statement is the grant's own transaction.
        refuse_in_caller_transaction(self.connection)
        return self.grant_in_transaction(key, holder, ttl, lock_delay, ticket)

    def acquire_recorded(
        self, key: str, holder: str, ttl: float, lock_delay: float, ticket: int | None,
        record: ExecutionRecord,
    ) -> Acquired:
        # The record in the grant's own statement: no round trip, no commit of its own.
        refuse_in_caller_transaction(self.connection)
        try:
            return self._grant(key, holder, ttl, lock_delay, ticket, record)
        except DatabaseError as error:
            if (_sqlstate(error) or "")[:2] not in RECORD_REFUSED:
                raise
        # The statement refused the record (its table or a privilege missing, a
        # value it does not take) and rolled back: nothing was granted. The grant
        # alone, then the record as the other backends write it, logged if refused.
        return super().acquire_recorded(key, holder, ttl, lock_delay, ticket, record)

    def grant_in_transaction(
        self, key: str, holder: str, ttl: float, lock_delay: float, ticket: int | None
    ) -> Acquired:
        return self._grant(key, holder, ttl, lock_delay, ticket, None)

    def _grant(
        self, key: str, holder: str, ttl: float, lock_delay: float, ticket: int | None,
        record: ExecutionRecord | None,
    ) -> Acquired:
        lease_id = new_lease_id()
        lease_hash = hash_lease_id(lease_id)
        # Without a ticket every live ticket of the key is ahead: no barging past
        # fair waiters.
        place = MAX_TOKEN if ticket is None else ticket
        params: tuple[object, ...] = (key, holder, lease_hash, ttl, lock_delay, place, MAX_TOKEN)
        statement = ACQUIRE
        if record is not None:
            statement = ACQUIRE_RECORDED
            params = (*params, record.task, record.task_id, record.attempt, record.worker, key)
        while True:
            (
                granted, _lock_id, token, current_holder, acquired_at, expires_at, now,
                current_delay, delay_until, ahead, _grant_id, prev_token, prev_holder,
                prev_acquired_at, prev_expires_at, floor,
            ) = self.call(statement, params)
            if granted:
                break
            # Why: held, lock-delay, the queue, or out of tokens. If none of these
            # holds any more (freed since the upsert), try again.
            refusal = grant_refusal(
                LockSnapshot(
                    key, token or 0, current_holder or "", "", expires_at,
                    current_delay or 0.0, delay_until,
                ),
                now, ahead, floor,
            )
            if refusal is not None:
                raise refusal
        lease = Lease(
            key=key, token=token, lease_id=lease_id, holder=holder,
            acquired_at=acquired_at, expires_at=expires_at,
        )
        taken_over = (
            None if prev_expires_at is None
            else TakenOver(prev_token, prev_holder, prev_acquired_at, prev_expires_at)
        )
        return Acquired(lease, taken_over)

    def release_exclusive(self, grant: Lease) -> Ended:
        refuse_in_caller_transaction(self.connection)
        released, now, ended_at, end_reason, lock_id, token, holder, lease_hash, expires_at = (
            self.call(RELEASE, (
                grant.key, grant.token, hash_lease_id(grant.lease_id),
                bool(app_settings.WAKE_UPS), WAKE_UP_CHANNEL,
            ))
        )
        if not released:
            # Not the current lease: say precisely why, as the ORM path does.
            if lock_id is None:
                raise never_granted(grant.key)
            snapshot = LockSnapshot(grant.key, token, holder, lease_hash, expires_at, 0.0, None)
            raise lease_refusal(snapshot, grant, now) or LeaseLost(
                f"lease of {grant.key!r} token {grant.token} is not current"
            )
        if end_reason == GrantEnd.EXPIRED:
            return Ended(GrantEnd.EXPIRED, ended_at, ended_at)
        return Ended(GrantEnd.RELEASED, ended_at or now, None)


