"""The bench on MariaDB: its database, its raw SQL floors, the app's procedures by MySQLdb.

The layers are those of the PostgreSQL bench, in MariaDB's SQL:

- ``raw_sql_floor``: MySQLdb alone in autocommit. One ``INSERT ... ON DUPLICATE
  KEY UPDATE`` that bumps the token only when the lease is free or expired, one
  ``SELECT`` of the row (the token, and whether the lease is the caller's), one
  ``UPDATE`` to release: three statements, two commits.
- ``floor_with_history``: the same, with the grant history's writes: the
  ``SELECT`` becomes an ``INSERT ... SELECT ... RETURNING`` of the grant row,
  and the release one multi-table ``UPDATE`` of the lock and its grant row
  (MariaDB has no data-changing CTE): three statements, three commits.
- ``app_functions``: MySQLdb calling the app's two stored procedures on the
  app's schema, with no Django: what the schema and the procedure bodies cost,
  without the library's Python.

Every layer commits as the server is configured; the figures in the docs are
from a server whose commits are durable, as MariaDB's defaults are
(``innodb_flush_log_at_trx_commit = 1``; ``bin/bench-mariadb.sh`` starts one),
and the run's JSON records the setting.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

from django.db import connections

from coordination.backends import mysql
from coordination.models import MAX_TOKEN

from .common import BENCH_ALIAS, ClientFactory, Operation

__all__ = [
    "app_procedures_client",
    "bench_database_name",
    "connect",
    "create_floor_tables",
    "floor_client",
    "mariadb_database",
    "server_version",
]

FLOOR_TABLES = (
    "CREATE TABLE floor_lock (`key` varchar(200) PRIMARY KEY, token bigint NOT NULL DEFAULT 0,"
    " holder varchar(200) NOT NULL DEFAULT '', lease varchar(64) NOT NULL DEFAULT '',"
    " expires_at datetime(6)) ENGINE=InnoDB",
    # As the grant history's table: a unique (lock, token) index, an index on
    # acquired_at, a foreign key to the lock.
    "CREATE TABLE floor_grant (id bigint AUTO_INCREMENT PRIMARY KEY,"
    " lock_key varchar(200) NOT NULL, token bigint NOT NULL, holder varchar(200) NOT NULL,"
    " lease varchar(64) NOT NULL, acquired_at datetime(6) NOT NULL,"
    " expires_at datetime(6) NOT NULL, ended_at datetime(6),"
    " UNIQUE KEY floor_grant_token (lock_key, token), KEY floor_grant_acquired (acquired_at),"
    " FOREIGN KEY (lock_key) REFERENCES floor_lock (`key`)) ENGINE=InnoDB",
)

# The assignments run left to right, each seeing the ones before: the token and
# the lease are decided on the row as it was; holder and expiry follow the lease.
FLOOR_ACQUIRE = """
INSERT INTO floor_lock (`key`, token, holder, lease, expires_at)
VALUES (%s, 1, %s, %s, UTC_TIMESTAMP(6) + INTERVAL 30 SECOND)
ON DUPLICATE KEY UPDATE
    token = IF(holder = '' OR expires_at <= UTC_TIMESTAMP(6), token + 1, token),
    lease = IF(holder = '' OR expires_at <= UTC_TIMESTAMP(6), VALUES(lease), lease),
    holder = IF(lease = VALUES(lease), VALUES(holder), holder),
    expires_at = IF(lease = VALUES(lease), VALUES(expires_at), expires_at)
"""
FLOOR_READ = "SELECT token FROM floor_lock WHERE `key` = %s AND lease = %s"
FLOOR_RELEASE = (
    "UPDATE floor_lock SET holder = '', lease = '', expires_at = NULL"
    " WHERE `key` = %s AND token = %s AND lease = %s"
)
HISTORY_READ = """
INSERT INTO floor_grant (lock_key, token, holder, lease, acquired_at, expires_at)
SELECT `key`, token, holder, lease, UTC_TIMESTAMP(6), expires_at FROM floor_lock
WHERE `key` = %s AND lease = %s
RETURNING token
"""
HISTORY_RELEASE = """
UPDATE floor_lock AS l JOIN floor_grant AS g ON g.lock_key = l.`key` AND g.token = l.token
SET l.holder = '', l.lease = '', l.expires_at = NULL, g.ended_at = UTC_TIMESTAMP(6)
WHERE l.`key` = %s AND l.token = %s AND l.lease = %s
"""


def connect(settings: dict[str, Any]) -> Any:
    """A plain MySQLdb connection in autocommit, with the parameters and the
    isolation level Django would use: READ COMMITTED, as the library's own
    connection runs (coordination.E006), not the server's REPEATABLE READ."""
    from django.db.backends.mysql.base import DatabaseWrapper

    wrapper = DatabaseWrapper(settings, alias="coordination_bench_raw")
    conn = wrapper.get_new_connection(wrapper.get_connection_params())
    if wrapper.isolation_level:
        conn.query(f"SET SESSION TRANSACTION ISOLATION LEVEL {wrapper.isolation_level.upper()}")
    conn.autocommit(True)
    return conn


