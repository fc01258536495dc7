"""The bench schema, its database and settings, forked clients, the machine."""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import platform
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from django.apps import apps
from django.db import connections, models

from coordination.backends import postgresql, triggers
from coordination.conf import app_settings
from coordination.models import Grant, Lock, Ticket, TokenFloor

BENCH_ALIAS = "coordination_bench"
# One schema per run: runs side by side never drop each other's tables.
BENCH_SCHEMA = f"coordination_bench_{os.getpid()}"

# One operation of a client: returns True if it did its work (a full acquire +
# release cycle), False if it was refused (the hot key was busy) and retried.
Operation = Callable[[], bool]
# Builds a client's operation inside the forked process (connections are made there).
ClientFactory = Callable[[int], Operation]


@dataclass
class BenchConfig:
    clients: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16])
    duration: float = 3.0
    rounds: int = 3
    fenced_rounds: int = 2000
    scale_small: int = 1_000
    scale_large: int = 1_000_000
    scale_grants: int = 10_000_000
    scale_samples: int = 2000
    redis_url: str | None = None
    # The optional consensus peers: etcd's v3 JSON gateway, ZooKeeper's hosts.
    etcd_url: str | None = None
    zookeeper: str | None = None
    scale_database: str | None = None
    include_scale: bool = True
    wakeup_samples: int = 30
    fair_threads: int = 8
    celery_rounds: int = 400
    celery_work_ms: float = 10.0
    statement_cycles: int = 3000
    cpu_cycles: int = 1000
    cpu_blocks: int = 9
    celery: bool = True
    # The stores part: writes of each kind, and an S3 endpoint (None: moto's server).
    store_writes: int = 300
    s3_endpoint: str | None = None
    # The cycle systems to run (None: all); the floors always run, as every
    # ratio is taken against them.
    systems: list[str] | None = None


def bench_models() -> list[type[models.Model]]:
    found: list[type[models.Model]] = [Lock, Grant, Ticket, TokenFloor]
    # Every table a fenced write or a fenced task may touch: a deleted account's
    # tombstone, the task's job policy (read at each execution) and its tallies,
    # the record of each execution (written after its acquire), the records of a
    # ``once`` task and the worker's report of its fenced tasks.
    labels = (
        "coordination.AcceptedWrite", "coordination.Rejection", "coordination.Tombstone",
        "coordination.UnfencedSave", "coordination.JobPolicy", "coordination.JobPolicyChange",
        "coordination.JobTally", "coordination.IdempotencyRecord", "coordination.Execution",
        "coordination.ReportedTask", "demo.Account",
    )
    for label in labels:
        with contextlib.suppress(LookupError):
            found.append(apps.get_model(label))
    return found


@contextlib.contextmanager
def bench_settings(alias: str, **overrides: Any) -> Iterator[None]:
    """COORDINATION pointing at the bench alias, with the app's defaults otherwise."""
    from django.conf import settings
    from django.test import override_settings

    values = {**getattr(settings, "COORDINATION", {}), "DATABASE": alias, **overrides}
    with override_settings(COORDINATION=values):
        yield


def fenced_model() -> type[models.Model] | None:
    try:
        return apps.get_model("demo", "Account")
    except LookupError:
        return None


