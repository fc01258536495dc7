"""Benchmarks of the grant point and the fences, side by side with their baselines.

Every workload runs in the same invocation as its baselines and is reported as a
ratio to the raw SQL floor: psycopg running one upsert to acquire (returning the
token) and one update to release, with no ORM and no grant history. The peers
are PostgreSQL advisory locks (no token, nothing durable) and python-redis-lock
(no token, no fencing).

All tables live in a schema of their own (``coordination_bench_<pid>``), created with
Django's schema editor and dropped at the end, so a run never touches the
application's locks. Clients are forked processes, each with its own
connection, started together and run for a fixed wall time.

Used by ``manage.py coordination_bench``; the functions here return plain
dicts so that the command can print, chart and dump them as JSON.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import multiprocessing
import os
import platform
import random
import signal
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from django.apps import apps
from django.db import DatabaseError, connections, models, transaction

from coordination import locks
from coordination.backends import postgresql, triggers
from coordination.backends.base import WAKE_UP_CHANNEL
from coordination.conf import app_settings
from coordination.exceptions import LockHeld
from coordination.models import MAX_TOKEN, Grant, Lock, Ticket, TokenFloor

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
    # The cycle systems to run (None: all); the floors always run, as every
    # ratio is taken against them.
    systems: list[str] | None = None


# --- the bench schema ----------------------------------------------------------


def bench_models() -> list[type[models.Model]]:
    found: list[type[models.Model]] = [Lock, Grant, Ticket, TokenFloor]
    # Every table a fenced write or a fenced task may touch: a deleted account's
    # tombstone, the task's job policy (read at each execution) and its tallies.
    labels = (
        "coordination.AcceptedWrite", "coordination.Rejection", "coordination.Tombstone",
        "coordination.UnfencedSave", "coordination.JobPolicy", "coordination.JobPolicyChange",
        "coordination.JobTally", "demo.Account",
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


# --- running clients -----------------------------------------------------------


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


# --- the systems -----------------------------------------------------------------


_client_scopes: list[Any] = []


def locks_client(hot: bool, *, prepared: bool | None = None, grant_point: str | None = None) -> ClientFactory:
    """``locks.acquire`` + ``locks.release``; ``prepared`` overrides
    ``COORDINATION["PREPARED_STATEMENTS"]`` (None: the app's default)."""
    overrides: dict[str, Any] = {"GRANT_POINT": grant_point}
    if prepared is not None:
        overrides["PREPARED_STATEMENTS"] = prepared

    def make(index: int) -> Operation:
        # In the forked client only, for the rest of its life (the reference
        # keeps the override from being closed when the generator is collected).
        scope = bench_settings(BENCH_ALIAS, **overrides)
        scope.__enter__()
        _client_scopes.append(scope)
        keys = ["bench-hot"] if hot else [f"bench-{index}-{n}" for n in range(64)]
        counter = iter(range(10**12))

        def cycle() -> bool:
            key = keys[next(counter) % len(keys)]
            try:
                grant = locks.acquire(key, holder=f"client-{index}", ttl=30, using=BENCH_ALIAS)
            except LockHeld:
                return False
            locks.release(grant, using=BENCH_ALIAS)
            return True

        return cycle

    return make


_FLOOR_ACQUIRE = """
INSERT INTO floor_lock AS l (key, token, holder, lease, expires_at)
VALUES (%(key)s, 1, %(holder)s, %(lease)s, clock_timestamp() + make_interval(secs => %(ttl)s))
ON CONFLICT (key) DO UPDATE SET token = l.token + 1, holder = EXCLUDED.holder,
    lease = EXCLUDED.lease, expires_at = clock_timestamp() + make_interval(secs => %(ttl)s)
WHERE l.holder = '' OR l.expires_at <= clock_timestamp()
RETURNING token
"""
_FLOOR_RELEASE = """
UPDATE floor_lock SET holder = '', lease = '', expires_at = NULL
WHERE key = %(key)s AND token = %(token)s AND lease = %(lease)s
"""


# The floor with history: the same two statements, each also writing what the
# grant history writes (a grant row inserted with the grant, closed with the
# release), one statement each.
_FLOOR_HISTORY_ACQUIRE = f"""
WITH l AS ({_FLOOR_ACQUIRE.strip()}, key, expires_at)
INSERT INTO floor_grant (lock_key, token, holder, lease, acquired_at, expires_at)
SELECT l.key, l.token, %(holder)s, %(lease)s, clock_timestamp(), l.expires_at FROM l
RETURNING token
"""
_FLOOR_HISTORY_RELEASE = f"""
WITH l AS ({_FLOOR_RELEASE.strip()} RETURNING key, token)
UPDATE floor_grant AS g SET ended_at = clock_timestamp()
FROM l WHERE g.lock_key = l.key AND g.token = l.token
"""


def floor_client(hot: bool, *, history: bool = False) -> ClientFactory:
    """The raw SQL floor: one upsert returning the token, one update to release;
    with ``history``, each statement also writes the grant row."""
    acquire_sql, release_sql = (
        (_FLOOR_HISTORY_ACQUIRE, _FLOOR_HISTORY_RELEASE) if history
        else (_FLOOR_ACQUIRE, _FLOOR_RELEASE)
    )

    def make(index: int) -> Operation:
        conn = _connect(connections.databases[BENCH_ALIAS])
        keys = ["bench-hot"] if hot else [f"bench-{index}-{n}" for n in range(64)]
        counter = iter(range(10**12))
        holder = f"client-{index}"

        def cycle() -> bool:
            key = keys[next(counter) % len(keys)]
            lease = os.urandom(16).hex()
            row = conn.execute(
                acquire_sql, {"key": key, "holder": holder, "lease": lease, "ttl": 30.0}
            ).fetchone()
            if row is None:
                return False
            conn.execute(release_sql, {"key": key, "token": row[0], "lease": lease})
            return True

        return cycle

    return make


def app_functions_client(hot: bool) -> ClientFactory:
    """psycopg calling the app's own grant-point functions on the app's schema,
    prepared, with no Django: what the schema and the function bodies cost,
    without the library's Python. The lease is a random string passed as its
    hash (the library's secret and its SHA-256 count as its Python)."""
    acquire_sql, release_sql = postgresql.ACQUIRE, postgresql.RELEASE
    max_token = MAX_TOKEN

    def make(index: int) -> Operation:
        conn = _connect(connections.databases[BENCH_ALIAS])
        keys = ["bench-hot"] if hot else [f"bench-{index}-{n}" for n in range(64)]
        counter = iter(range(10**12))
        holder = f"client-{index}"
        # As the library calls them: the promotion guard runs inside the acquire
        # function, and a release notifies only when a waiter asked.
        execute = conn.execute

        def cycle() -> bool:
            key = keys[next(counter) % len(keys)]
            lease = os.urandom(16).hex()
            row = execute(
                acquire_sql, (key, holder, lease, 30.0, 0.0, max_token, max_token), prepare=True
            ).fetchone()
            if not row[0]:
                return False
            execute(release_sql, (key, row[2], lease, True, WAKE_UP_CHANNEL), prepare=True)
            return True

        return cycle

    return make


def advisory_client(hot: bool) -> ClientFactory:
    def make(index: int) -> Operation:
        conn = _connect(connections.databases[BENCH_ALIAS])
        keys = [7] if hot else [index * 1000 + n for n in range(64)]
        counter = iter(range(10**12))

        def cycle() -> bool:
            key = keys[next(counter) % len(keys)]
            row = conn.execute("SELECT pg_try_advisory_lock(%s)", [key]).fetchone()
            if not row or not row[0]:
                return False
            conn.execute("SELECT pg_advisory_unlock(%s)", [key])
            return True

        return cycle

    return make


def redis_client(url: str, hot: bool) -> ClientFactory:
    def make(index: int) -> Operation:
        import redis
        import redis_lock  # type: ignore[import-untyped]

        client = redis.Redis.from_url(url)
        keys = ["bench-hot"] if hot else [f"bench-{index}-{n}" for n in range(64)]
        counter = iter(range(10**12))

        def cycle() -> bool:
            key = keys[next(counter) % len(keys)]
            lock = redis_lock.Lock(client, key, expire=30)
            if not lock.acquire(blocking=False):
                return False
            lock.release()
            return True

        return cycle

    return make


def etcd_client(url: str, hot: bool) -> ClientFactory:
    """etcd's lease + txn lock, through its v3 JSON gateway on one kept-alive HTTP connection.

    Acquire: grant a lease (its TTL is the lock's expiry), then one txn: if the
    key's ``create_revision`` is 0 (no one holds it), put it attached to the
    lease. The put's revision is the grant's token (it grows with every write
    to the store). Release: delete the key. Three round trips and three raft
    commits (each fsynced) per cycle. The lease of a released lock is left to
    run out, as the brief's recipe does; revoking it would be a fourth commit.
    """

    def make(index: int) -> Operation:
        import base64
        import http.client
        import json
        from urllib.parse import urlsplit

        where = urlsplit(url)
        conn = http.client.HTTPConnection(where.hostname or "127.0.0.1", where.port or 2379, timeout=30)
        keys = [b"bench-hot"] if hot else [f"bench-{index}-{n}".encode() for n in range(64)]
        encoded = [base64.b64encode(key).decode() for key in keys]
        counter = iter(range(10**12))

        def call(path: str, body: dict[str, Any]) -> dict[str, Any]:
            conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
            response = conn.getresponse()
            answer: dict[str, Any] = json.loads(response.read())
            if response.status != 200:
                raise RuntimeError(f"etcd {path}: {response.status} {answer}")
            return answer

        def cycle() -> bool:
            key = encoded[next(counter) % len(encoded)]
            lease = call("/v3/lease/grant", {"TTL": 30})["ID"]
            answer = call("/v3/kv/txn", {
                "compare": [{"key": key, "target": "CREATE", "create_revision": "0"}],
                "success": [{"request_put": {"key": key, "value": "aG9sZGVy", "lease": lease}}],
            })
            if not answer.get("succeeded"):
                return False
            token = int(answer["header"]["revision"])  # the fencing token a resource would check
            assert token > 0
            call("/v3/kv/deleterange", {"key": key})
            return True

        return cycle

    return make


def etcd_available(url: str | None) -> str | None:
    """Why the etcd peer cannot run, or None if etcd answers."""
    if not url:
        return "no etcd URL (--etcd-url or COORDINATION_BENCH_ETCD_URL; bin/bench-peers.sh start runs one)"
    import http.client
    import json
    from urllib.parse import urlsplit

    where = urlsplit(url)
    try:
        conn = http.client.HTTPConnection(where.hostname or "127.0.0.1", where.port or 2379, timeout=3)
        conn.request("POST", "/v3/maintenance/status", "{}")
        response = conn.getresponse()
        status = json.loads(response.read())
        conn.close()
    except (OSError, ValueError) as error:
        return f"etcd at {url} does not answer: {error}"
    if response.status != 200 or "version" not in status:
        return f"etcd at {url} has no v3 JSON gateway: {response.status} {status}"
    return None


def zookeeper_client(hosts: str, hot: bool) -> ClientFactory:
    """kazoo's Lock recipe: an ephemeral sequential node under the lock's path,
    held while it is the lowest; released by deleting it.

    Non-blocking, as the other systems: when another node is lower, kazoo deletes
    its own node again and the attempt counts as refused. The node's sequence
    number grows per lock and could serve as a token; the recipe does not hand
    it to the caller as one. The lock lives as long as the client's session.
    """

    def make(index: int) -> Operation:
        from kazoo.client import KazooClient  # type: ignore[import-untyped]

        logging.getLogger("kazoo").setLevel(logging.WARNING)
        client = KazooClient(hosts=hosts, timeout=30)
        client.start(timeout=30)
        root = f"/{BENCH_SCHEMA}"
        paths = [f"{root}/hot"] if hot else [f"{root}/{index}-{n}" for n in range(64)]
        for path in paths:  # created once here, as a long-lived service would have them
            client.ensure_path(path)
        locks_by_path = {path: client.Lock(path, f"client-{index}") for path in paths}
        counter = iter(range(10**12))

        def cycle() -> bool:
            lock = locks_by_path[paths[next(counter) % len(paths)]]
            if not lock.acquire(blocking=False):
                return False
            lock.release()
            return True

        return cycle

    return make


def zookeeper_available(hosts: str | None) -> str | None:
    """Why the ZooKeeper peer cannot run, or None if it answers."""
    if not hosts:
        return (
            "no ZooKeeper hosts (--zookeeper or COORDINATION_BENCH_ZOOKEEPER; "
            "bin/bench-peers.sh start runs one)"
        )
    try:
        from kazoo.client import KazooClient
    except ImportError:
        return "kazoo is not installed (requirements/tools.txt pins it)"
    client = KazooClient(hosts=hosts, timeout=3)
    try:
        client.start(timeout=3)
    except Exception as error:
        return f"ZooKeeper at {hosts} does not answer: {error}"
    finally:
        with contextlib.suppress(Exception):
            client.stop()
            client.close()
    return None


def zookeeper_cleanup(hosts: str) -> None:
    """Delete the run's lock paths (the nodes of released locks leave their parents)."""
    from kazoo.client import KazooClient

    client = KazooClient(hosts=hosts, timeout=10)
    try:
        client.start(timeout=10)
        client.delete(f"/{BENCH_SCHEMA}", recursive=True)
    except Exception:  # a missing path or a gone server leaves nothing to clean
        pass
    finally:
        with contextlib.suppress(Exception):
            client.stop()
            client.close()


def redis_available(url: str | None) -> str | None:
    """Why Redis cannot be used, or None if it answers."""
    if not url:
        return "no Redis URL (--redis-url, COORDINATION_TEST_REDIS_URL or CELERY_BROKER_URL)"
    try:
        import redis

        redis.Redis.from_url(url, socket_connect_timeout=2).ping()
    except Exception as error:
        return f"Redis at {url} does not answer: {error}"
    return None


# What each cycle system gives a caller, shown beside its numbers: a token a
# resource can check (a fence), and whether a granted lock survives a crash of
# the service (written to disk before the grant is returned).
SYSTEM_GIVES: dict[str, dict[str, str]] = {
    "raw_sql_floor": {"token": "yes", "durable": "yes", "note": "baseline; no history"},
    "floor_with_history": {"token": "yes", "durable": "yes", "note": "baseline; grant rows"},
    "app_functions": {"token": "yes", "durable": "yes", "note": "baseline; the app's functions"},
    "locks": {"token": "yes, fenced", "durable": "yes", "note": "grant history"},
    "locks_unprepared": {"token": "yes, fenced", "durable": "yes", "note": "grant history"},
    "locks_orm": {"token": "yes, fenced", "durable": "yes", "note": "grant history"},
    "pg_advisory": {"token": "no", "durable": "no", "note": "held by the session"},
    "redis_lock": {"token": "no", "durable": "no", "note": "in memory, async persistence"},
    "etcd": {"token": "yes, revision", "durable": "yes", "note": "lease + txn, raft fsync"},
    "zookeeper": {"token": "node seq, unused", "durable": "yes", "note": "ephemeral, session"},
}


# --- the suites -------------------------------------------------------------------


def cycle_suite(config: BenchConfig, vendor: str, progress: Callable[[str], None]) -> dict[str, Any]:
    """Acquire + release cycles over many keys and on one hot key, per system."""
    systems: dict[str, Callable[[bool], ClientFactory]] = {"locks": locks_client}
    skipped: dict[str, str] = {}
    if vendor == "postgresql":
        systems = {
            "raw_sql_floor": floor_client,
            "floor_with_history": lambda hot: floor_client(hot, history=True),
            "app_functions": app_functions_client,
            **systems,
            "locks_unprepared": lambda hot: locks_client(hot, prepared=False),
            "locks_orm": lambda hot: locks_client(hot, grant_point="orm"),
            "pg_advisory": advisory_client,
        }
    else:
        for name in ("raw_sql_floor", "floor_with_history", "app_functions", "pg_advisory"):
            skipped[name] = "PostgreSQL only; this run is on SQLite"
    # The peers on servers of their own, each optional; the consensus services
    # are started by the caller (bin/bench-peers.sh).
    peers: list[tuple[str, str | None, Callable[[str | None], str | None],
                      Callable[[str, bool], ClientFactory]]] = [
        ("redis_lock", config.redis_url, redis_available, redis_client),
        ("etcd", config.etcd_url, etcd_available, etcd_client),
        ("zookeeper", config.zookeeper, zookeeper_available, zookeeper_client),
    ]
    for name, address, why_not_for, client in peers:
        why_not = why_not_for(address)
        if why_not is not None:
            skipped[name] = why_not
            continue
        assert address is not None
        systems[name] = functools.partial(client, address)
    if config.systems is not None:
        chosen = {*config.systems, *LAYERS}
        systems = {name: make for name, make in systems.items() if name in chosen}
    results: dict[str, Any] = {}
    try:
        for workload, hot in (("many_keys", False), ("hot_key", True)):
            results[workload] = _cycle_workload(config, systems, hot, workload, progress)
    finally:
        if "zookeeper" in systems and config.zookeeper:
            zookeeper_cleanup(config.zookeeper)
    return {
        "systems": list(systems),
        "layers": [name for name in LAYERS if name in systems],
        "skipped": skipped,
        "gives": {name: SYSTEM_GIVES[name] for name in [*systems, *skipped] if name in SYSTEM_GIVES},
        **results,
    }


# The layers of a cycle, each a baseline for the next: the raw SQL floor; the
# grant history's writes in the same two statements; the app's own schema and
# functions called by psycopg; the library. Each row of a layer carries its
# ratio to the layer below, so the history, the schema and function bodies, and
# the library's Python each have a cost of their own. They always run together.
LAYERS = ("raw_sql_floor", "floor_with_history", "app_functions", "locks")


def _cycle_workload(
    config: BenchConfig,
    systems: dict[str, Callable[[bool], ClientFactory]],
    hot: bool,
    workload: str,
    progress: Callable[[str], None],
) -> dict[str, list[dict[str, Any]]]:
    rows: dict[str, list[dict[str, Any]]] = {name: [] for name in systems}
    for clients in config.clients:
        # Systems side by side in short rounds, in a shuffled order each
        # round, so that load from elsewhere falls on all of them alike;
        # each ratio is taken within a round, then the median is reported.
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in systems}
        for round_number in range(config.rounds):
            order = list(systems)
            random.shuffle(order)
            for name in order:
                progress(f"{workload} {name} x{clients} round {round_number + 1}")
                runs[name].append(run_clients(systems[name](hot), clients, config.duration))
        for name in systems:
            row = _combine(runs[name], runs.get("raw_sql_floor"), runs.get("floor_with_history"))
            if name in LAYERS[1:]:
                below = LAYERS[LAYERS.index(name) - 1]
                row["layer_below"] = below
                row["ratio_to_layer_below"] = _ratio_of(runs[name], runs.get(below))
            rows[name].append(row)
    return rows


