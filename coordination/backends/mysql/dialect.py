"""What the rest of the app asks of MariaDB: :class:`MySQLDialect`."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from django.core.checks import CheckMessage, Error, Warning
from django.db import DatabaseError, models
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.models import F
from django.db.models.functions import Collate

from ...models import Lock
from ...watermarks import WatermarkTriggers
from ..base import GrantPoint
from ..orm import OrmDialect
from .frozen import MIGRATION_SQL
from .grant_point import MySQLGrantPoint, MySQLOrmGrantPoint, error_code
from .triggers import MySQLWatermarkTriggers

__all__ = ["COLLATION", "MySQLDialect"]

logger = logging.getLogger("coordination.locks")

COLLATION = "utf8mb4_bin"
"""The collation of the app's tables: keys compare byte for byte, in codepoint order."""

READ_COMMITTED = "read committed"
# The server refuses the app the right to create routines: access denied to the
# database (1044), a command denied (1142), a privilege missing (1227, 1370).
NOT_PERMITTED = (1044, 1142, 1227, 1370)


class MySQLDialect(OrmDialect):
    """MariaDB: the procedure grant point (or the ORM one), its own triggers, binary keys."""

    name = "mysql"
    migration_sql = MIGRATION_SQL
    json_max_depth = 31  # JSON_VALID, the CHECK of every JSON column, refuses 32

    def grant_point(self, alias: str, *, portable: bool) -> GrantPoint:
        return (MySQLOrmGrantPoint if portable else MySQLGrantPoint)(alias, self)

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

    def run_migration_sql(self, connection: BaseDatabaseWrapper, step: str) -> bool:
        frozen = self.migration_sql.get(step)
        if frozen is None or not frozen.functions:
            return super().run_migration_sql(connection, step)
        try:
            return super().run_migration_sql(connection, step)
        except DatabaseError as error:
            if error_code(error) not in NOT_PERMITTED:
                raise
            logger.warning(
                "not allowed to create the grant point's procedures (%s); set "
                "COORDINATION['GRANT_POINT'] = 'orm' for this database", error,
            )
            return False
