"""The grant point on SQLite: the ORM transaction, under BEGIN IMMEDIATE.

SQLite has no row locks (``select_for_update`` is a no-op there): the database
write lock is what serialises grants. With ``DATABASES[...]["OPTIONS"]
["transaction_mode"] = "IMMEDIATE"`` (system check ``coordination.W001``) each
grant-point transaction takes that lock when it begins, before it reads the
counter, so whoever holds it is the only one deciding, as a row lock does on
PostgreSQL. Waiters poll: SQLite cannot announce a release to another process.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from django.core.checks import CheckMessage, Error
from django.db import models
from django.db.backends.base.base import BaseDatabaseWrapper

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
from .base import GrantPoint
from .orm import OrmDialect, OrmGrantPoint
from .sqlite_frozen import MIGRATION_SQL

__all__ = ["SQLITE_OPTIONS", "SQLiteDialect", "SQLiteGrantPoint", "SQLiteWatermarkTriggers"]


class SQLiteGrantPoint(OrmGrantPoint):
    """The ORM grant point on SQLite."""

    name = "sqlite"

    def save_surviving_rollback(self, record: models.Model) -> None:
        """SQLite allows one writer, and the caller's transaction is it: a second
        connection would wait for that very transaction. The record commits with
        the caller's transaction (or at once outside one)."""
        record.save(using=self.alias)


# --- watermark triggers (coordination.watermarks) ------------------------------------
#
# RAISE(ABORT) undoes the whole statement (every row it changed) and keeps the
# transaction. Before SQLite 3.47 its message must be a literal, so it names
# the table but not the row: the ORM reads the row's watermark afterwards.
WATERMARK_TRIGGER = (
    "CREATE TRIGGER {name} BEFORE UPDATE{of} ON {table} FOR EACH ROW "
    "WHEN {condition} BEGIN SELECT RAISE(ABORT, {message}); END"
)

# SQLite cannot change the row a BEFORE INSERT trigger sees: the restored
# watermark is written by an UPDATE right after the insert, in the same
# statement (so the UPDATE triggers check it too).
KEEP_WATERMARK_TRIGGER = (
    "CREATE TRIGGER {name} AFTER DELETE ON {table} FOR EACH ROW WHEN {old} > (0, 0) BEGIN "
    f"INSERT INTO {TOMBSTONES} (table_name, row_pk, fence, fence_step, deleted_at) "
    "VALUES ({table_literal}, CAST(OLD.{pk} AS TEXT), {old_values}, "
    "STRFTIME('%Y-%m-%d %H:%M:%f', 'NOW')) "
    "ON CONFLICT (table_name, row_pk) DO UPDATE SET fence = excluded.fence, "
    "fence_step = excluded.fence_step, deleted_at = excluded.deleted_at "
    f"WHERE (excluded.fence, excluded.fence_step) > ({TOMBSTONES}.fence, {TOMBSTONES}.fence_step); "
    "END"
)
RESTORE_WATERMARK_TRIGGER = (
    "CREATE TRIGGER {name} AFTER INSERT ON {table} FOR EACH ROW WHEN EXISTS ({kept}) BEGIN "
    "UPDATE {table} SET {columns} = ({kept_mark}) "
    "WHERE {pk} = NEW.{pk} AND {columns} < ({kept_mark}); END"
)


class SQLiteWatermarkTriggers(WatermarkTriggers):
    """Watermark triggers on SQLite: ``RAISE(ABORT)`` with the rule's name first in
    the message."""

    # SQLite keeps each trigger's statement as it was written: that is its fingerprint.
    def trigger(self, watermark: Watermark, rule: str) -> str:
        name, table = self.quote(self.trigger_name(watermark, rule)), self.quote(watermark.table)
        pk = self.quote(watermark.pk_column)
        if rule == KEPT:
            return KEEP_WATERMARK_TRIGGER.format(
                name=name, table=table, old=self.row("OLD", watermark), pk=pk,
                table_literal=sql_literal(watermark.table),
                old_values=", ".join(f"OLD.{self.quote(column)}" for column in watermark.columns),
            )
        if rule == RESTORED:
            where = (
                f"FROM {TOMBSTONES} WHERE table_name = {sql_literal(watermark.table)} "
                f"AND row_pk = CAST(NEW.{pk} AS TEXT)"
            )
            return RESTORE_WATERMARK_TRIGGER.format(
                name=name, table=table, pk=pk, columns=self.row("", watermark),
                kept=f"SELECT 1 {where}", kept_mark=f"SELECT fence, {HIGHEST_STEP} {where}",
            )
        template = NOT_LOWERED_MESSAGE if rule == NOT_LOWERED else MUST_RISE_MESSAGE
        message = template.format(
            constraint=rule, table=watermark.table, columns=", ".join(watermark.columns)
        )
        return WATERMARK_TRIGGER.format(
            name=self.quote(self.trigger_name(watermark, rule)), of=self.of(watermark, rule),
            table=self.quote(watermark.table), condition=self.condition(watermark, rule),
            message=sql_literal(message),
        )

    def existing(self, cursor: Any, table: str) -> dict[str, str]:
        cursor.execute(
            "SELECT name, sql FROM sqlite_master WHERE type = 'trigger' AND tbl_name = %s", [table]
        )
        return {name: fingerprint(sql) for name, sql in cursor.fetchall()}

    def create(self, cursor: Any, watermark: Watermark, name: str, sql: str) -> None:
        cursor.execute(sql)

    def drop(self, cursor: Any, watermark: Watermark, name: str) -> None:
        cursor.execute(f"DROP TRIGGER IF EXISTS {self.quote(name)}")


# --- the dialect -------------------------------------------------------------------------

SQLITE_OPTIONS = {"transaction_mode": "IMMEDIATE", "timeout": 30, "init_command": "PRAGMA journal_mode=WAL;"}
"""The ``OPTIONS`` system check ``coordination.E004`` proposes for the grant point's database."""


class SQLiteDialect(OrmDialect):
    """SQLite: the portable grant point under BEGIN IMMEDIATE, and its own triggers."""

    name = "sqlite"
    migration_sql = MIGRATION_SQL

    def grant_point(self, alias: str, *, portable: bool) -> GrantPoint:
        return SQLiteGrantPoint(alias, self)

    def watermark_triggers(self, connection: BaseDatabaseWrapper) -> WatermarkTriggers:
        return SQLiteWatermarkTriggers(connection)

    def check_settings(self, alias: str, config: Mapping[str, Any]) -> list[CheckMessage]:
        mode = str(config.get("OPTIONS", {}).get("transaction_mode", "")).upper()
        if mode in {"IMMEDIATE", "EXCLUSIVE"}:
            return []
        # A deferred transaction reads the token counter under a shared lock and
        # fails to upgrade it when another writer got there first: under load most
        # grants then fail with "database is locked" instead of waiting their turn.
        return [
            Error(
                f"SQLite database {alias!r} (the grant point's, COORDINATION['DATABASE']) does not "
                "use IMMEDIATE transactions: concurrent grants fail with 'database is locked'.",
                hint=f'Set DATABASES["{alias}"]["OPTIONS"] = {json.dumps(SQLITE_OPTIONS)} '
                "(IMMEDIATE takes the write lock before the token counter is read; "
                "the timeout lets a grant wait its turn; WAL keeps readers unblocked).",
                id="coordination.E004",
            )
        ]
