"""The watermark triggers on MariaDB (coordination.watermarks)."""

from __future__ import annotations

from typing import Any

from ...watermarks import (
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

__all__ = ["MySQLWatermarkTriggers"]

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