def bench_database_name(settings: dict[str, Any], schema: str) -> str:
    return f"{settings['NAME']}_{schema}"[:64]


@contextlib.contextmanager
def mariadb_database(base: dict[str, Any], schema: str, *, keep: bool = False) -> Iterator[None]:
    """A database of the bench's own (``<NAME>_<schema>``, binary keys) in ``base``,
    which is pointed at it; dropped on exit unless ``keep``."""
    admin = connect(dict(base))
    name = bench_database_name(base, schema)
    cursor = admin.cursor()
    try:
        cursor.execute(f"DROP DATABASE IF EXISTS `{name}`")
        cursor.execute(
            f"CREATE DATABASE `{name}` CHARACTER SET utf8mb4 COLLATE {mysql.COLLATION}"
        )
        base["NAME"] = name
        yield
    finally:
        if not keep:
            cursor.execute(f"DROP DATABASE IF EXISTS `{name}`")
        admin.close()


def create_floor_tables(alias: str) -> None:
    """The floors' tables and today's procedures, in the bench's database."""
    connection = connections[alias]
    mysql.install(connection)
    with connection.cursor() as cursor:
        for statement in FLOOR_TABLES:
            cursor.execute(statement)


def floor_client(hot: bool, *, history: bool = False) -> ClientFactory:
    """The raw SQL floor on MariaDB (see the module docstring); with ``history``,
    the grant row is written with the grant and closed with the release."""
    read_sql, release_sql = (HISTORY_READ, HISTORY_RELEASE) if history else (FLOOR_READ, FLOOR_RELEASE)

    def make(index: int) -> Operation:
        cursor = connect(connections.databases[BENCH_ALIAS]).cursor()
        keys = ["bench-hot"] if hot else [f"bench-{index}-{n}" for n in range(64)]
        counter = iter(range(10**12))
        holder = f"client-{index}"

        def cycle() -> bool:
            key = keys[next(counter) % len(keys)]
            lease = os.urandom(16).hex()
            cursor.execute(FLOOR_ACQUIRE, (key, holder, lease))
            cursor.execute(read_sql, (key, lease))
            row = cursor.fetchone()
            if row is None:
                return False
            cursor.execute(release_sql, (key, row[0], lease))
            return True

        return cycle

    return make


def app_procedures_client(hot: bool) -> ClientFactory:
    """MySQLdb calling the app's procedures on the app's schema, with no Django.
    The lease is a random string passed as its hash."""

    def make(index: int) -> Operation:
        cursor = connect(connections.databases[BENCH_ALIAS]).cursor()
        keys = ["bench-hot"] if hot else [f"bench-{index}-{n}" for n in range(64)]
        counter = iter(range(10**12))
        holder = f"client-{index}"

        def call(sql: str, params: tuple[Any, ...]) -> Any:
            cursor.execute(sql, params)
            row = cursor.fetchone()
            while cursor.nextset():
                pass
            return row

        def cycle() -> bool:
            key = keys[next(counter) % len(keys)]
            lease = os.urandom(16).hex()
            row = call(mysql.ACQUIRE, (key, holder, lease, 30.0, 0.0, MAX_TOKEN, MAX_TOKEN))
            if not row[0]:
                return False
            call(mysql.RELEASE, (key, row[1], lease))  # granted: (True, token, ...)
            return True

        return cycle

    return make


def server_version(connection: Any) -> tuple[str, str]:
    """The server's version and its ``innodb_flush_log_at_trx_commit``."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT VERSION(), @@innodb_flush_log_at_trx_commit")
        version, flush = cursor.fetchone()
    return str(version), str(flush)
