"""The grant point on PostgreSQL: one PL/pgSQL function call per acquire and release.

``acquire()`` and ``release()`` each call one function (today's are those
:func:`install` creates; each migration that created them ran its own frozen
copy, :mod:`coordination.backends.postgresql_frozen`): one round trip, one
transaction (the call's own autocommit statement), and the plans of the
statements inside are cached by the server per connection, with no named
prepared statement a transaction-pooling proxy could lose. Renew and revoke
are the ORM transaction of :mod:`coordination.backends.orm`.

The acquire's upsert locks the key's row before it decides, and reads the
database clock after that; the token counter and the grant row commit
together (why this is safe: docs/operations.md). Its WHERE is the SQL twin of
:func:`coordination.backends.base.grant_refusal`, and its token is
:func:`~coordination.backends.base.next_token`'s.

Waiters are woken with LISTEN/NOTIFY, by both PostgreSQL backends (this one and
the ORM transaction chosen with ``COORDINATION["GRANT_POINT"] = "orm"``).
"""

from __future__ import annotations

import datetime as dt
import logging
import time
from collections.abc import Callable, Collection, Mapping
from contextlib import suppress
from typing import Any
from weakref import WeakKeyDictionary, WeakSet

from django.core.checks import CheckMessage
from django.core.exceptions import ImproperlyConfigured
from django.db import DatabaseError, ProgrammingError, connections, models, transaction
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.models import F, Model, QuerySet
from django.db.models.functions import Collate

