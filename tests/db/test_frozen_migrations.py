"""Migrations are history: each runs the SQL of its own time, and ``migrate`` ends
with exactly today's functions (PostgreSQL) and procedures (MariaDB).

The test database was made by ``migrate``, whose steps ran their frozen copies
(``coordination.backends.postgresql.frozen``, ``coordination.backends.mysql.frozen``).
Re-creating the functions with today's installer must change none of their
definitions: if today's SQL moved on, a new migration must freeze and run it.
"""

from __future__ import annotations

import pytest
from django.apps import apps
from django.db import connection, router, transaction

from coordination import watermarks
from coordination.backends import dialect_of, mysql, postgresql, triggers
from coordination.backends.postgresql.frozen import MIGRATION_SQL

pytestmark = [pytest.mark.django_db]


def definitions() -> dict[str, str]:
    """Every function of the app and every non-internal trigger: name -> definition."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT p.oid::regprocedure::text, pg_get_functiondef(p.oid) FROM pg_proc p "
            "WHERE p.proname LIKE 'coordination%%' AND p.pronamespace = 'public'::regnamespace"
        )
        found = dict(cursor.fetchall())
        cursor.execute(
            "SELECT t.tgname, pg_get_triggerdef(t.oid) FROM pg_trigger t WHERE NOT t.tgisinternal"
        )
        found.update(cursor.fetchall())
    return found


@pytest.mark.postgres
def test_migrate_ends_with_exactly_todays_functions() -> None:
    migrated = definitions()
    assert {"coordination_acquire", "coordination_release", "coordination_failover_guard"} <= {
        name.partition("(")[0] for name in migrated
    }
    with transaction.atomic():
        postgresql.install(connection)
        assert definitions() == migrated
        transaction.set_rollback(True)


@pytest.mark.postgres
def test_todays_functions_are_those_of_the_latest_migration_that_creates_them() -> None:
    ran: list[str] = []

    class Recorder:
        ops = connection.ops

        def cursor(self) -> Recorder:
            return self

        def __enter__(self) -> Recorder:
            return self

        def __exit__(self, *exc: object) -> None:
            return None

        def execute(self, sql: str, *params: object) -> None:
            ran.append(sql)

    postgresql.install(Recorder())  # type: ignore[arg-type]
    latest = [step for step, frozen in MIGRATION_SQL.items() if frozen.functions]
    assert tuple(ran) == MIGRATION_SQL[latest[-1]].statements


@pytest.mark.postgres
def test_an_old_migration_keeps_its_own_sql() -> None:
    # 0006 ran before the token floor existed: its acquire reads none.
    (acquire,) = (
        statement for statement in MIGRATION_SQL["0006_grant_point_functions"].statements
        if "FUNCTION coordination_acquire" in statement
    )
    assert "coordination_tokenfloor" not in acquire
    assert "token_floor := 0;" in acquire


def test_a_step_with_no_frozen_sql_runs_nothing() -> None:
    assert dialect_of(connection).run_migration_sql(connection, "0001_initial") is False


def test_migrate_ends_with_todays_watermark_triggers() -> None:
    # 0007 and 0008 ran their frozen triggers; the post_migrate receiver made
    # every one today's (it compares fingerprints and changes what differs).
    models = [model for model in apps.get_models() if router.allow_migrate_model("default", model)]
    assert triggers.missing(connection, watermarks.watermarks_of(models)) == []
    with transaction.atomic():
        assert triggers.install_for_models(connection) == []
        transaction.set_rollback(True)


@pytest.mark.legs(
    "pg", "sqlite", "lts",
    reason="MariaDB came after these migrations: its triggers are only today's (post_migrate)",
)
def test_old_trigger_migrations_keep_their_own_sql() -> None:
    # 0007 guards the lock and the fence; the token floor came with 0008.
    frozen = dialect_of(connection).migration_sql
    sql_0007 = " ".join(frozen["0007_watermark_triggers"].statements)
    assert "coordination_lock_watermark_not_lowered" in sql_0007
    assert "coordination_fence_watermark_not_lowered" in sql_0007
    assert "coordination_tokenfloor" not in sql_0007
    assert "coordination_tokenfloor" in " ".join(frozen["0008_token_floor.triggers"].statements)


@pytest.mark.postgres
def test_a_migration_goes_on_where_the_app_may_not_create_functions() -> None:
    with connection.cursor() as cursor:
        cursor.execute("CREATE ROLE coordination_frozen_no_functions NOLOGIN")
        cursor.execute("GRANT USAGE ON SCHEMA public TO coordination_frozen_no_functions")
        cursor.execute("SET LOCAL ROLE coordination_frozen_no_functions")
    try:
        ran = dialect_of(connection).run_migration_sql(connection, "0014_release_without_flush_wait")
    finally:
        with connection.cursor() as cursor:
            cursor.execute("RESET ROLE")
    assert ran is False
    # The refused statements were in a savepoint: the migration's transaction goes on.
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1")
        assert cursor.fetchone() == (1,)


# --- MariaDB: the grant point's stored procedures ------------------------------------


def procedures() -> dict[str, str]:
    """Every stored procedure of the app in this database: name -> definition."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT ROUTINE_NAME FROM information_schema.ROUTINES"
            " WHERE ROUTINE_SCHEMA = DATABASE() AND ROUTINE_NAME LIKE 'coordination\\_%'"
        )
        names = sorted(name for (name,) in cursor.fetchall())
        found = {}
        for name in names:
            cursor.execute(f"SHOW CREATE PROCEDURE {connection.ops.quote_name(name)}")
            found[name] = cursor.fetchone()[2]
    return found


@pytest.mark.django_db(transaction=True)  # CREATE PROCEDURE commits whatever is open
@pytest.mark.legs("mariadb", reason="the grant point's stored procedures are MariaDB's")
def test_migrate_ends_with_exactly_todays_procedures() -> None:
    migrated = procedures()
    assert set(migrated) == {"coordination_acquire", "coordination_release"}
    mysql.install(connection)
    assert procedures() == migrated


@pytest.mark.legs("mariadb", reason="the grant point's stored procedures are MariaDB's")
def test_todays_procedures_are_those_of_the_latest_migration_that_creates_them() -> None:
    ran: list[str] = []

    class Recorder:
        ops = connection.ops

        def cursor(self) -> Recorder:
            return self

        def __enter__(self) -> Recorder:
            return self

        def __exit__(self, *exc: object) -> None:
            return None

        def execute(self, sql: str, *params: object) -> None:
            ran.append(sql)

    mysql.install(Recorder())  # type: ignore[arg-type]
    frozen = dialect_of(connection).migration_sql
    latest = [
        step for step, sql in frozen.items() if sql.functions and not step.endswith(".backwards")
    ]
    assert latest[-1] == "0027_mariadb_leaner_grant_procedures"
    assert tuple(ran) == frozen[latest[-1]].statements