@contextlib.contextmanager
def bench_database(
    database: str | None = None,
    *,
    keep: bool = False,
    schema: str = BENCH_SCHEMA,
    alias: str = BENCH_ALIAS,
) -> Iterator[str]:
    """An alias whose tables are fresh copies of the app's, in a schema of their own.

    On PostgreSQL: ``schema`` of the configured database (or of ``database``,
    created if missing), dropped on exit unless ``keep``. On SQLite: a file next
    to the configured one. Several can be open at once under different aliases
    and schemas (the row-count runs keep a small and a large one side by side).
    """
    base = dict(connections.databases[app_settings.DATABASE])
    vendor = connections[app_settings.DATABASE].vendor
    if vendor == "postgresql":
        if database:
            _create_database(database)
            base["NAME"] = database
        options = dict(base.get("OPTIONS", {}))
        options["options"] = f"-c search_path={schema}"
        # Names the schema's sessions, so that the exit can end any left running.
        options["application_name"] = schema
        base["OPTIONS"] = options
        _run_admin_sql(base, [f"DROP SCHEMA IF EXISTS {schema} CASCADE",
                              f"CREATE SCHEMA {schema}"])
    elif vendor == "mysql":
        # A database of its own (MariaDB's schemas are databases), dropped on exit.
        from .mariadb import mariadb_database

        own_database = mariadb_database(base, schema, keep=keep)
        own_database.__enter__()
    else:
        name = str(base["NAME"])
        base["NAME"] = (name.rsplit(".", 1)[0] if "." in name else name) + "-bench.sqlite3"
        with contextlib.suppress(FileNotFoundError):
            os.unlink(base["NAME"])
    base["CONN_MAX_AGE"] = None
    base["TEST"] = {"NAME": base["NAME"]}
    # Django's handler keeps the configured DATABASES dict itself: the alias
    # exists from here on, in this process and in the clients it forks.
    connections.databases[alias] = base
    try:
        with connections[alias].schema_editor() as editor:
            for model in bench_models():
                editor.create_model(model)
        # As migrate leaves a real schema: the watermark triggers are part of what a write costs.
        triggers.install_for_models(connections[alias], bench_models())
        if vendor == "postgresql":
            postgresql.install_for_models(connections[alias])
            postgresql.leave_room_for_updates(connections[alias], Lock)
            with connections[alias].cursor() as cursor:
                cursor.execute(
                    "CREATE TABLE floor_lock (key text PRIMARY KEY, token bigint NOT NULL DEFAULT 0,"
                    " holder text NOT NULL DEFAULT '', lease text NOT NULL DEFAULT '',"
                    " expires_at timestamptz)"
                )
                # The floor with history: a grant row per grant, with what the
                # grant history's table has (a unique (lock, token) index, an
                # index on acquired_at, a foreign key checked at commit).
                cursor.execute(
                    "CREATE TABLE floor_grant (id bigserial PRIMARY KEY,"
                    " lock_key text NOT NULL REFERENCES floor_lock (key) DEFERRABLE INITIALLY DEFERRED,"
                    " token bigint NOT NULL, holder text NOT NULL, lease text NOT NULL,"
                    " acquired_at timestamptz NOT NULL, expires_at timestamptz NOT NULL,"
                    " ended_at timestamptz, UNIQUE (lock_key, token))"
                )
                cursor.execute("CREATE INDEX floor_grant_acquired ON floor_grant (acquired_at)")
        if vendor == "mysql":
            from .mariadb import create_floor_tables

            create_floor_tables(alias)
        connections[alias].close()
        yield alias
    finally:
        connections[alias].close()
        del connections[alias]
        del connections.databases[alias]
        if not keep:
            if vendor == "postgresql":
                # A statement an interrupt did not cancel (a load the signal hit
                # between psycopg's send and its wait) keeps running on the server
                # after its client closed, holding the locks the DROP waits for.
                _run_admin_sql(base, [
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                    f" WHERE application_name = '{schema}' AND pid <> pg_backend_pid()",
                    f"DROP SCHEMA IF EXISTS {schema} CASCADE",
                ])
            elif vendor == "mysql":
                own_database.__exit__(None, None, None)
            else:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(str(base["NAME"]))


def _connect(settings: dict[str, Any]) -> Any:
    """A plain psycopg connection (autocommit, server-side binding) for the baselines."""
    import psycopg
    from django.db.backends.postgresql.base import DatabaseWrapper

    params = DatabaseWrapper(settings, alias="coordination_bench_raw").get_connection_params()
    # psycopg's own defaults (statements prepared after 5 runs), not Django's.
    for django_only in ("cursor_factory", "context", "server_side_binding", "prepare_threshold"):
        params.pop(django_only, None)
    return psycopg.connect(**params, autocommit=True)


