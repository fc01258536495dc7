"""MariaDB (and MySQL, untested): the portable grant point, and its own triggers.

The grant point is the ORM transaction of :mod:`coordination.backends.orm`: it
holds the key's row with ``SELECT ... FOR UPDATE`` under READ COMMITTED
(Django's isolation on this database; system check ``coordination.E006``
refuses another). Waiters poll: the database cannot announce a release.

Keys, holders and resources compare byte for byte, as on PostgreSQL and
SQLite: after every ``migrate`` the app's tables are converted to
``utf8mb4_bin`` (a server's default collation, ``utf8mb4_general_ci`` on
Debian, would make ``Billing:1`` and ``billing:1`` one lock).

Failure modes: a client paused inside a grant transaction has its session
ended after ``IDLE_BOUND`` seconds (MariaDB's ``idle_transaction_timeout``,
set for that transaction); a ``fence()`` block has no such bound (a holder
paused inside it keeps its Fence rows until it wakes or its connection dies,
and a waiter's row-lock wait ends after ``innodb_lock_wait_timeout``). No
promotion guard; a JSON value nests at most 31 levels.
"""

from __future__ import annotations

import functools
import math
import random
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, suppress
from typing import Any, TypeVar

from django.core.checks import CheckMessage, Error, Warning
from django.db import DatabaseError, OperationalError, models
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.models import F
from django.db.models.functions import Collate

from ..models import Lock
from ..watermarks import (
    HIGHEST_STEP,
    KEPT,
    MUST_RISE_MESSAGE,
    NOT_LOWERED,
    NOT_LOWERED_MESSAGE,
    RESTORED,
    TOMBSTONES,
    Watermark,
    WatermarkTriggers,
    fingerprint,
    sql_literal,
)
from .base import IDLE_BOUND, GrantPoint, refuse_in_caller_transaction
from .orm import OrmDialect, OrmGrantPoint

__all__ = ["COLLATION", "MySQLDialect", "MySQLGrantPoint", "MySQLWatermarkTriggers"]

T = TypeVar("T")

COLLATION = "utf8mb4_bin"
"""The collation of the app's tables: keys compare byte for byte, in codepoint order."""


# InnoDB ends one of two transactions that wait for each other's row locks and
# says "try restarting transaction". Racing inserts of a key whose row was just
# deleted (pruned) do this even under READ COMMITTED. The transaction it ended
# was rolled back whole: nothing was granted, so it is run again.
DEADLOCK = 1213
DEADLOCK_RETRIES = 5


def _retried_on_deadlock(method: Callable[..., T]) -> Callable[..., T]:
    @functools.wraps(method)
    def retrying(self: MySQLGrantPoint, *args: Any, **kwargs: Any) -> T:
        for attempt in range(1, DEADLOCK_RETRIES):
            try:
                return method(self, *args, **kwargs)
            except OperationalError as error:
                cause = error.__cause__
                if cause is None or not cause.args or cause.args[0] != DEADLOCK:
                    raise
            time.sleep(random.uniform(0.001, 0.005) * attempt)
        return method(self, *args, **kwargs)  # the last try: its deadlock is raised

    return retrying


class MySQLGrantPoint(OrmGrantPoint):
    """The ORM grant point on MariaDB; a transaction InnoDB ended as a deadlock's
    victim is run again (at most five times)."""

    name = "mysql"

    @contextmanager
    def transaction(self) -> Iterator[BaseDatabaseWrapper]:
        """The grant point's transaction, bounded as on PostgreSQL: MariaDB ends the
        session of a client that idles more than ``IDLE_BOUND`` seconds inside it
        (its rows freed; the client gets ``GrantPointUnavailable``). The bound is a
        session variable, so it is set before the transaction and reset after it:
        the caller's own transactions on this connection keep the server's."""
        connection = self.connection
        refuse_in_caller_transaction(connection)
        if not getattr(connection, "mysql_is_mariadb", False):
            # MySQL has no such variable: no bound there.
            with super().transaction() as connection:
                yield connection
            return
        with connection.cursor() as cursor:
            cursor.execute(f"SET SESSION idle_transaction_timeout = {math.ceil(IDLE_BOUND)}")
        try:
            with super().transaction() as connection:
                yield connection
        finally:
            # A session the server ended has nothing to reset (Django closes it).
            with suppress(DatabaseError), connection.cursor() as cursor:
                cursor.execute("SET SESSION idle_transaction_timeout = DEFAULT")

    acquire = _retried_on_deadlock(OrmGrantPoint.acquire)
    acquire_many = _retried_on_deadlock(OrmGrantPoint.acquire_many)
    acquire_shared = _retried_on_deadlock(OrmGrantPoint.acquire_shared)
    renew_exclusive = _retried_on_deadlock(OrmGrantPoint.renew_exclusive)
    release_exclusive = _retried_on_deadlock(OrmGrantPoint.release_exclusive)
    renew_shared = _retried_on_deadlock(OrmGrantPoint.renew_shared)
    release_shared = _retried_on_deadlock(OrmGrantPoint.release_shared)
    revoke = _retried_on_deadlock(OrmGrantPoint.revoke)
    close_revoked_readers = _retried_on_deadlock(OrmGrantPoint.close_revoked_readers)


