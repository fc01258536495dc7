"""The grant point on a small and a large table."""

from __future__ import annotations

import logging
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

from django.db import DatabaseError, connections, transaction

from coordination import locks
from coordination.models import Grant, Lock

from .common import BenchConfig, _percentile_ms, bench_settings


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