def _run_admin_sql(settings: dict[str, Any], statements: list[str]) -> None:
    plain = dict(settings)
    plain["OPTIONS"] = {k: v for k, v in settings.get("OPTIONS", {}).items() if k != "options"}
    with _connect(plain) as conn:
        for statement in statements:
            conn.execute(statement)


def _create_database(name: str) -> None:
    settings = dict(connections.databases[app_settings.DATABASE])
    with _connect(settings) as conn:
        if conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [name]).fetchone() is None:
            conn.execute(f'CREATE DATABASE "{name}"')


def _client_process(
    factory: ClientFactory, index: int, ready: Any, start: Any, stop_at: Any, results: Any
) -> None:
    logging.getLogger("coordination").setLevel(logging.WARNING)
    logging.getLogger("redis_lock").setLevel(logging.ERROR)  # "Failed to acquire" per refusal
    try:
        operation = factory(index)
        operation()  # warm up: connect, prepare
        ready.wait()
        start.wait()
        deadline = stop_at.value
        latencies: list[float] = []
        done = refused = 0
        clock = time.perf_counter
        while True:
            began = clock()
            if began >= deadline:
                break
            if operation():
                latencies.append(clock() - began)
                done += 1
            else:
                refused += 1
        results.put((index, done, refused, latencies, None))
    except BaseException as error:  # reported to the parent, which fails the run
        results.put((index, 0, 0, [], f"{type(error).__name__}: {error}"))
    finally:
        connections.close_all()


def run_clients(factory: ClientFactory, clients: int, duration: float) -> dict[str, Any]:
    """Run ``clients`` forked processes for ``duration`` seconds; ops/s and latency."""
    context = multiprocessing.get_context("fork")
    connections.close_all()  # children must open their own connections
    ready, start = context.Barrier(clients + 1), context.Barrier(clients + 1)
    stop_at = context.Value("d", 0.0)
    results = context.Queue()
    processes = [
        context.Process(target=_client_process, args=(factory, i, ready, start, stop_at, results))
        for i in range(clients)
    ]
    for process in processes:
        process.start()
    try:
        ready.wait(timeout=120)
        # perf_counter is CLOCK_MONOTONIC, shared by forked children on Linux.
        began = time.perf_counter()
        stop_at.value = began + duration
        start.wait(timeout=30)
    except Exception as error:
        for process in processes:
            process.kill()
        raise RuntimeError("bench clients did not start") from error
    collected = [results.get(timeout=duration + 120) for _ in processes]
    elapsed = time.perf_counter() - began
    for process in processes:
        process.join(30)
    errors = [error for *_, error in collected if error]
    if errors:
        raise RuntimeError(f"a bench client failed: {errors[0]}")
    latencies = sorted(value for *_, values, _ in collected for value in values)
    done = sum(item[1] for item in collected)
    return {
        "clients": clients,
        "ops": done,
        "refused": sum(item[2] for item in collected),
        "seconds": round(elapsed, 3),
        "ops_per_s": round(done / elapsed, 1),
        "p50_ms": _percentile_ms(latencies, 0.50),
        "p99_ms": _percentile_ms(latencies, 0.99),
    }


def _percentile_ms(ordered: list[float], fraction: float) -> float | None:
    if not ordered:
        return None
    index = min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))
    return round(ordered[index] * 1000, 3)


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
    }
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as cpuinfo:
        for line in cpuinfo:
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    import django

    info["django"] = django.get_version()
    connection = connections[app_settings.DATABASE]
    info["database"] = connection.vendor
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("SHOW server_version")
            info["postgresql"] = cursor.fetchone()[0]
            cursor.execute("SHOW fsync")
            info["fsync"] = cursor.fetchone()[0]
    elif connection.vendor == "mysql":
        from .mariadb import server_version

        info["mariadb"], info["innodb_flush_log_at_trx_commit"] = server_version(connection)
    return info