# --- watermark triggers (coordination.watermarks) ------------------------------------
#
# A trigger has no WHEN clause and no UPDATE OF: the body tests the row itself.
# SIGNAL with MySQL error 4025 (a CHECK constraint failed) reaches Django as an
# IntegrityError; its message starts as SQLite's does, rule first, and is at
# most 128 characters, so it names the table but not the row.
REFUSE_TRIGGER = (
    "CREATE TRIGGER {name} BEFORE UPDATE ON {table} FOR EACH ROW "
    "BEGIN IF {condition} THEN SIGNAL SQLSTATE '23000' SET MYSQL_ERRNO = 4025, "
    "MESSAGE_TEXT = {message}; END IF; END"
)
# The kept watermark only rises: a row deleted again at a lower watermark (a
# stale writer's copy) leaves the higher one in place.
KEEP_TRIGGER = (
    "CREATE TRIGGER {name} AFTER DELETE ON {table} FOR EACH ROW "
    "BEGIN IF {old} > (0, 0) THEN "
    f"INSERT IGNORE INTO {TOMBSTONES} (table_name, row_pk, fence, fence_step, deleted_at) "
    "VALUES ({table_literal}, CAST(OLD.{pk} AS CHAR), {old_values}, UTC_TIMESTAMP(6)); "
    f"UPDATE {TOMBSTONES} SET fence = {{first}}, fence_step = {{second}}, "
    "deleted_at = UTC_TIMESTAMP(6) WHERE table_name = {table_literal} "
    "AND row_pk = CAST(OLD.{pk} AS CHAR) AND (fence, fence_step) < ({old_values}); "
    "END IF; END"
)
# A BEFORE INSERT trigger may change the row: INSERT ... RETURNING reads the
# restored watermark, as on PostgreSQL.
RESTORE_TRIGGER = (
    "CREATE TRIGGER {name} BEFORE INSERT ON {table} FOR EACH ROW "
    "BEGIN DECLARE kept BIGINT DEFAULT NULL; "
    f"SELECT t.fence INTO kept FROM {TOMBSTONES} t WHERE t.table_name = {{table_literal}} "
    "AND t.row_pk = CAST(NEW.{pk} AS CHAR); "
    f"IF kept IS NOT NULL AND {{new}} < (kept, {HIGHEST_STEP}) THEN "
    f"SET NEW.{{first_column}} = kept, NEW.{{second_column}} = {HIGHEST_STEP}; END IF; END"
)


class MySQLWatermarkTriggers(WatermarkTriggers):
    """Watermark triggers on MariaDB: ``SIGNAL`` with the rule's name first in the message."""

    restores_before_insert = True

    def trigger(self, watermark: Watermark, rule: str) -> str:
        name, table = self.quote(self.trigger_name(watermark, rule)), self.quote(watermark.table)
        pk = self.quote(watermark.pk_column)
        columns = [self.quote(column) for column in watermark.columns]
        if rule == KEPT:
            return KEEP_TRIGGER.format(
                name=name, table=table, old=self.row("OLD", watermark), pk=pk,
                table_literal=sql_literal(watermark.table),
                old_values=", ".join(f"OLD.{column}" for column in columns),
                first=f"OLD.{columns[0]}", second=f"OLD.{columns[1]}",
            )
        if rule == RESTORED:
            return RESTORE_TRIGGER.format(
                name=name, table=table, pk=pk, table_literal=sql_literal(watermark.table),
                new=self.row("NEW", watermark), first_column=columns[0], second_column=columns[1],
            )
        template = NOT_LOWERED_MESSAGE if rule == NOT_LOWERED else MUST_RISE_MESSAGE
        message = template.format(
            constraint=rule, table=watermark.table, columns=", ".join(watermark.columns)
        )[:128]
        return REFUSE_TRIGGER.format(
            name=name, table=table, condition=self.condition(watermark, rule),
            message=sql_literal(message),
        )

    def existing(self, cursor: Any, table: str) -> dict[str, str]:
        # The server keeps the body as written (ACTION_STATEMENT); the statement
        # around it is rebuilt from the trigger's own columns.
        cursor.execute(
            "SELECT TRIGGER_NAME, ACTION_TIMING, EVENT_MANIPULATION, ACTION_STATEMENT"
            " FROM information_schema.TRIGGERS"
            " WHERE TRIGGER_SCHEMA = DATABASE() AND EVENT_OBJECT_TABLE = %s",
            [table],
        )
        return {
            name: fingerprint(
                f"CREATE TRIGGER {self.quote(name)} {timing} {event} ON {self.quote(table)} "
                f"FOR EACH ROW {body}"
            )
            for name, timing, event, body in cursor.fetchall()
        }

    def create(self, cursor: Any, watermark: Watermark, name: str, sql: str) -> None:
        cursor.execute(sql)

    def drop(self, cursor: Any, watermark: Watermark, name: str) -> None:
        cursor.execute(f"DROP TRIGGER IF EXISTS {self.quote(name)}")


