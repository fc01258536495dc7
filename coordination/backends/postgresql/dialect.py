"""What the rest of the app asks of PostgreSQL: :class:`PostgreSQLDialect`."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Mapping
from typing import Any

from django.core.checks import CheckMessage, Error
from django.db import connections
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.models import F, Model, QuerySet
from django.db.models.functions import Collate
from django.db.models.sql import InsertQuery

from ...models import TokenFloor
from ...watermarks import (
    MUST_RISE,
    NOT_LOWERED,
    Refusal,
    WatermarkTriggers,
    refusal_in_message,
)
from .. import get_backend
from ..base import (
    GrantPoint,
)
from ..dialect import Dialect, Replication
from .frozen import MIGRATION_SQL
from .functions import (
    CURRENT_TIMELINE_SQL,
    FAILOVER_GUARD_FUNCTION,
    IDLE_SESSION_ENDED,
    LOST_SESSION,
)
from .grant_point import PostgreSQLGrantPoint, PostgreSQLOrmGrantPoint
from .install import _permitted
from .triggers import PostgreSQLWatermarkTriggers

# --- the dialect -------------------------------------------------------------------------


REFUSING_RULES = (NOT_LOWERED, MUST_RISE)


class PostgreSQLDialect(Dialect):
    """PostgreSQL: the function grant point (or the ORM one, with LISTEN/NOTIFY),
    its watermark triggers, the server's idle bound and the promotion guard."""

    name = "postgresql"
    migration_sql = MIGRATION_SQL

    def _lost(self, error: BaseException) -> bool:
        sqlstate = getattr(error.__cause__, "sqlstate", None)
        return sqlstate is None or sqlstate.startswith(LOST_SESSION)

    def ended_for_idling(self, error: BaseException) -> bool:
        # The server sends SQLSTATE 25P03 before it closes the connection; a client
        # that wakes up later may instead only see the connection gone.
        seen: BaseException | None = error
        while seen is not None:
            if getattr(seen, "sqlstate", None) == IDLE_SESSION_ENDED or (
                "idle-in-transaction" in str(seen)
            ):
                return True
            seen = seen.__cause__
        return False

    def watermark_refusal(self, error: BaseException) -> Refusal | None:
        # The trigger's error names the rule as its constraint and the row and both
        # watermarks as JSON in its detail.
        diag = getattr(error.__cause__, "diag", None)
        constraint = getattr(diag, "constraint_name", None)
        if constraint not in REFUSING_RULES:
            return refusal_in_message(error)
        try:
            detail = json.loads(getattr(diag, "message_detail", None) or "")
            return Refusal(
                constraint, str(detail["table"]), detail["pk"],
                tuple(int(value) for value in detail["old"]),
                tuple(int(value) for value in detail["new"]),
            )
        except (ValueError, KeyError, TypeError):
            return Refusal(constraint, str(getattr(diag, "table_name", "") or ""))

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

    def insert_without_flush_wait(self, connection: BaseDatabaseWrapper, record: Model) -> None:
        if connection.in_atomic_block or not connection.get_autocommit():
            super().insert_without_flush_wait(connection, record)
            return
        # One statement, its own transaction: set_config(..., true) applies to
        # that transaction's commit only, as in coordination_release.
        fields = [f for f in record._meta.concrete_fields if not f.primary_key]
        query = InsertQuery(type(record))
        query.insert_values(fields, [record])
        with connection.cursor() as cursor:
            for sql, params in query.get_compiler(connection=connection).as_sql():
                cursor.execute(
                    f"WITH inserted AS ({sql} RETURNING 1) "
                    "SELECT set_config('synchronous_commit', 'off', true) FROM inserted",
                    params,
                )

    def codepoint_order(self, field: str) -> Any:
        # The "C" collation: the database's default may sort case and punctuation otherwise.
        return Collate(F(field), "C")

    def check_settings(self, alias: str, config: Mapping[str, Any]) -> list[CheckMessage]:
        """E008: psycopg 3 missing. Django also runs PostgreSQL on psycopg2, which
        many sites have installed; the grant point calls psycopg 3 directly, so
        without it ``check`` would pass and the first acquire fail."""
        if importlib.util.find_spec("psycopg") is not None:
            return []
        return [
            Error(
                f"The grant point's database {alias!r} is PostgreSQL and psycopg 3 is not "
                "installed: Django runs it on psycopg2, but the grant point needs psycopg 3 "
                "(every acquire would fail with \"No module named 'psycopg'\").",
                hint="pip install 'django-coordination[postgres]' (psycopg 3 with its binary). "
                "Django then uses psycopg 3; code of yours that imports psycopg2 keeps working.",
                id="coordination.E008",
            )
        ]

    def replication(self, connection: BaseDatabaseWrapper) -> Replication | None:
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT (SELECT count(*) FROM pg_stat_replication), "
                "current_setting('synchronous_standby_names') <> '' "
                "AND current_setting('synchronous_commit') NOT IN ('off', 'local'), "
                f"to_regprocedure('{FAILOVER_GUARD_FUNCTION}(bigint, bigint)') IS NOT NULL"
            )
            replicas, synchronous, guard_installed = cursor.fetchone()
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
