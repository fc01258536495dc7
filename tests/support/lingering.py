"""Which sessions still use the PostgreSQL test database when a run ends.

pytest-django drops the test database at the end; a session some process left
open (a worker that outlived its test, a thread's connection) makes that fail
with "being accessed by other users", which names no one. This lists them, so
the run's summary says whose they are (workers' sessions carry their own
``application_name``).
"""

from __future__ import annotations

from contextlib import suppress

from django.db import connection


def lingering_sessions() -> list[str]:
    """One line per other session on the test database, or none (not PostgreSQL,
    no test database, or the server cannot tell)."""
    if connection.vendor != "postgresql":
        return []
    with suppress(Exception):
        import psycopg

        # After a failed drop the settings may still name the test database itself.
        current = connection.settings_dict["NAME"]
        name = connection.settings_dict.get("TEST", {}).get("NAME") or (
            current if current.startswith("test_") else f"test_{current}"
        )
        params = {**connection.get_connection_params(), "dbname": "postgres"}
        params.pop("cursor_factory", None)
        params.pop("context", None)
        params.pop("prepare_threshold", None)
        with psycopg.connect(**params, autocommit=True) as server:
            rows = server.execute(
                "SELECT pid, application_name, state, backend_start, left(query, 100) "
                "FROM pg_stat_activity WHERE datname = %s AND pid <> pg_backend_pid() "
                "ORDER BY backend_start",
                [name],
            ).fetchall()
        return [
            f"{name}: pid {pid} app {app or '-'} {state} since {started:%H:%M:%S}: {query}"
            for pid, app, state, started, query in rows
        ]
    return []
