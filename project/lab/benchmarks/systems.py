"""The systems a cycle runs: the locks and their floors, advisory locks, Redis, etcd, ZooKeeper."""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any

from django.db import connections

from coordination import locks
from coordination.backends import postgresql
from coordination.backends.base import WAKE_UP_CHANNEL
from coordination.exceptions import LockHeld
from coordination.models import MAX_TOKEN

from .common import BENCH_ALIAS, BENCH_SCHEMA, ClientFactory, Operation, _connect, bench_settings

_client_scopes: list[Any] = []


def locks_client(
    hot: bool, *, prepared: bool | None = None, grant_point: str | None = None,
    site_logging: bool = False,
) -> ClientFactory:
    """``locks.acquire`` + ``locks.release``; ``prepared`` overrides
    ``COORDINATION["PREPARED_STATEMENTS"]`` (None: the app's default).
    ``site_logging``: the client logs as the site's ``LOGGING`` says (the
    ``coordination`` logger at INFO, to the console), not at WARNING."""
    overrides: dict[str, Any] = {"GRANT_POINT": grant_point}
    if prepared is not None:
        overrides["PREPARED_STATEMENTS"] = prepared

    def make(index: int) -> Operation:
        # In the forked client only, for the rest of its life (the reference
        # keeps the override from being closed when the generator is collected).
        scope = bench_settings(BENCH_ALIAS, **overrides)
        scope.__enter__()
        _client_scopes.append(scope)
        if site_logging:
            site_logging_config()
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


def site_logging_config() -> None:
    """Logging as the site configures it at startup, undoing the clients' WARNING."""
    from django.conf import settings
    from django.utils.log import configure_logging

    configure_logging(settings.LOGGING_CONFIG, settings.LOGGING)


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
    "locks_site_logging": {"token": "yes, fenced", "durable": "yes", "note": "the site's LOGGING"},
    "locks_unprepared": {"token": "yes, fenced", "durable": "yes", "note": "grant history"},
    "locks_orm": {"token": "yes, fenced", "durable": "yes", "note": "grant history"},
    "pg_advisory": {"token": "no", "durable": "no", "note": "held by the session"},
    "redis_lock": {"token": "no", "durable": "no", "note": "in memory, async persistence"},
    "etcd": {"token": "yes, revision", "durable": "yes", "note": "lease + txn, raft fsync"},
    "zookeeper": {"token": "node seq, unused", "durable": "yes", "note": "ephemeral, session"},
}