def _ratio_of(runs: list[dict[str, Any]], baseline: list[dict[str, Any]] | None) -> float | None:
    """The median of the per-round throughput ratios of ``runs`` to ``baseline``."""
    if not baseline:
        return None
    ratios = [
        run["ops_per_s"] / base["ops_per_s"]
        for run, base in zip(runs, baseline, strict=True)
        if base["ops_per_s"]
    ]
    return round(statistics.median(ratios), 3) if ratios else None


def _combine(
    runs: list[dict[str, Any]],
    floor: list[dict[str, Any]] | None,
    history_floor: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Median of the rounds; a ratio is the median of the per-round ratios (to the
    raw SQL floor, and to the floor with history: what the library's own code costs
    beyond the writes the grant history needs)."""
    combined = {
        "clients": runs[0]["clients"],
        "ops": sum(run["ops"] for run in runs),
        "refused": sum(run["refused"] for run in runs),
        "rounds": len(runs),
        "ops_per_s": round(statistics.median(run["ops_per_s"] for run in runs), 1),
        "ops_per_s_rounds": [run["ops_per_s"] for run in runs],
        "p50_ms": _median_of(run["p50_ms"] for run in runs),
        "p99_ms": _median_of(run["p99_ms"] for run in runs),
        "ratio_to_floor": None,
        "ratio_to_floor_rounds": [],
        "ratio_to_history_floor": None,
    }
    for name, baseline in (("ratio_to_floor", floor), ("ratio_to_history_floor", history_floor)):
        if not baseline:
            continue
        ratios = [
            run["ops_per_s"] / base["ops_per_s"]
            for run, base in zip(runs, baseline, strict=True)
            if base["ops_per_s"]
        ]
        if ratios:
            combined[name] = round(statistics.median(ratios), 3)
            if name == "ratio_to_floor":
                combined["ratio_to_floor_rounds"] = [round(ratio, 3) for ratio in ratios]
    return combined


def statements_suite(config: BenchConfig, alias: str, progress: Callable[[str], None]) -> dict[str, Any]:
    """What each statement of a cycle costs the server, from ``pg_stat_statements``.

    One client over 64 keys runs ``config.statement_cycles`` cycles of the raw
    SQL floor, the floor with history and the app's functions (the library's
    server work is the app's functions'), its session tracking nested
    statements too (``pg_stat_statements.track = all``, which adds its own
    cost to each nested statement); the statistics are read before and after,
    so nothing is reset. Also the server's WAL bytes per cycle. Skipped unless
    the server loads pg_stat_statements and the role may set its tracking.
    """
    settings = connections.databases[alias]
    admin = _connect(settings)
    try:
        where = _statements_view(admin)
        if isinstance(where, dict):
            return where
        options = dict(settings.get("OPTIONS", {}))
        options["options"] = f"{options.get('options', '')} -c pg_stat_statements.track=all".strip()
        results: dict[str, Any] = {"cycles": config.statement_cycles, "track": "all"}
        for name, factory in (
            ("raw_sql_floor", floor_client(False)),
            ("floor_with_history", floor_client(False, history=True)),
            ("app_functions", app_functions_client(False)),
        ):
            progress(f"statements {name}")
            # The client reads the alias's settings when it connects: its session tracks.
            connections.databases[BENCH_ALIAS] = {**settings, "OPTIONS": options}
            try:
                cycle = factory(0)
            finally:
                connections.databases[BENCH_ALIAS] = settings
            for _ in range(300):  # every key's row exists, the statements are prepared
                cycle()
            before = _statement_stats(admin, where)
            wal_before = admin.execute("SELECT pg_current_wal_lsn()").fetchone()[0]
            for _ in range(config.statement_cycles):
                cycle()
            wal = admin.execute("SELECT pg_current_wal_lsn() - %s::pg_lsn", [wal_before]).fetchone()[0]
            rows: list[dict[str, Any]] = []
            for key, (query, calls, exec_ms, wal_bytes) in _statement_stats(admin, where).items():
                was = before.get(key, (query, 0, 0.0, 0))
                if calls - was[1] < config.statement_cycles // 2:
                    continue  # another session's, or the warm-up's
                rows.append({
                    "statement": query, "toplevel": key[1],
                    "calls_per_cycle": round((calls - was[1]) / config.statement_cycles, 2),
                    "exec_us_per_cycle": round((exec_ms - was[2]) * 1000 / config.statement_cycles, 1),
                    "wal_bytes_per_cycle": round((wal_bytes - was[3]) / config.statement_cycles),
                })
            rows.sort(key=lambda row: (not row["toplevel"], -row["exec_us_per_cycle"]))
            results[name] = {
                "statements": rows,
                "server_wal_bytes_per_cycle": round(int(wal) / config.statement_cycles),
            }
        return results
    finally:
        admin.close()


def cpu_suite(config: BenchConfig, alias: str, progress: Callable[[str], None]) -> dict[str, Any]:
    """Client and server CPU per cycle of each layer, in one process.

    The four layers' cycles (``floor_client``, ``app_functions_client``,
    ``locks_client``) run in turn over 64 keys each, in ``config.cpu_blocks``
    interleaved blocks of ``config.cpu_cycles``: the client's CPU from
    ``time.process_time()``, its server process's from ``/proc`` (where the
    server runs on this machine), the median of the blocks. At 8 clients on a
    saturated machine a layer's rate is about the inverse of its total.
    """
    settings = connections.databases[alias]
    admin = _connect(settings)
    application = settings.get("OPTIONS", {}).get("application_name", "")
    scopes = len(_client_scopes)
    # As the forked clients run: the app's default level, no line per grant.
    logs = logging.getLogger("coordination")
    level = logs.level
    logs.setLevel(logging.WARNING)
    try:
        cycles: dict[str, Operation] = {}
        server_pids: dict[str, int | None] = {}
        for index, (name, factory) in enumerate((
            ("raw_sql_floor", floor_client(False)),
            ("floor_with_history", floor_client(False, history=True)),
            ("app_functions", app_functions_client(False)),
            ("locks", locks_client(False)),
        )):
            before = _backend_pids(admin, application)
            cycle = factory(index)
            for _ in range(300):  # connected, every key's row exists, the calls prepared
                cycle()
            new = _backend_pids(admin, application) - before
            cycles[name] = cycle
            server_pids[name] = next(iter(new)) if len(new) == 1 else None
        readable = all(_server_cpu(pid) is not None for pid in server_pids.values())
        samples: dict[str, list[tuple[float, float | None]]] = {name: [] for name in cycles}
        for block in range(config.cpu_blocks):
            progress(f"cpu per cycle, block {block + 1} of {config.cpu_blocks}")
            for name, cycle in cycles.items():
                pid = server_pids[name] if readable else None
                server_before = _server_cpu(pid)
                client_before = time.process_time()
                for _ in range(config.cpu_cycles):
                    cycle()
                client = time.process_time() - client_before
                server_after = _server_cpu(pid)
                server = (
                    None if server_before is None or server_after is None
                    else server_after - server_before
                )
                samples[name].append((
                    client * 1e6 / config.cpu_cycles,
                    None if server is None else server * 1e6 / config.cpu_cycles,
                ))
        results: dict[str, Any] = {
            "cycles_per_block": config.cpu_cycles, "blocks": config.cpu_blocks, "layers": {},
        }
        if not readable:
            results["server"] = "not read: the server's processes are not on this machine"
        below: float | None = None
        for name, rows in samples.items():
            client_us = _median_of(row[0] for row in rows)
            server_us = _median_of(row[1] for row in rows)
            total = None if client_us is None or server_us is None else client_us + server_us
            results["layers"][name] = {
                "client_us": client_us, "server_us": server_us, "total_us": total,
                # The rate this total implies at 8 clients, against the layer below.
                "implied_x_below": (
                    None if total is None or below is None else round(below / total, 3)
                ),
            }
            below = total
        return results
    finally:
        admin.close()
        logs.setLevel(level)
        # The locks client's settings scope: a forked client keeps it for life, this process not.
        while len(_client_scopes) > scopes:
            _client_scopes.pop().__exit__(None, None, None)


def _backend_pids(admin: Any, application: str) -> set[int]:
    rows = admin.execute(
        "SELECT pid FROM pg_stat_activity WHERE application_name = %s AND pid <> pg_backend_pid()",
        [application],
    ).fetchall()
    return {pid for (pid,) in rows}


def _server_cpu(pid: int | None) -> float | None:
    """Seconds of CPU the server process ``pid`` used so far (user + system), if
    it runs on this machine and is PostgreSQL's."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            if b"postgres" not in cmdline.read():
                return None
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _statements_view(admin: Any) -> str | dict[str, str]:
    """The qualified name of ``pg_stat_statements``, or why the part is skipped."""
    loaded = admin.execute("SELECT current_setting('shared_preload_libraries')").fetchone()[0]
    if "pg_stat_statements" not in loaded:
        return {"skipped": "the server does not load pg_stat_statements (shared_preload_libraries)"}
    found = admin.execute(
        "SELECT n.nspname FROM pg_extension e JOIN pg_namespace n ON n.oid = e.extnamespace"
        " WHERE e.extname = 'pg_stat_statements'"
    ).fetchone()
    if found is None:
        return {"skipped": "CREATE EXTENSION pg_stat_statements in this database first"}
    try:
        admin.execute("SET pg_stat_statements.track = 'all'")
    except Exception as error:
        return {"skipped": f"the role may not set pg_stat_statements.track: {error}"}
    return f'"{found[0]}".pg_stat_statements'


