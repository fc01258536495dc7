"""The bench's MariaDB layers (``project/lab/benchmarks/mariadb.py``): on a
database of the bench's own, each layer's cycle grants a token and releases it,
every key of a client taken again after its release, on connections that run the
library's isolation level. Nothing is timed."""

from __future__ import annotations

from typing import Any

import pytest
from django.db import connections

from project.lab import benchmarks
from project.lab.benchmarks import mariadb

pytestmark = pytest.mark.legs("mariadb", reason="the MariaDB bench's own SQL and the app's procedures")

CYCLES = 130  # each client cycles over 64 keys of its own: every key twice, some three times


@pytest.mark.usefixtures("django_db_setup")
def test_each_mariadb_layer_grants_and_releases_every_cycle(django_db_blocker: Any) -> None:
    # The bench adds an alias of its own, for a database it makes and drops:
    # outside a test case's list of databases.
    with django_db_blocker.unblock(), benchmarks.bench_database() as alias:
        layers = {
            "raw_sql_floor": mariadb.floor_client(False),
            "floor_with_history": mariadb.floor_client(False, history=True),
            "app_functions": mariadb.app_procedures_client(False),
        }
        for name, make in layers.items():
            cycle = make(0)
            assert all(cycle() for _ in range(CYCLES)), name
        raw = mariadb.connect(dict(connections.databases[alias]))
        try:
            cursor = raw.cursor()
            cursor.execute("SELECT @@tx_isolation")
            assert cursor.fetchone() == ("READ-COMMITTED",)  # as the library's connection
            # The floors: one row per key, its token bumped once per grant, free again.
            cursor.execute("SELECT COUNT(*), SUM(token), SUM(holder <> '') FROM floor_lock")
            assert cursor.fetchone() == (64, 2 * CYCLES, 0)
            cursor.execute("SELECT COUNT(*), SUM(ended_at IS NOT NULL) FROM floor_grant")
            assert cursor.fetchone() == (CYCLES, CYCLES)
            # The procedures: a grant row per cycle, each closed by its release.
            cursor.execute("SELECT end_reason, COUNT(*) FROM coordination_grant GROUP BY end_reason")
            assert cursor.fetchall() == (("released", CYCLES),)
        finally:
            raw.close()