from ..conf import app_settings
from ..exceptions import LeaseLost, TokenExhausted
from ..leases import Lease
from ..models import MAX_TOKEN, GrantEnd, hash_lease_id
from ..watermarks import (
    ALL_RULES,
    HIGHEST_STEP,
    KEPT,
    MUST_RISE,
    NOT_LOWERED,
    RESTORED,
    TOMBSTONES,
    Watermark,
    WatermarkTriggers,
    fingerprint,
    sql_literal,
)
from .base import (
    WAKE_UP_CHANNEL,
    Acquired,
    Ended,
    GrantPoint,
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
from .dialect import Dialect, Replication
from .orm import OrmGrantPoint
from .postgresql_calls import DIRECT, PreparedCalls
from .postgresql_frozen import MIGRATION_SQL

__all__ = [
    "ACQUIRE_FUNCTION",
    "DROP_FUNCTIONS",
    "FAILOVER_GUARD_FUNCTION",
    "FAILOVER_MARGIN",
    "RELEASE_FUNCTION",
    "PostgreSQLDialect",
    "PostgreSQLGrantPoint",
    "PostgreSQLOrmGrantPoint",
    "PostgreSQLWatermarkTriggers",
    "install",
    "install_for_models",
]

logger = logging.getLogger("coordination.locks")

ACQUIRE_FUNCTION = "coordination_acquire"
RELEASE_FUNCTION = "coordination_release"

# One row, granted or not. Granted: lock_id, token, acquired_at, expires_at,
# grant_id, and the lease this grant took over if it ran out without a
# release (prev_*). Refused: the lock's state, so the caller can say why
# without another round trip (lock_id is NULL for a key never granted). Both:
# the token floor the call read.
#
# The token is one above the key's counter and above the token floor (rule 8 of
# docs/rules.md; base.next_token): a key never granted starts at floor + 1.
# {read_floor} is how the floor is read (READ_FLOOR). It is read once, before the upsert, in the call's own
# statement snapshot: a floor committed before the call began is seen; and
# again, after the upsert, when the token is the one above that read (see the
# comment there: a prune raising the floor as it deletes the key's row).
CREATE_ACQUIRE_FUNCTION = """
CREATE OR REPLACE FUNCTION coordination_acquire(
    p_key text, p_holder text, p_hash text, p_ttl double precision,
    p_delay double precision, p_ticket bigint, p_max_token bigint,
    OUT granted boolean, OUT lock_id bigint, OUT token bigint, OUT holder text,
    OUT acquired_at timestamptz, OUT expires_at timestamptz, OUT now timestamptz,
    OUT lock_delay double precision, OUT delay_until timestamptz, OUT ahead bigint,
    OUT grant_id bigint, OUT prev_token bigint, OUT prev_holder text,
    OUT prev_acquired_at timestamptz, OUT prev_expires_at timestamptz,
    OUT token_floor bigint
) LANGUAGE plpgsql VOLATILE AS $fn$
DECLARE
    v_prev bigint;
    v_floor bigint;
BEGIN{guard}
    token_floor := {read_floor};
    -- Without a ticket (p_ticket = p_max_token) every live ticket of the key is
    -- ahead: nobody barges past fair waiters. A floor at the largest token
    -- leaves no token to issue: no row is proposed, so nothing is granted.
    INSERT INTO {lock} AS l (
        key, token, holder, lease_hash, acquired_at, expires_at, created_at, lock_delay
    )
    SELECT p_key, token_floor + 1, p_holder, p_hash, c.t, c.t + make_interval(secs => p_ttl),
        c.t, p_delay
    FROM (SELECT clock_timestamp() AS t) AS c
    WHERE token_floor < p_max_token AND NOT EXISTS (
        SELECT 1 FROM {ticket} AS q
        WHERE q.lock_key = p_key AND q.id < p_ticket AND q.expires_at > clock_timestamp()
    )
    ON CONFLICT (key) DO UPDATE SET
        token = GREATEST(l.token, token_floor) + 1, holder = EXCLUDED.holder,
        lease_hash = EXCLUDED.lease_hash,
        (acquired_at, expires_at) = (
            SELECT c.t, c.t + make_interval(secs => p_ttl)
            FROM (SELECT clock_timestamp() AS t) AS c
        ),
        lock_delay = EXCLUDED.lock_delay, delay_until = NULL
    -- The grant rule (base.grant_refusal): free with no lock-delay running, or
    -- expired with its lock-delay over; below the largest token (the floor is,
    -- or no row was proposed).
    WHERE (
            (l.holder = '' AND (l.delay_until IS NULL OR l.delay_until <= clock_timestamp()))
            OR l.expires_at + make_interval(secs => l.lock_delay) <= clock_timestamp()
        )
        AND l.token < p_max_token
    RETURNING l.id, l.token, l.acquired_at, l.expires_at
    INTO lock_id, token, acquired_at, expires_at;

    IF NOT FOUND THEN
        granted := false;
        SELECT l.id, l.token, l.holder, l.expires_at, clock_timestamp(), l.lock_delay,
            l.delay_until,
            (SELECT count(*) FROM {ticket} AS q
             WHERE q.lock_key = p_key AND q.id < p_ticket AND q.expires_at > clock_timestamp())
        INTO lock_id, token, holder, expires_at, now, lock_delay, delay_until, ahead
        FROM (SELECT 1) AS one LEFT JOIN {lock} AS l ON l.key = p_key;
        RETURN;
    END IF;

    granted := true;
    -- A token just one above the floor read before the upsert (a key's first
    -- row, or a counter below the floor): read the floor again. A prune
    -- (coordination.pruning) deletes a key's row in the transaction that raises
    -- the floor above its counter; an upsert that found the row gone committed
    -- after that transaction did, so this later statement sees the raised floor
    -- and the token goes above it, never back to a token the key had.
    IF token = token_floor + 1 THEN
        v_floor := {read_floor};
        IF v_floor >= token THEN
            IF v_floor >= p_max_token THEN
                RAISE EXCEPTION 'the token floor is %, the largest token: no token is left for %',
                    v_floor, p_key USING ERRCODE = 'CF001';
            END IF;
            token := v_floor + 1;
            token_floor := v_floor;
            UPDATE {lock} AS l SET token = coordination_acquire.token
            WHERE l.id = coordination_acquire.lock_id;
        END IF;
    END IF;
    -- The key's previous token: token - 1, unless this grant rose to the floor
    -- (token = floor + 1): then it is the key's last grant at or below the
    -- floor, if it has one (the lookup runs only for such grants).
    IF token - 1 > token_floor THEN
        v_prev := token - 1;
    ELSIF token > 1 THEN
        SELECT max(g.token) INTO v_prev FROM {grant} AS g
        WHERE g.lock_id = coordination_acquire.lock_id;
    END IF;
    IF v_prev IS NOT NULL THEN
        -- Only the current lease's grant is ever open. If the previous one still
        -- is, its lease ran out without a release: close it as expired.
        UPDATE {grant} AS g SET ended_at = g.expires_at, end_reason = 'expired'
        WHERE g.lock_id = coordination_acquire.lock_id
            AND g.token = v_prev AND g.ended_at IS NULL
        RETURNING g.token, g.holder, g.acquired_at, g.expires_at
        INTO prev_token, prev_holder, prev_acquired_at, prev_expires_at;
    END IF;
    INSERT INTO {grant} (lock_id, token, holder, lease_hash, acquired_at, expires_at, end_reason)
    VALUES (lock_id, token, p_holder, p_hash, acquired_at, expires_at, '')
    RETURNING id INTO grant_id;
    IF p_ticket < p_max_token THEN
        DELETE FROM {ticket} AS q WHERE q.id = p_ticket;
    END IF;
END
$fn$
"""

# The promotion guard (migration 0012; docs/high-availability.md). With
# asynchronous replication a promoted replica may have missed the last grants of
# the old primary: the same tokens would be issued again. PostgreSQL gives every
# promotion a new timeline, and the grant point records in the token floor's row
# the timeline it last granted on. The first grant on a new timeline, before it
# issues anything, raises the floor past every token the old primary can have
# issued, revokes every lease and closes every Fence row's watermark at the new
# floor, all in the grant's own transaction, holding the floor's row lock, so
# concurrent first grants do it once (the others wait, then find the timeline
# recorded and the raised floor committed).
#
# FAILOVER_MARGIN bounds the grants an old primary can have committed that the
# promoted replica never received (the bound and why it holds:
# docs/high-availability.md). The current timeline is read from the name of the
# WAL file being written (CURRENT_TIMELINE_SQL): one shared-memory read per grant.
FAILOVER_GUARD_FUNCTION = "coordination_failover_guard"
FAILOVER_MARGIN = 1_000_000_000
CREATE_FAILOVER_GUARD_FUNCTION = """
CREATE OR REPLACE FUNCTION coordination_failover_guard(p_margin bigint, p_max_token bigint)
RETURNS void LANGUAGE plpgsql VOLATILE AS $fn$
DECLARE
    v_timeline integer;
    v_recorded integer;
    v_floor bigint;
    v_top bigint;
    v_now timestamptz;
    v_revoked bigint;
BEGIN
    v_timeline := ('x' || left(pg_walfile_name(pg_current_wal_lsn()), 8))::bit(32)::integer;
    SELECT f.timeline INTO v_recorded FROM {floor} AS f WHERE f.id = 1;
    IF NOT FOUND OR v_recorded = v_timeline THEN
        RETURN;
    END IF;
    -- A new timeline (or none recorded yet): decide again under the row lock.
    SELECT f.timeline, f.token INTO v_recorded, v_floor FROM {floor} AS f
    WHERE f.id = 1 FOR UPDATE;
    IF v_recorded = v_timeline THEN
        RETURN;  -- another first grant did it and committed
    END IF;
    IF v_recorded IS NULL THEN
        -- Nothing recorded since the row was made: no grant to have missed.
        UPDATE {floor} AS f SET timeline = v_timeline WHERE f.id = 1;
        RETURN;
    END IF;
    v_now := clock_timestamp();
    SELECT GREATEST(v_floor, COALESCE(max(l.token), 0)) INTO v_top FROM {lock} AS l;
    v_floor := CASE WHEN v_top > p_max_token - p_margin THEN p_max_token
        ELSE v_top + p_margin END;
    -- Every lease ends: its holder may have been granted on the old primary,
    -- and its token is now at or below the floor.
    UPDATE {grant} AS g SET ended_at = LEAST(v_now, g.expires_at),
        end_reason = CASE WHEN g.expires_at > v_now THEN 'revoked' ELSE 'expired' END
    FROM {lock} AS l
    WHERE g.lock_id = l.id AND g.token = l.token AND g.ended_at IS NULL AND l.holder <> '';
    UPDATE {lock} AS l SET holder = '', lease_hash = '', acquired_at = NULL,
        expires_at = NULL,
        delay_until = CASE WHEN l.lock_delay > 0
            THEN v_now + make_interval(secs => l.lock_delay) END
    WHERE l.holder <> '';
    GET DIAGNOSTICS v_revoked = ROW_COUNT;
    -- Every watermark closed at the new floor: no token from before writes again.
    UPDATE {fence} AS w SET token = v_floor, step = p_max_token, updated_at = v_now
    WHERE w.token < v_floor OR (w.token = v_floor AND w.step < p_max_token);
    UPDATE {floor} AS f SET token = v_floor, raised_at = v_now, timeline = v_timeline
    WHERE f.id = 1;
    RAISE LOG 'coordination: promotion to timeline % (from %): token floor raised to %, % leases revoked',
        v_timeline, v_recorded, v_floor, v_revoked;
END
$fn$
"""
GUARD = f"\n    PERFORM {FAILOVER_GUARD_FUNCTION}({FAILOVER_MARGIN}, p_max_token);"

# How the acquire function reads the token floor: its one row, 0 if the row is
# missing (TokenFloor.objects.value() reads it the same way).
READ_FLOOR = "COALESCE((SELECT f.token FROM {floor} AS f WHERE f.id = 1), 0)"
# The timeline the server writes WAL on: the first eight hex digits of the WAL
# file's name (it changes when a promotion ends, before the server accepts
# writes; pg_control_checkpoint() would lag until the first checkpoint).
CURRENT_TIMELINE_SQL = "('x' || left(pg_walfile_name(pg_current_wal_lsn()), 8))::bit(32)::integer"

# Release does not wait for its WAL flush (synchronous_commit off for its own
# transaction, and only when that transaction has written nothing before it: a
# release is never called inside a caller's transaction, and a raw call inside
# one keeps that transaction durable). Losing a release can only leave a lock
# held longer: if the server crashes before the release reaches the disk, the
# lease is live again after recovery and runs to its expiry (the next acquire
# closes its grant as expired). No token, grant or watermark depends on a
# release being durable, and a grant that found the lock released commits after
# the release in the WAL, so flushing that grant flushes the release first. A
# renew stays durable: losing one would shorten a lease its holder believes in.
#
# Release matches the lease by key, token and lease hash, after the row lock
# is held. The grant row's expires_at (moved together with the lock's by renew)
# says whether the lease ran out first. Waiters are notified only if one said
# it waits (wake_until, on the row version this update locked), so releases
# nobody waits for do not queue on the server's single NOTIFY lock. Refused:
# the lock's state, so the caller can say why (lock_id is NULL for a key never
# granted).
CREATE_RELEASE_FUNCTION = """
CREATE OR REPLACE FUNCTION coordination_release(
    p_key text, p_token bigint, p_hash text, p_notify boolean, p_channel text,
    OUT released boolean, OUT now timestamptz, OUT ended_at timestamptz,
    OUT end_reason text, OUT lock_id bigint, OUT token bigint, OUT holder text,
    OUT lease_hash text, OUT expires_at timestamptz
) LANGUAGE plpgsql VOLATILE AS $fn$
DECLARE
    v_wake_until timestamptz;
BEGIN
    IF txid_current_if_assigned() IS NULL THEN
        PERFORM set_config('synchronous_commit', 'off', true);
    END IF;
    UPDATE {lock} AS l SET holder = '', lease_hash = '', acquired_at = NULL,
        expires_at = NULL,
        delay_until = CASE WHEN l.expires_at <= clock_timestamp()
            THEN l.expires_at + make_interval(secs => l.lock_delay) END
    WHERE l.key = p_key AND l.holder <> '' AND l.token = p_token AND l.lease_hash = p_hash
    RETURNING l.id, clock_timestamp(), l.wake_until INTO lock_id, now, v_wake_until;
    released := FOUND;
    IF NOT released THEN
        SELECT l.id, l.token, l.holder, l.lease_hash, l.expires_at, clock_timestamp()
        INTO lock_id, token, holder, lease_hash, expires_at, now
        FROM (SELECT 1) AS one LEFT JOIN {lock} AS l ON l.key = p_key;
        RETURN;
    END IF;
    UPDATE {grant} AS g SET
        ended_at = LEAST(coordination_release.now, g.expires_at),
        end_reason = CASE WHEN g.expires_at > coordination_release.now
            THEN 'released' ELSE 'expired' END
    WHERE g.lock_id = coordination_release.lock_id AND g.token = p_token
        AND g.ended_at IS NULL
    RETURNING g.ended_at, g.end_reason INTO ended_at, end_reason;
    IF p_notify AND v_wake_until > coordination_release.now THEN
        PERFORM pg_notify(p_channel, p_key);
    END IF;
END
$fn$
"""

# Today's functions, in the order they are created (the acquire calls the guard).
CREATE_FUNCTIONS = (
    CREATE_FAILOVER_GUARD_FUNCTION,
    CREATE_ACQUIRE_FUNCTION.replace("{read_floor}", READ_FLOOR).replace("{guard}", GUARD),
    CREATE_RELEASE_FUNCTION,
)
DROP_FUNCTIONS = (
    "DROP FUNCTION IF EXISTS coordination_acquire("
    "text, text, text, double precision, double precision, bigint, bigint)",
    "DROP FUNCTION IF EXISTS coordination_release(text, bigint, text, boolean, text)",
    "DROP FUNCTION IF EXISTS coordination_failover_guard(bigint, bigint)",
)

ACQUIRE = f"SELECT * FROM {ACQUIRE_FUNCTION}(%s, %s, %s, %s, %s, %s, %s)"
RELEASE = f"SELECT * FROM {RELEASE_FUNCTION}(%s, %s, %s, %s, %s)"

# A waiter says until when it may wait, before its next attempt; a release
# notifies only while someone may be waiting. The row lock orders this with
# the release's update: either the release sees it, or it committed first and
# the attempt after this sees the lock free.
WAKE_ME = """
UPDATE {lock} SET wake_until = GREATEST(wake_until,
    clock_timestamp() + make_interval(secs => %(seconds)s))
WHERE key = %(key)s
RETURNING 1
"""
NOTIFY = "SELECT pg_notify(%s, %s)"
INSUFFICIENT_PRIVILEGE = "42501"
# The acquire function found the token floor raised to the largest token after
# it created the key's row: nothing was granted (the call rolled back).
FLOOR_EXHAUSTED = "CF001"
UNDEFINED_FUNCTION = "42883"
# A prepared statement the server does not have (26000), or has under the same
# name (42P05): what a transaction-pooling proxy that cannot keep prepared
# statements leads to. Connections that met one prepare nothing more.
_LOST_PREPARED = ("26000", "42P05")
_UNPREPARED: WeakSet[Any] = WeakSet()
IDLE = 0  # psycopg.pq.TransactionStatus.IDLE: no transaction open
LISTEN = f"LISTEN {WAKE_UP_CHANNEL}"


def install(connection: BaseDatabaseWrapper) -> None:
    """Create today's functions on ``connection`` for the app's tables (the latest
    migration that creates them runs the same SQL, frozen). They are dropped
    first, so a later version may change what they return. Reads no settings."""
    from ..models import Fence, Grant, Lock, Ticket, TokenFloor

    tables = {"lock": Lock, "grant": Grant, "ticket": Ticket, "floor": TokenFloor, "fence": Fence}
    with connection.cursor() as cursor:
        for statement in DROP_FUNCTIONS:
            cursor.execute(statement)
        for template in CREATE_FUNCTIONS:
            cursor.execute(format_sql(template, connection, tables=tables))


def install_if_permitted(connection: BaseDatabaseWrapper) -> bool:
    """:func:`install`, unless the database refuses the app the right to create
    functions: then nothing is created (False), and the grant point must be the
    ORM transaction (``COORDINATION["GRANT_POINT"] = "orm"``)."""
    return _permitted(connection, lambda: install(connection))


def _permitted(connection: BaseDatabaseWrapper, create: Callable[[], object]) -> bool:
    """Run ``create``; False if the database refused the app the right to create
    functions (migrations read no settings, so they cannot know the grant point)."""
    try:
        # A savepoint: the refused statement must not abort the migration's
        # own transaction.
        with transaction.atomic(using=connection.alias):
            create()
    except DatabaseError as error:
        if _sqlstate(error) != INSUFFICIENT_PRIVILEGE:
            raise
        logger.warning(
            "not allowed to create the grant point's functions (%s); set "
            "COORDINATION['GRANT_POINT'] = 'orm' for this database", error,
        )
        return False
    return True


def install_for_models(connection: BaseDatabaseWrapper) -> None:
    """:func:`install` (for schemas made without migrations, such as the benchmark's)."""
    install(connection)


# The lock table's rows are written on every acquire and every release, and a
# fence's row on every accepted write; no index covers a column those writes
# change. PostgreSQL can then keep the new version of a row on its own page and
# add no index entries (a heap-only-tuple, HOT, update), but only if the page has
# room. At the default fillfactor (100) pages fill up (a bulk load, or a table
# whose rows have all been written once), and an update of a row on a full page
# moves it: a write to another page and an insert into each of the lock table's
# three indexes, with their pages logged in full after a checkpoint. A fifth of
# each page left free keeps these updates in place; pages filled before the
# setting keep their layout until rewritten (VACUUM FULL, pg_repack).
UPDATE_IN_PLACE_FILLFACTOR = 80


def leave_room_for_updates(
    connection: BaseDatabaseWrapper, *tables: type[models.Model], fillfactor: int | None = None
) -> None:
    """Set the fillfactor of the tables of the models ``tables`` (the benchmark's
    schemas; migration 0015 froze what it ran): ``UPDATE_IN_PLACE_FILLFACTOR``, or PostgreSQL's
    default with ``fillfactor=100``. A storage parameter only: the ALTER takes a
    lock that blocks neither reads nor writes, and rewrites nothing."""
    value = UPDATE_IN_PLACE_FILLFACTOR if fillfactor is None else int(fillfactor)
    with connection.cursor() as cursor:
        for model in tables:
            table = connection.ops.quote_name(model._meta.db_table)
            cursor.execute(f"ALTER TABLE {table} SET (fillfactor = {value})")


def _sqlstate(error: BaseException) -> str | None:
    return getattr(error.__cause__, "sqlstate", None) or getattr(error, "sqlstate", None)


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

    def grant_in_transaction(
        self, key: str, holder: str, ttl: float, lock_delay: float, ticket: int | None
    ) -> Acquired:
        lease_id = new_lease_id()
        lease_hash = hash_lease_id(lease_id)
        # Without a ticket every live ticket of the key is ahead: no barging past
        # fair waiters.
        place = MAX_TOKEN if ticket is None else ticket
        params = (key, holder, lease_hash, ttl, lock_delay, place, MAX_TOKEN)
        while True:
            (
                granted, _lock_id, token, current_holder, acquired_at, expires_at, now,
                current_delay, delay_until, ahead, _grant_id, prev_token, prev_holder,
                prev_acquired_at, prev_expires_at, floor,
            ) = self.call(ACQUIRE, params)
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

    def release_exclusive(self, lease: Lease) -> Ended:
        refuse_in_caller_transaction(self.connection)
        released, now, ended_at, end_reason, lock_id, token, holder, lease_hash, expires_at = (
            self.call(RELEASE, (
                lease.key, lease.token, hash_lease_id(lease.lease_id),
                bool(app_settings.WAKE_UPS), WAKE_UP_CHANNEL,
            ))
        )
        if not released:
            # Not the current lease: say precisely why, as the ORM path does.
            if lock_id is None:
                raise never_granted(lease.key)
            snapshot = LockSnapshot(lease.key, token, holder, lease_hash, expires_at, 0.0, None)
            raise lease_refusal(snapshot, lease, now) or LeaseLost(
                f"lease of {lease.key!r} token {lease.token} is not current"
            )
        if end_reason == GrantEnd.EXPIRED:
            return Ended(GrantEnd.EXPIRED, ended_at, ended_at)
        return Ended(GrantEnd.RELEASED, ended_at or now, None)


# --- watermark triggers (coordination.watermarks) ------------------------------------
#
# One function serves every trigger. It only runs when a trigger's WHEN clause
# has already decided to refuse, so it may take its time to say why: it reads
# the watermark and the primary key through to_jsonb(), named by the trigger's
# arguments (constraint, primary key column, watermark columns).
REFUSE_WATERMARK_FUNCTION = """
CREATE OR REPLACE FUNCTION coordination_refuse_watermark() RETURNS trigger
LANGUAGE plpgsql AS $fn$
DECLARE
    before jsonb := to_jsonb(OLD);
    after jsonb := to_jsonb(NEW);
    columns text[] := TG_ARGV[2:TG_NARGS - 1];
    old_mark jsonb;
    new_mark jsonb;
    old_shown text;
    new_shown text;
    shown text;
BEGIN
    SELECT jsonb_agg(before -> u.c ORDER BY u.n), jsonb_agg(after -> u.c ORDER BY u.n)
    INTO old_mark, new_mark FROM unnest(columns) WITH ORDINALITY AS u(c, n);
    -- Shown as the comparison reads them: 5, or the row (2, 1).
    old_shown := CASE WHEN TG_NARGS = 3 THEN old_mark ->> 0
        ELSE translate(old_mark::text, '[]', '()') END;
    new_shown := CASE WHEN TG_NARGS = 3 THEN new_mark ->> 0
        ELSE translate(new_mark::text, '[]', '()') END;
    shown := format('%s: UPDATE of %s pk %s', TG_ARGV[0], TG_TABLE_NAME, before ->> TG_ARGV[1]);
    RAISE EXCEPTION USING
        ERRCODE = 'check_violation',
        CONSTRAINT = TG_ARGV[0],
        SCHEMA = TG_TABLE_SCHEMA,
        TABLE = TG_TABLE_NAME,
        MESSAGE = CASE WHEN TG_ARGV[0] = 'coordination_watermark_must_rise' THEN format(
            '%s leaves the watermark (%s) at %s; the table is fenced strictly, so every '
            'UPDATE must raise it (fenced_update or fenced_save)',
            shown, array_to_string(columns, ', '), old_shown)
        ELSE format(
            '%s would lower the watermark (%s) from %s to %s; watermarks never go backwards '
            '(rule 8 of docs/rules.md)',
            shown, array_to_string(columns, ', '), old_shown, new_shown)
        END,
        DETAIL = jsonb_build_object(
            'table', TG_TABLE_NAME, 'pk', before -> TG_ARGV[1], 'columns', to_jsonb(columns),
            'old', old_mark, 'new', new_mark
        )::text;
END
$fn$
"""
WATERMARK_TRIGGER = (
    "CREATE TRIGGER {name} BEFORE UPDATE{of} ON {table} FOR EACH ROW "
    "WHEN ({condition}) EXECUTE FUNCTION coordination_refuse_watermark({arguments})"
)

# The tombstone functions take the primary key column and the two watermark
# columns as arguments, and read them through to_jsonb(): one function for
# every table. A row's primary key is kept as jsonb renders it as text, the
# same on delete and on insert.
KEEP_WATERMARK_FUNCTION = f"""
CREATE OR REPLACE FUNCTION coordination_keep_watermark() RETURNS trigger
LANGUAGE plpgsql AS $fn$
DECLARE
    before jsonb := to_jsonb(OLD);
BEGIN
    INSERT INTO {TOMBSTONES} AS kept (table_name, row_pk, fence, fence_step, deleted_at)
    VALUES (TG_TABLE_NAME, before ->> TG_ARGV[0], (before ->> TG_ARGV[1])::bigint,
            (before ->> TG_ARGV[2])::bigint, now())
    ON CONFLICT (table_name, row_pk) DO UPDATE
    SET fence = EXCLUDED.fence, fence_step = EXCLUDED.fence_step, deleted_at = EXCLUDED.deleted_at
    WHERE (EXCLUDED.fence, EXCLUDED.fence_step) > (kept.fence, kept.fence_step);
    RETURN NULL;
END
$fn$
"""
# BEFORE INSERT: the row is written with the restored watermark, which an
# INSERT ... RETURNING reads back.
RESTORE_WATERMARK_FUNCTION = f"""
CREATE OR REPLACE FUNCTION coordination_restore_watermark() RETURNS trigger
LANGUAGE plpgsql AS $fn$
DECLARE
    after jsonb := to_jsonb(NEW);
    kept bigint;
BEGIN
    SELECT t.fence INTO kept FROM {TOMBSTONES} t
    WHERE t.table_name = TG_TABLE_NAME AND t.row_pk = after ->> TG_ARGV[0];
    IF kept IS NOT NULL AND ((after ->> TG_ARGV[1])::bigint, (after ->> TG_ARGV[2])::bigint)
            < (kept, {HIGHEST_STEP}) THEN
        NEW := jsonb_populate_record(
            NEW, jsonb_build_object(TG_ARGV[1], kept, TG_ARGV[2], {HIGHEST_STEP})
        );
    END IF;
    RETURN NEW;
END
$fn$
"""
KEEP_WATERMARK_TRIGGER = (
    "CREATE TRIGGER {name} AFTER DELETE ON {table} FOR EACH ROW "
    "WHEN ({old} > (0, 0)) EXECUTE FUNCTION coordination_keep_watermark({arguments})"
)
RESTORE_WATERMARK_TRIGGER = (
    "CREATE TRIGGER {name} BEFORE INSERT ON {table} FOR EACH ROW "
    "EXECUTE FUNCTION coordination_restore_watermark({arguments})"
)
_WATERMARK_FUNCTIONS = {
    NOT_LOWERED: ("coordination_refuse_watermark", REFUSE_WATERMARK_FUNCTION),
    MUST_RISE: ("coordination_refuse_watermark", REFUSE_WATERMARK_FUNCTION),
    KEPT: ("coordination_keep_watermark", KEEP_WATERMARK_FUNCTION),
    RESTORED: ("coordination_restore_watermark", RESTORE_WATERMARK_FUNCTION),
}


class PostgreSQLWatermarkTriggers(WatermarkTriggers):
    """Watermark triggers on PostgreSQL: one PL/pgSQL function per rule, shared by
    every table; a refusal is SQLSTATE 23514 naming the rule as its constraint."""

    restores_before_insert = True

    # The fingerprint of a trigger's definition is kept as its comment: the
    # server only keeps a normalised form of the statement.
    def trigger(self, watermark: Watermark, rule: str) -> str:
        if rule in (KEPT, RESTORED):
            template = KEEP_WATERMARK_TRIGGER if rule == KEPT else RESTORE_WATERMARK_TRIGGER
            return template.format(
                name=self.quote(self.trigger_name(watermark, rule)),
                table=self.quote(watermark.table), old=self.row("OLD", watermark),
                arguments=", ".join(
                    sql_literal(value) for value in (watermark.pk_column, *watermark.columns)
                ),
            )
        arguments = ", ".join(
            sql_literal(value) for value in (rule, watermark.pk_column, *watermark.columns)
        )
        return WATERMARK_TRIGGER.format(
            name=self.quote(self.trigger_name(watermark, rule)), of=self.of(watermark, rule),
            table=self.quote(watermark.table), condition=self.condition(watermark, rule),
            arguments=arguments,
        )

    def existing(self, cursor: Any, table: str) -> dict[str, str]:
        cursor.execute(
            "SELECT t.tgname, coalesce(obj_description(t.oid, 'pg_trigger'), '') FROM pg_trigger t"
            " WHERE t.tgrelid = to_regclass(%s) AND NOT t.tgisinternal",
            [self.quote(table)],
        )
        return dict(cursor.fetchall())

    def create(self, cursor: Any, watermark: Watermark, name: str, sql: str) -> None:
        rule = next(rule for rule in ALL_RULES if self.trigger_name(watermark, rule) == name)
        function, definition = _WATERMARK_FUNCTIONS[rule]
        cursor.execute(
            f"SELECT coalesce(obj_description(to_regprocedure('{function}()'), 'pg_proc'), '')"
        )
        if cursor.fetchone()[0] != fingerprint(definition):
            cursor.execute(definition)
            cursor.execute(
                f"COMMENT ON FUNCTION {function}() IS " + sql_literal(fingerprint(definition))
            )
        cursor.execute(sql)
        cursor.execute(
            f"COMMENT ON TRIGGER {self.quote(name)} ON {self.quote(watermark.table)} IS "
            + sql_literal(fingerprint(sql))
        )

    def drop(self, cursor: Any, watermark: Watermark, name: str) -> None:
        cursor.execute(f"DROP TRIGGER IF EXISTS {self.quote(name)} ON {self.quote(watermark.table)}")


# --- the dialect -------------------------------------------------------------------------


class PostgreSQLDialect(Dialect):
    """PostgreSQL: the function grant point (or the ORM one, with LISTEN/NOTIFY),
    its watermark triggers, the server's idle bound and the promotion guard."""

    name = "postgresql"
    migration_sql = MIGRATION_SQL

    def grant_point(self, alias: str, *, portable: bool) -> GrantPoint:
        return (PostgreSQLOrmGrantPoint if portable else PostgreSQLGrantPoint)(alias, self)

    def watermark_triggers(self, connection: BaseDatabaseWrapper) -> WatermarkTriggers:
        return PostgreSQLWatermarkTriggers(connection)

    def bound_idle_transaction(self, connection: BaseDatabaseWrapper, seconds: float) -> None:
        # The transaction's own setting (is_local): reset when it ends.
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT set_config('idle_in_transaction_session_timeout', %s, true)",
                [f"{max(1, round(seconds * 1000))}ms"],
            )

    def ensure_token_floor_row(self, alias: str) -> None:
        # The row records the current timeline in the same statement, as migration
        # 0012 recorded it: a row with none would make the promotion guard of the
        # next grants lock it, and an acquire_many whose guard ran before the row
        # existed would take that lock after its lock rows (a deadlock).
        from ..models import TokenFloor

        connection = connections[alias]
        table = connection.ops.quote_name(TokenFloor._meta.db_table)
        with connection.cursor() as cursor:
            cursor.execute(
                f"INSERT INTO {table} (id, token, timeline) VALUES (%s, 0, {CURRENT_TIMELINE_SQL}) "
                "ON CONFLICT (id) DO NOTHING",
                [TokenFloor.ROW],
            )

    def create_missing(self, rows: QuerySet[Any], new: list[Model], unique: str) -> None:
        rows.bulk_create(new, ignore_conflicts=True)  # ON CONFLICT DO NOTHING

    def codepoint_order(self, field: str) -> Any:
        # The "C" collation: the database's default may sort case and punctuation otherwise.
        return Collate(F(field), "C")

    def check_settings(self, alias: str, config: Mapping[str, Any]) -> list[CheckMessage]:
        return []

    def replication(self, connection: BaseDatabaseWrapper) -> Replication | None:
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT (SELECT count(*) FROM pg_stat_replication), "
                "current_setting('synchronous_standby_names') <> '' "
                "AND current_setting('synchronous_commit') NOT IN ('off', 'local'), "
                f"to_regprocedure('{FAILOVER_GUARD_FUNCTION}(bigint, bigint)') IS NOT NULL"
            )
            replicas, synchronous, guard_installed = cursor.fetchone()
        from . import get_backend

        guarded = guard_installed and isinstance(
            get_backend(connection.alias), PostgreSQLGrantPoint
        )
        return Replication(replicas, synchronous, guard_installed, guarded)

    def run_migration_sql(self, connection: BaseDatabaseWrapper, step: str) -> bool:
        frozen = self.migration_sql.get(step)
        if frozen is None or not frozen.functions:
            return super().run_migration_sql(connection, step)
        run = super().run_migration_sql
        return _permitted(connection, lambda: run(connection, step))