# --- the dialect -------------------------------------------------------------------------

READ_COMMITTED = "read committed"


class MySQLDialect(OrmDialect):
    """MariaDB: the portable grant point, its own triggers, binary keys."""

    name = "mysql"
    json_max_depth = 31  # JSON_VALID, the CHECK of every JSON column, refuses 32

    def grant_point(self, alias: str, *, portable: bool) -> GrantPoint:
        return MySQLGrantPoint(alias, self)

    def watermark_triggers(self, connection: BaseDatabaseWrapper) -> WatermarkTriggers:
        return MySQLWatermarkTriggers(connection)

    def create_missing(self, rows: models.QuerySet[Any], new: list[models.Model], unique: str) -> None:
        # INSERT IGNORE of a row another transaction inserted takes a shared lock
        # on it: two such callers both holding one then both asking for the row
        # lock deadlock. ON DUPLICATE KEY UPDATE takes the row lock itself, so
        # racing callers queue on it. (Setting the key to itself changes nothing.)
        rows.bulk_create(new, update_conflicts=True, update_fields=[unique])

    def codepoint_order(self, field: str) -> Any:
        return Collate(F(field), COLLATION)

    def check_settings(self, alias: str, config: Mapping[str, Any]) -> list[CheckMessage]:
        options = config.get("OPTIONS", {})
        messages: list[CheckMessage] = []
        isolation = str(options.get("isolation_level") or READ_COMMITTED).lower()
        if isolation != READ_COMMITTED:
            # Under REPEATABLE READ a grant would read the token floor and the fair
            # queue as they were when its transaction first read anything.
            messages.append(Error(
                f"MariaDB database {alias!r} (the grant point's) uses the {isolation!r} "
                "isolation level; a grant must read what committed before it took the row lock.",
                hint=f'Remove DATABASES["{alias}"]["OPTIONS"]["isolation_level"] (Django\'s '
                "default on MariaDB and MySQL is 'read committed').",
                id="coordination.E006",
            ))
        if str(options.get("charset", "")).lower() != "utf8mb4":
            messages.append(Warning(
                f"MariaDB database {alias!r} (the grant point's) does not set the utf8mb4 "
                "character set: a key, holder or resource with a character outside the "
                "Basic Multilingual Plane (an emoji) would be refused.",
                hint=f'Set DATABASES["{alias}"]["OPTIONS"]["charset"] = "utf8mb4".',
                id="coordination.W007",
            ))
        return messages

    def after_migrate(self, connection: BaseDatabaseWrapper) -> list[str]:
        """Convert every table of the app to ``utf8mb4_bin``; returns those converted
        (a table already binary is left alone)."""
        prefix = Lock._meta.app_label + "\\_"
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT TABLE_NAME FROM information_schema.TABLES WHERE TABLE_SCHEMA = DATABASE()"
                " AND TABLE_NAME LIKE %s AND TABLE_COLLATION <> %s",
                [prefix + "%", COLLATION],
            )
            tables = [name for (name,) in cursor.fetchall()]
            for table in tables:
                cursor.execute(
                    f"ALTER TABLE {connection.ops.quote_name(table)} "
                    f"CONVERT TO CHARACTER SET utf8mb4 COLLATE {COLLATION}"
                )
        return tables
