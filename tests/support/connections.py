"""Cutting a test's own database session, as a failover cuts every session of the
old primary."""

from __future__ import annotations

import psycopg
from django.db import connection


def cut_this_connection() -> None:
    """Terminate this thread's server process from another connection, as a
    failover does to every connection of the old primary."""
    connection.ensure_connection()
    pid = connection.connection.info.backend_pid
    params = connection.get_connection_params()
    for django_only in ("cursor_factory", "context", "server_side_binding"):
        params.pop(django_only, None)
    with psycopg.connect(**params, autocommit=True) as other:
        other.execute("SELECT pg_terminate_backend(%s)", (pid,))