def _statement_stats(admin: Any, view: str) -> dict[tuple[int, bool], tuple[str, int, float, int]]:
    rows = admin.execute(
        "SELECT queryid, toplevel, regexp_replace(query, '\\s+', ' ', 'g'), calls, total_exec_time,"
        f" wal_bytes FROM {view} WHERE dbid = (SELECT oid FROM pg_database"
        " WHERE datname = current_database())"
        " AND userid = (SELECT oid FROM pg_roles WHERE rolname = current_user)"
    ).fetchall()
    return {
        (queryid, top): (query, calls, exec_ms, int(wal))
        for queryid, top, query, calls, exec_ms, wal in rows
    }


def _median_of(values: Iterator[float | None]) -> float | None:
    present = [value for value in values if value is not None]
    return round(statistics.median(present), 3) if present else None


def fenced_suite(config: BenchConfig, alias: str) -> dict[str, Any]:
    """fenced_update against a plain ORM update() of the same row, one client.

    Each in autocommit (one commit per write, as a caller outside a transaction
    pays) and inside one transaction (the statement alone, without the commit's
    disk flush). Short alternating blocks, so that background load falls on
    every variant alike.
    """
    model: Any = fenced_model()
    if model is None:
        return {"skipped": "no FencedModel to measure (project.demo is not installed)"}
    logging.getLogger("coordination").setLevel(logging.WARNING)
    rows = model._default_manager.using(alias)
    row = rows.create(owner="bench")
    grant = locks.acquire(f"account:{row.pk}", holder="bench", ttl=3600, using=alias)
    value = 0

    def fenced() -> None:
        rows.filter(pk=row.pk).fenced_update(grant, balance=value)

    def plain() -> None:
        rows.filter(pk=row.pk).update(balance=value)

    # The app's default keeps no row per accepted write; the recorded variant is
    # what RECORD_WRITES = True costs on top.
    variants: dict[str, tuple[Callable[[], None], bool]] = {
        "plain_update": (plain, False), "fenced_update": (fenced, False),
    }
    if "RECORD_WRITES" in app_settings._values():
        variants["fenced_update_recorded"] = (fenced, True)
    result: dict[str, Any] = {}
    block = 20
    for mode in ("autocommit", "in_transaction"):
        timings: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(max(1, config.fenced_rounds // block)):
            for name, (write, record) in variants.items():
                with bench_settings(alias, RECORD_WRITES=record), (
                    transaction.atomic(using=alias)
                    if mode == "in_transaction" else contextlib.nullcontext()
                ):
                    for _ in range(block):
                        value += 1
                        began = time.perf_counter()
                        write()
                        timings[name].append(time.perf_counter() - began)
        plain_p50 = _percentile_ms(sorted(timings["plain_update"]), 0.5) or 1.0
        result[mode] = {}
        for name, values in timings.items():
            values.sort()
            p50 = _percentile_ms(values, 0.5) or 0.0
            result[mode][name] = {
                "ops": len(values),
                "mean_ms": round(statistics.fmean(values) * 1000, 4),
                "p50_ms": p50,
                "p99_ms": _percentile_ms(values, 0.99),
                "over_plain": round(p50 / plain_p50, 3),
            }
    locks.release(grant, using=alias)
    result["fenced_over_plain"] = result["autocommit"]["fenced_update"]["over_plain"]
    result["fenced_over_plain_in_transaction"] = (
        result["in_transaction"]["fenced_update"]["over_plain"]
    )
    return result


def scale_suite(
    config: BenchConfig, small_alias: str, large_alias: str, progress: Callable[[str], None]
) -> dict[str, Any]:
    """Acquire + release latency on existing keys, few rows against many, side by side.

    Two schemas: ``small_alias`` gets ``scale_small`` lock rows, ``large_alias``
    ``scale_large`` lock rows and ``scale_grants`` ended grant rows (the small
    one as many grants per lock), all bulk
    inserted with generate_series and then analysed. The cycles then alternate
    between the two in blocks, so that load from elsewhere (and the state of the
    OS page cache) falls on both alike. Keys are picked at random among all rows,
    so the indexes are probed everywhere, not only in a hot corner of them.
    """
    if connections[small_alias].vendor != "postgresql":
        return {"skipped": "the bulk row generation is PostgreSQL only"}
    logging.getLogger("coordination").setLevel(logging.WARNING)
    # The same history per lock at both sizes (10 grants a lock by default), so
    # that only the sizes differ. A grant table analysed while empty would also
    # be planned as one: its updates would scan it sequentially until the next
    # autoanalyze, a cost of the small run's, not of its size.
    small_grants = config.scale_grants * config.scale_small // max(1, config.scale_large)
    sizes = {
        small_alias: (config.scale_small, small_grants),
        large_alias: (config.scale_large, config.scale_grants),
    }
    loaded = {}
    for alias, (size, grants) in sizes.items():
        progress(f"scale: loading {size} lock rows, {grants} grant rows")
        loaded[alias] = _load_scale_rows(alias, size, grants)
    # The load leaves up to shared_buffers of dirty pages; a checkpoint writing
    # them out during the cycles would fall on the disk the commits wait for.
    # Write them now (a superuser or pg_checkpoint may), so that what is
    # measured is the cycles, from a checkpoint on, as a server running for a
    # while is between two of them.
    checkpointed = _checkpoint(large_alias, progress)
    # Each size two or three ways: durable as the grant point always is; with
    # the session's synchronous_commit off, which leaves out the wait for the
    # WAL flush (a grant is then not durable: a measurement only), so that the
    # index and buffer-cache work shows where the commit would hide it; and,
    # where the bench's role may set it, durable with wal_compression on, which
    # shrinks the full-page images that random keys among many rows cost.
    compression = _settable_wal_compression(small_alias)
    modes = [DURABLE, NO_FLUSH_WAIT] + ([WAL_COMPRESSION] if compression else [])
    series = [(alias, mode) for mode in modes for alias in sizes]
    latencies: dict[tuple[str, str], list[float]] = {entry: [] for entry in series}
    # WAL written per series (the bench's client is the server's only writer
    # when the database is private to it; otherwise an upper bound).
    wal_bytes: dict[tuple[str, str], int] = dict.fromkeys(series, 0)
    # Each series its own keys: a series drawing the same keys as another would
    # find the pages that one just wrote already logged in full since the last
    # checkpoint, and write a fraction of the WAL it would write alone.
    rngs = {(alias, mode): random.Random(f"{sizes[alias][0]}-{mode}") for alias, mode in series}
    block = max(1, min(50, config.scale_samples // 10))
    progress(f"scale: {config.scale_samples} cycles each, alternating blocks of {block}")
    while len(latencies[series[-1]]) < config.scale_samples:
        for alias, mode in series:
            size = sizes[alias][0]
            with bench_settings(alias, RECORD_WRITES=False):
                with connections[alias].cursor() as cursor:
                    cursor.execute(
                        f"SET synchronous_commit = {'off' if mode == NO_FLUSH_WAIT else 'on'}"
                    )
                    if compression:
                        cursor.execute(
                            "SELECT set_config('wal_compression', %s, false)",
                            [compression if mode == WAL_COMPRESSION else "off"],
                        )
                    cursor.execute("SELECT pg_current_wal_insert_lsn()")
                    wal_before = cursor.fetchone()[0]
                values, rng = latencies[alias, mode], rngs[alias, mode]
                for _ in range(block):
                    key = f"scale-{rng.randint(1, size)}"
                    began = time.perf_counter()
                    grant = locks.acquire(key, holder="scale", ttl=30, using=alias)
                    locks.release(grant, using=alias)
                    values.append(time.perf_counter() - began)
                with connections[alias].cursor() as cursor:
                    cursor.execute(
                        "SELECT pg_wal_lsn_diff(pg_current_wal_insert_lsn(), %s)", [wal_before]
                    )
                    wal_bytes[alias, mode] += int(cursor.fetchone()[0])
    for alias in sizes:
        with connections[alias].cursor() as cursor:
            cursor.execute("RESET synchronous_commit")
            if compression:
                cursor.execute("RESET wal_compression")
    with connections[small_alias].cursor() as cursor:
        cursor.execute("SHOW shared_buffers")
        shared_buffers = cursor.fetchone()[0]
    result: dict[str, Any] = {
        "how": "two schemas side by side, alternating blocks of cycles on random existing keys",
        "checkpoint_after_load": checkpointed,
        "shared_buffers": shared_buffers,
    }
    if not compression:
        result[WAL_COMPRESSION] = {
            "skipped": "the bench's role may not set wal_compression (superuser, or GRANT SET)"
        }
    for mode in modes:
        measured: list[dict[str, Any]] = []
        for alias in sizes:
            values = sorted(latencies[alias, mode])
            measured.append({
                **loaded[alias],
                "cycles": len(values),
                "p50_ms": _percentile_ms(values, 0.5),
                "p99_ms": _percentile_ms(values, 0.99),
                "mean_ms": round(statistics.fmean(values) * 1000, 4),
                "wal_bytes_per_cycle": round(wal_bytes[alias, mode] / max(1, len(values))),
            })
        small, large = measured
        ratios = {
            "large_over_small_p50": round(large["p50_ms"] / small["p50_ms"], 3),
            "large_over_small_p99": round(large["p99_ms"] / small["p99_ms"], 3),
            "large_over_small_mean": round(large["mean_ms"] / small["mean_ms"], 3),
        }
        if mode == DURABLE:
            result.update(runs=measured, **ratios)
        elif mode == WAL_COMPRESSION:
            result[mode] = {"method": compression, "runs": measured, **ratios}
        else:
            result[mode] = {"runs": measured, **ratios}
    return result


DURABLE, NO_FLUSH_WAIT, WAL_COMPRESSION = "durable", "no_flush_wait", "wal_compression"


def _checkpoint(alias: str, progress: Callable[[str], None]) -> bool:
    """Run ``CHECKPOINT`` (outside a transaction, as it must) if this role may; whether it ran."""
    progress("scale: checkpoint after the load")
    try:
        with connections[alias].cursor() as cursor:
            cursor.execute("CHECKPOINT")
    except DatabaseError as error:
        progress(f"scale: no checkpoint ({error}); the load's dirty pages may be written meanwhile")
        return False
    return True


def _settable_wal_compression(alias: str) -> str | None:
    """The best ``wal_compression`` method this session may set, or None.

    ``lz4`` where the server was built with it, else ``pglz`` (``on``). Setting
    it needs a superuser or ``GRANT SET ON PARAMETER``; a role without either
    gets None, and the series is skipped with that reason.
    """
    with connections[alias].cursor() as cursor:
        for method in ("lz4", "pglz"):
            try:
                with transaction.atomic(using=alias):
                    cursor.execute("SELECT set_config('wal_compression', %s, false)", [method])
            except DatabaseError:
                continue
            cursor.execute("RESET wal_compression")
            return method
    return None


def _load_scale_rows(alias: str, size: int, grants: int) -> dict[str, Any]:
    """``size`` free lock rows ``scale-1..size`` and ``grants`` ended grant rows
    spread over them (each lock's counter raised to its last grant's token)."""
    lock_table, grant_table = Lock._meta.db_table, Grant._meta.db_table
    began = time.perf_counter()
    with connections[alias].cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {lock_table} (key, token, holder, lease_hash, created_at)"
            " SELECT 'scale-' || n, 0, '', '', now() FROM generate_series(1, %s) AS n",
            [size],
        )
        if grants:
            per_lock = max(1, grants // size)
            cursor.execute(
                f"INSERT INTO {grant_table} (lock_id, token, holder, lease_hash, acquired_at,"
                " expires_at, ended_at, end_reason)"
                " SELECT l.id, t, 'history', 'x', now() - interval '1 day',"
                " now() - interval '1 day', now() - interval '1 day', 'released'"
                f" FROM {lock_table} AS l, generate_series(1, %s) AS t"
                " ORDER BY l.id, t LIMIT %s",
                [per_lock, grants],
            )
            cursor.execute(
                f"UPDATE {lock_table} AS l SET token = g.top FROM (SELECT lock_id, max(token)"
                f" AS top FROM {grant_table} GROUP BY lock_id) AS g WHERE g.lock_id = l.id"
            )
        # As a long-running site has them: statistics current, the visibility map set.
        cursor.execute(f"VACUUM ANALYZE {lock_table}")
        cursor.execute(f"VACUUM ANALYZE {grant_table}")
        cursor.execute(f"SELECT count(*) FROM {lock_table}")
        lock_rows = cursor.fetchone()[0]
        cursor.execute(f"SELECT count(*) FROM {grant_table}")
        grant_rows = cursor.fetchone()[0]
        cursor.execute(
            "SELECT pg_total_relation_size(%s) + pg_total_relation_size(%s)",
            [lock_table, grant_table],
        )
        table_bytes = cursor.fetchone()[0]
    return {
        "lock_rows": lock_rows,
        "grant_rows": grant_rows,
        "table_mb": round(table_bytes / 2**20, 1),
        "load_seconds": round(time.perf_counter() - began, 1),
    }


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
    return info


def wakeup_suite(config: BenchConfig, alias: str, progress: Callable[[str], None]) -> dict[str, Any]:
    """Release to the waiter's grant: LISTEN/NOTIFY wake-ups against polling.

    A holder keeps the lock; a waiter in another thread blocks in
    ``acquire(wait=...)``; after a random pause the holder releases. The time
    from the release's return to the waiter's grant is one sample.
    """
    import threading

    logging.getLogger("coordination").setLevel(logging.WARNING)
    modes = {"polling": False}
    if connections[alias].vendor == "postgresql":
        modes = {"notify": True, "polling": False}
    result: dict[str, Any] = {}
    rng = random.Random(5)
    for mode, wake_ups in modes.items():
        progress(f"wake-up latency: {mode}")
        samples: list[float] = []
        with bench_settings(alias, WAKE_UPS=wake_ups):
            for n in range(config.wakeup_samples):
                key = f"wake-{mode}-{n}"
                held = locks.acquire(key, holder="holder", ttl=30, using=alias)
                granted: list[float] = []

                def wait_for_it(key: str = key, granted: list[float] = granted) -> None:
                    try:
                        grant = locks.acquire(key, holder="waiter", ttl=30, wait=30, using=alias)
                        granted.append(time.perf_counter())
                        locks.release(grant, using=alias)
                    finally:
                        connections.close_all()

                waiter = threading.Thread(target=wait_for_it)
                waiter.start()
                time.sleep(rng.uniform(0.05, 0.3))
                locks.release(held, using=alias)
                released = time.perf_counter()
                waiter.join(60)
                samples.append(granted[0] - released)
        samples.sort()
        result[mode] = {
            "samples": len(samples),
            "p50_ms": _percentile_ms(samples, 0.5),
            "p99_ms": _percentile_ms(samples, 0.99),
            "max_ms": round(samples[-1] * 1000, 3),
        }
    return result


def fairness_suite(config: BenchConfig, alias: str, progress: Callable[[str], None]) -> dict[str, Any]:
    """Threads contending for one key, with and without fair queueing.

    Each thread loops acquire(wait) / short hold / release for a fixed time.
    Reports cycles/s, each thread's share (min and max grants) and the longest
    wait: fairness trades some throughput for no starvation.
    """
    import threading

    logging.getLogger("coordination").setLevel(logging.WARNING)
    result: dict[str, Any] = {}
    guard = threading.Lock()
    for fair in (False, True):
        name = "fair" if fair else "unfair"
        progress(f"fairness: {name}, {config.fair_threads} threads")
        key = f"fairness-{name}"
        counts = [0] * config.fair_threads
        waits: list[float] = []
        stop_at = time.monotonic() + config.duration * 2

        def worker(index: int, fair: bool = fair, key: str = key, counts: list[int] = counts,
                   waits: list[float] = waits, stop_at: float = stop_at) -> None:
            try:
                while time.monotonic() < stop_at:
                    began = time.perf_counter()
                    try:
                        grant = locks.acquire(
                            key, holder=f"t{index}", ttl=30, wait=max(0.1, stop_at - time.monotonic()),
                            fair=fair, using=alias,
                        )
                    except LockHeld:
                        break
                    waited = time.perf_counter() - began
                    time.sleep(0.002)  # the work under the lock
                    locks.release(grant, using=alias)
                    with guard:
                        counts[index] += 1
                        waits.append(waited)
            finally:
                connections.close_all()

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(config.fair_threads)]
        began = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(config.duration * 2 + 120)
        elapsed = time.perf_counter() - began
        waits.sort()
        result[name] = {
            "threads": config.fair_threads,
            "cycles_per_s": round(sum(counts) / elapsed, 1),
            "grants_per_thread_min": min(counts),
            "grants_per_thread_max": max(counts),
            "wait_p50_ms": _percentile_ms(waits, 0.5),
            "wait_max_ms": round(waits[-1] * 1000, 3) if waits else None,
        }
    unfair = result["unfair"]["cycles_per_s"]
    result["fair_over_unfair_throughput"] = (
        round(result["fair"]["cycles_per_s"] / unfair, 3) if unfair else None
    )
    return result


def celery_suite(config: BenchConfig, alias: str, progress: Callable[[str], None]) -> dict[str, Any]:
    """A fenced Celery task against the same task unfenced: through a real broker
    and worker (``end_to_end``), and in process by ``apply()`` (``in_process``)."""
    try:
        import celery  # noqa: F401

        from coordination.contrib import celery as contrib_celery  # noqa: F401
    except ImportError:
        return {"skipped": "Celery or coordination.contrib.celery is not available"}
    if fenced_model() is None:
        return {"skipped": "no FencedModel to write (project.demo is not installed)"}
    why_not = redis_available(config.redis_url)
    if why_not:
        end_to_end: dict[str, Any] = {"skipped": why_not}
        persistent: dict[str, Any] = {"skipped": why_not}
        working: dict[str, Any] = {"skipped": why_not}
    else:
        end_to_end = celery_worker_suite(config, alias, progress)
        persistent = celery_worker_suite(config, alias, progress, reuse_connections=True)
        working = celery_worker_suite(
            config, alias, progress, reuse_connections=True, work_ms=config.celery_work_ms
        )
    return {
        "end_to_end": end_to_end,
        "end_to_end_persistent": persistent,
        "end_to_end_persistent_working": working,
        "in_process": celery_apply_suite(config, alias, progress),
    }


def celery_worker_suite(
    config: BenchConfig,
    alias: str,
    progress: Callable[[str], None],
    *,
    reuse_connections: bool = False,
    work_ms: float = 0,
) -> dict[str, Any]:
    """Fenced and unfenced tasks through Redis and one real ``celery worker`` (solo pool).

    ``work_ms``: the body's own work before its one-row write (a sleep).

    The tasks are ``project.lab.bench_tasks``; the worker writes the bench tables
    (their settings travel in an environment variable). Alternating rounds, each
    variant per round: ``celery_rounds // 20`` tasks one at a time (latency, send
    to completion after the task returned) then a burst of twice as many
    (throughput, first send to last completion). The worker is killed on every exit.

    Connections: by default the worker runs as Celery's Django fixup makes it,
    closing every connection around every task, so each task opens a new one
    (a new PostgreSQL server process, whose first call of the grant point's
    functions also loads and plans them: the fenced task pays that too). With
    ``reuse_connections`` the worker keeps its connection (``CELERY_DB_REUSE_MAX``),
    as a worker behind a pool or with connection reuse does: what fencing
    itself adds to a task.
    """
    import json
    import subprocess
    import sys
    import tempfile
    import uuid

    import redis
    from celery import Celery
    from django.conf import settings

    from . import bench_tasks

    url = str(config.redis_url)
    run = uuid.uuid4().hex[:10]
    queue = f"coordination-bench-{run}"
    report = f"coordination-bench-report-{run}"
    client = redis.Redis.from_url(url)
    model: Any = fenced_model()
    row = model._default_manager.using(alias).create(owner="celery-worker-bench")
    env = {
        **os.environ,
        "CELERY_BROKER_URL": url,
        bench_tasks.DATABASE_ENV: json.dumps(connections.databases[alias], default=str),
        bench_tasks.REPORT_ENV: url,
    }
    env.pop("CELERY_RESULT_BACKEND", None)
    env.pop("CELERY_DB_REUSE_MAX", None)
    if reuse_connections:
        env["CELERY_DB_REUSE_MAX"] = "1000000"
    producer = Celery("coordination-bench", broker=url, set_as_current=False)
    producer.conf.task_serializer = "json"
    # Closed (and so deleted) in the finally below, after the worker is gone.
    log = tempfile.NamedTemporaryFile(  # noqa: SIM115
        prefix="coordination-bench-worker-", suffix=".log"
    )
    progress(
        "celery tasks through Redis and a worker, fenced and unfenced, "
        + ("connections kept" if reuse_connections else "a new connection per task")
        + (f", a {work_ms:g} ms body" if work_ms else ", a one-row body")
    )
    def stop(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)  # runs the finally below, which stops the worker

    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, stop) if main else None
    worker = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "project", "worker", "--pool=solo",
         "--concurrency=1", "-Q", queue, "-I", "project.lab.bench_tasks",
         "-n", f"bench-{run}@%h", "--without-gossip", "--without-mingle",
         "--without-heartbeat", "--loglevel=WARNING"],
        cwd=str(settings.BASE_DIR), env=env, stdout=log, stderr=subprocess.STDOUT,
    )
    names = {"fenced": bench_tasks.FENCED, "unfenced": bench_tasks.UNFENCED}
    amount = 0

    def send(name: str) -> None:
        nonlocal amount
        amount += 1
        producer.send_task(
            names[name], args=(row.pk, amount), queue=queue,
            kwargs={"sent_at": time.time(), "report": report, "work_ms": work_ms},
        )

    def collect(count: int, timeout: float) -> list[tuple[float, float]]:
        done: list[tuple[float, float]] = []
        deadline = time.monotonic() + timeout
        while len(done) < count:
            left = deadline - time.monotonic()
            # One second at a time: redis-py's default socket timeout (5 s) would
            # cut a longer BLPOP short while a worker on a busy machine starts.
            popped = client.blpop([report], timeout=1) if left > 0 else None
            if popped is None:
                if worker.poll() is not None:
                    raise RuntimeError(f"bench worker exited ({worker.returncode}): {_tail(log.name)}")
                if time.monotonic() >= deadline:
                    raise RuntimeError(f"bench tasks did not complete: {_tail(log.name)}")
                continue
            _name, sent_at, done_at, state = json.loads(popped[1])
            if state != "SUCCESS":
                raise RuntimeError(f"bench task {_name} ended {state}: {_tail(log.name)}")
            done.append((sent_at, done_at))
        return done

    latency: dict[str, list[float]] = {name: [] for name in names}
    burst_tasks: dict[str, int] = dict.fromkeys(names, 0)
    burst_seconds: dict[str, float] = dict.fromkeys(names, 0.0)
    block = max(2, config.celery_rounds // 20)
    try:
        for name in names:  # warm-up, and waits for the worker to consume
            send(name)
            collect(1, 120)
        for _ in range(max(1, config.celery_rounds // 40)):
            for name in names:
                for _ in range(block):
                    send(name)
                    sent_at, done_at = collect(1, 60)[0]
                    latency[name].append(done_at - sent_at)
                began = time.time()
                for _ in range(2 * block):
                    send(name)
                finished = collect(2 * block, 120)
                burst_tasks[name] += 2 * block
                burst_seconds[name] += max(done_at for _, done_at in finished) - began
        # The worker wrote the bench tables, not the site's: the last write is here.
        row.refresh_from_db(using=alias)
        if int(row.balance) != amount:
            raise RuntimeError(f"bench worker wrote elsewhere: balance {row.balance}, sent {amount}")
    finally:
        if main:
            signal.signal(signal.SIGTERM, previous)
        worker.terminate()
        try:
            worker.wait(15)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait()
        log.close()
        with contextlib.suppress(Exception):
            client.delete(
                report, queue, f"_kombu.binding.{queue}", f"_kombu.binding_permanent.{queue}"
            )
        with contextlib.suppress(Exception):
            producer.close()
    result: dict[str, Any] = {
        "how": "Redis broker, one celery worker (solo pool); the same lock key and row for all; "
        + ("connection kept across tasks" if reuse_connections else "a new connection per task")
        + (f"; the body works {work_ms:g} ms before its write" if work_ms else "; a one-row body"),
        "work_ms": work_ms,
    }
    for name, values in latency.items():
        values.sort()
        result[name] = {
            "tasks": len(values),
            "p50_ms": _percentile_ms(values, 0.5),
            "p99_ms": _percentile_ms(values, 0.99),
            "burst_tasks": burst_tasks[name],
            "tasks_per_s": round(burst_tasks[name] / burst_seconds[name], 1)
            if burst_seconds[name] > 0 else None,
        }
    result["fenced_over_unfenced"] = round(
        (result["fenced"]["p50_ms"] or 0) / (result["unfenced"]["p50_ms"] or 1), 3
    )
    unfenced_rate = result["unfenced"]["tasks_per_s"]
    result["fenced_over_unfenced_throughput"] = (
        round((result["fenced"]["tasks_per_s"] or 0) / unfenced_rate, 3) if unfenced_rate else None
    )
    return result


def _tail(path: str) -> str:
    with contextlib.suppress(OSError), open(path, errors="replace") as log:
        return log.read()[-2000:]
    return ""


def celery_apply_suite(
    config: BenchConfig, alias: str, progress: Callable[[str], None]
) -> dict[str, Any]:
    """A fenced Celery task against the same task unfenced, run by ``apply()``.

    In-process (Celery's task machinery, no broker, no worker): what the fencing
    adds to each execution (acquire, keep-alive thread, fenced write, release)
    next to the same body writing with a plain update. Alternating blocks.
    """
    try:
        from celery import shared_task

        from coordination.contrib.celery import fenced_task
    except ImportError:
        return {"skipped": "Celery or coordination.contrib.celery is not available"}
    model: Any = fenced_model()
    if model is None:
        return {"skipped": "no FencedModel to write (project.demo is not installed)"}
    logging.getLogger("coordination").setLevel(logging.WARNING)
    logging.getLogger("coordination.tasks").setLevel(logging.WARNING)
    rows = model._default_manager.using(alias)
    row = rows.create(owner="celery-bench")

    @fenced_task(lock="account:{account_id}", ttl=30, name="coordination.bench.fenced_settle")
    def fenced_settle(account_id: int, amount: int) -> None:
        rows.filter(pk=account_id).fenced_update(balance=amount)

    @shared_task(name="coordination.bench.plain_settle")
    def plain_settle(account_id: int, amount: int) -> None:
        rows.filter(pk=account_id).update(balance=amount)

    tasks = {"fenced": fenced_settle, "unfenced": plain_settle}
    timings: dict[str, list[float]] = {name: [] for name in tasks}
    progress("celery tasks in process (apply()), fenced and unfenced")
    amount = 0
    for _ in range(max(1, config.celery_rounds // 20)):
        for name, task in tasks.items():
            for _ in range(20):
                amount += 1
                began = time.perf_counter()
                outcome = task.apply(args=(row.pk, amount))
                timings[name].append(time.perf_counter() - began)
                if outcome.failed():
                    raise RuntimeError(f"bench task {name} failed: {outcome.result!r}")
    result: dict[str, Any] = {"how": "task.apply() in process: no broker, no worker"}
    for name, values in timings.items():
        values.sort()
        result[name] = {
            "tasks": len(values),
            "p50_ms": _percentile_ms(values, 0.5),
            "p99_ms": _percentile_ms(values, 0.99),
        }
    result["fenced_over_unfenced"] = round(
        (result["fenced"]["p50_ms"] or 0) / (result["unfenced"]["p50_ms"] or 1), 3
    )
    return result


# --- output ------------------------------------------------------------------------


def table(results: dict[str, Any]) -> str:
    """The results as fixed-width text tables, every throughput also as a ratio to the floor."""
    lines: list[str] = []
    info = results["machine"]
    lines.append(
        f"machine: {info.get('cpu', '?')} x{info['cpus']}, Python {info['python']}, "
        f"Django {info['django']}, {info['database']} {info.get('postgresql', '')}"
    )
    if results.get("note"):
        lines.append(results["note"])
    cycles = results.get("cycles")
    if cycles:
        for name, why in cycles["skipped"].items():
            lines.append(f"skipped {name}: {why}")
        gives = cycles.get("gives", {})
        if gives:
            lines.append("")
            lines.append(f"{'system':<20}{'token':<18}{'durable':<9}note")
            for name in cycles["systems"]:
                if name in gives:
                    what = gives[name]
                    lines.append(f"{name:<20}{what['token']:<18}{what['durable']:<9}{what['note']}")
        for workload in ("many_keys", "hot_key"):
            lines.append("")
            lines.append(f"acquire + release cycles, {workload.replace('_', ' ')}")
            lines.append(
                f"{'system':<20}{'clients':>8}{'ops/s':>10}{'x floor':>9}{'x hist':>8}"
                f"{'x below':>9}{'p50 ms':>9}{'p99 ms':>9}{'refused':>9}"
            )
            for name, series in cycles[workload].items():
                for row in series:
                    ratio = _ratio(row["ratio_to_floor"])
                    history = _ratio(row.get("ratio_to_history_floor"))
                    below = _ratio(row.get("ratio_to_layer_below"))
                    lines.append(
                        f"{name:<20}{row['clients']:>8}{row['ops_per_s']:>10.0f}{ratio:>9}"
                        f"{history:>8}{below:>9}{_ms(row['p50_ms']):>9}{_ms(row['p99_ms']):>9}"
                        f"{row['refused']:>9}"
                    )
            layers = [name for name in cycles.get("layers", []) if name in cycles[workload]]
            if len(layers) > 1:
                lines.append("layers, each x the one below (" + " < ".join(layers) + "):")
                for index, clients in enumerate(row["clients"] for row in cycles[workload][layers[0]]):
                    steps = "  ".join(
                        f"{name} {_ratio(cycles[workload][name][index].get('ratio_to_layer_below'))}"
                        for name in layers[1:]
                    )
                    lines.append(f"  {clients} clients: {steps}")
    statements = results.get("statements")
    if statements:
        lines.append("")
        if "skipped" in statements:
            lines.append(f"statements: skipped ({statements['skipped']})")
        else:
            lines.append(
                f"server work per cycle, by statement (pg_stat_statements, track = all, "
                f"{statements['cycles']} cycles of one client); nested statements indented"
            )
            for name in ("raw_sql_floor", "floor_with_history", "app_functions"):
                part = statements[name]
                lines.append(f"{name}: {part['server_wal_bytes_per_cycle']} WAL bytes a cycle")
                for row in part["statements"]:
                    indent = "" if row["toplevel"] else "  "
                    lines.append(
                        f"  {row['exec_us_per_cycle']:>7.1f} us {row['wal_bytes_per_cycle']:>5} B "
                        f"{row['calls_per_cycle']:>5.2f}x  {indent}{row['statement'][:90]}"
                    )
    cpu = results.get("cpu")
    if cpu:
        lines.append("")
        if "skipped" in cpu:
            lines.append(f"cpu per cycle: skipped ({cpu['skipped']})")
        else:
            lines.append(
                f"CPU per cycle, one process over 64 keys ({cpu['blocks']} interleaved blocks of "
                f"{cpu['cycles_per_block']}, medians)"
                + (f"; server {cpu['server']}" if "server" in cpu else "")
            )
            lines.append(
                f"{'layer':<20}{'client us':>10}{'server us':>10}{'total us':>10}"
                f"{'implied x below':>17}"
            )
            for name, row in cpu["layers"].items():
                lines.append(
                    f"{name:<20}{_us(row['client_us']):>10}{_us(row['server_us']):>10}"
                    f"{_us(row['total_us']):>10}{_ratio(row['implied_x_below']):>17}"
                )
    fenced = results.get("fenced")
    if fenced:
        lines.append("")
        if "skipped" in fenced:
            lines.append(f"fenced_update: skipped ({fenced['skipped']})")
        else:
            lines.append("fenced_update against a plain ORM update() of the same row, 1 client")
            for mode in ("autocommit", "in_transaction"):
                for name, row in fenced[mode].items():
                    lines.append(
                        f"{mode:<15}{name:<24} p50 {_ms(row['p50_ms'])} ms  "
                        f"p99 {_ms(row['p99_ms'])} ms  x plain {row['over_plain']:.2f}"
                    )
            lines.append(
                f"fenced / plain (p50): {fenced['fenced_over_plain']:.2f} in autocommit, "
                f"{fenced['fenced_over_plain_in_transaction']:.2f} inside a transaction"
            )
    scale = results.get("scale")
    if scale:
        lines.append("")
        if "skipped" in scale:
            lines.append(f"row-count runs: skipped ({scale['skipped']})")
        else:
            lines.append(
                "acquire + release latency on existing keys, by table size, side by side "
                f"(shared_buffers {scale.get('shared_buffers', '?')}, checkpoint after the load: "
                f"{'yes' if scale.get('checkpoint_after_load') else 'no'})"
            )
            for row in scale["runs"]:
                lines.append(
                    f"{row['lock_rows']:>10} locks {row['grant_rows']:>10} grants  "
                    f"p50 {_ms(row['p50_ms'])} ms  p99 {_ms(row['p99_ms'])} ms  "
                    f"mean {_ms(row['mean_ms'])} ms  ({row.get('table_mb', '?')} MB, "
                    f"{row.get('wal_bytes_per_cycle', '?')} WAL bytes a cycle)"
                )
            lines.append(
                f"large / small: p50 {scale['large_over_small_p50']:.2f}, "
                f"p99 {scale['large_over_small_p99']:.2f}, mean {scale['large_over_small_mean']:.2f}"
            )
            variants = {
                NO_FLUSH_WAIT: "the same with synchronous_commit off (no wait for the WAL flush):",
                WAL_COMPRESSION: "durable, with wal_compression = {method}:",
            }
            for mode, title in variants.items():
                variant = scale.get(mode)
                if not variant:
                    continue
                if "skipped" in variant:
                    lines.append(f"{mode}: skipped ({variant['skipped']})")
                    continue
                lines.append(title.format(method=variant.get("method")))
                for row in variant["runs"]:
                    lines.append(
                        f"{row['lock_rows']:>10} locks {row['grant_rows']:>10} grants  "
                        f"p50 {_ms(row['p50_ms'])} ms  p99 {_ms(row['p99_ms'])} ms  "
                        f"mean {_ms(row['mean_ms'])} ms  "
                        f"({row.get('wal_bytes_per_cycle', '?')} WAL bytes a cycle)"
                    )
                lines.append(
                    f"large / small: p50 {variant['large_over_small_p50']:.2f}, "
                    f"p99 {variant['large_over_small_p99']:.2f}, "
                    f"mean {variant['large_over_small_mean']:.2f}"
                )
    wakeup = results.get("wakeup")
    if wakeup:
        lines.append("")
        lines.append("wake-up latency, release to the waiter's grant")
        for mode, row in wakeup.items():
            lines.append(
                f"{mode:<10} p50 {_ms(row['p50_ms'])} ms  p99 {_ms(row['p99_ms'])} ms  "
                f"max {_ms(row['max_ms'])} ms  ({row['samples']} samples)"
            )
    fairness = results.get("fairness")
    if fairness:
        lines.append("")
        lines.append("one key, threads looping acquire(wait) / 2 ms of work / release")
        for mode in ("unfair", "fair"):
            row = fairness[mode]
            lines.append(
                f"{mode:<8} {row['cycles_per_s']:>7.0f} cycles/s  grants per thread "
                f"{row['grants_per_thread_min']}..{row['grants_per_thread_max']}  "
                f"wait p50 {_ms(row['wait_p50_ms'])} ms  max {_ms(row['wait_max_ms'])} ms"
            )
    celery = results.get("celery")
    if celery:
        lines.append("")
        if "skipped" in celery:
            lines.append(f"celery: skipped ({celery['skipped']})")
        else:
            lines.append("celery task, fenced against the same task writing with update()")
            for part in ("end_to_end", "end_to_end_persistent", "end_to_end_persistent_working"):
                worker = celery.get(part)
                if worker is None:
                    continue
                if "skipped" in worker:
                    lines.append(f"through a worker: skipped ({worker['skipped']})")
                    continue
                lines.append(
                    f"through a worker ({worker['how']}): "
                    f"fenced {_rate(worker['fenced']['tasks_per_s'])} tasks/s, "
                    f"p50 {_ms(worker['fenced']['p50_ms'])} ms, "
                    f"p99 {_ms(worker['fenced']['p99_ms'])} ms; "
                    f"unfenced {_rate(worker['unfenced']['tasks_per_s'])} tasks/s, "
                    f"p50 {_ms(worker['unfenced']['p50_ms'])} ms, "
                    f"p99 {_ms(worker['unfenced']['p99_ms'])} ms; "
                    f"ratio p50 {worker['fenced_over_unfenced']:.2f}, "
                    f"throughput {_ratio(worker['fenced_over_unfenced_throughput'])}"
                )
            local = celery["in_process"]
            lines.append(
                f"in process ({local['how']}): fenced p50 {_ms(local['fenced']['p50_ms'])} ms, "
                f"unfenced p50 {_ms(local['unfenced']['p50_ms'])} ms, "
                f"ratio {local['fenced_over_unfenced']:.2f}"
            )
    return "\n".join(lines) + "\n"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _us(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def chart(results: dict[str, Any], path: str) -> None:
    """Throughput and p99 latency against client count, many keys and the hot key."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cycles = results["cycles"]
    figure, axes = plt.subplots(2, 2, figsize=(11, 8), sharex=True)
    for column, workload in enumerate(("many_keys", "hot_key")):
        for name, series in cycles[workload].items():
            clients = [row["clients"] for row in series]
            axes[0][column].plot(
                clients, [row["ops_per_s"] for row in series], marker="o", label=name
            )
            axes[1][column].plot(
                clients, [row["p99_ms"] or 0 for row in series], marker="o", label=name
            )
        axes[0][column].set_title(f"acquire + release, {workload.replace('_', ' ')}")
        axes[0][column].set_ylabel("cycles / s")
        axes[1][column].set_ylabel("p99 latency (ms)")
        axes[1][column].set_xlabel("client processes")
        axes[1][column].set_xscale("log", base=2)
        axes[0][column].legend(fontsize="small")
    info = results["machine"]
    figure.suptitle(
        f"coordination_bench: {info['database']} {info.get('postgresql', '')}, "
        f"{info['cpus']} CPUs, {'quick run' if results.get('quick') else 'full run'}"
    )
    figure.tight_layout()
    figure.savefig(path, dpi=90)
    plt.close(figure)
