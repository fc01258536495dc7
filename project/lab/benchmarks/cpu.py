"""Statements per cycle and CPU per cycle, client and server."""

from __future__ import annotations

import logging
import os
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

from django.db import connections

from .common import BENCH_ALIAS, BenchConfig, Operation, _connect
from .systems import (
    _client_scopes,
    app_functions_client,
    floor_client,
    locks_client,
    site_logging_config,
)


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
            # The same with the site's LOGGING: its level set around each of its blocks.
            ("locks_site_logging", locks_client(False, site_logging=True)),
        )):
            before = _backend_pids(admin, application)
            cycle = factory(index)
            for _ in range(300):  # connected, every key's row exists, the calls prepared
                cycle()
            new = _backend_pids(admin, application) - before
            cycles[name] = cycle
            server_pids[name] = next(iter(new)) if len(new) == 1 else None
            logs.setLevel(logging.WARNING)
        readable = all(_server_cpu(pid) is not None for pid in server_pids.values())
        samples: dict[str, list[tuple[float, float | None]]] = {name: [] for name in cycles}
        for block in range(config.cpu_blocks):
            progress(f"cpu per cycle, block {block + 1} of {config.cpu_blocks}")
            for name, cycle in cycles.items():
                pid = server_pids[name] if readable else None
                if name in ("locks", "locks_site_logging"):
                    # Both configured afresh before their blocks (a new
                    # configuration costs the next cycles a little), then
                    # the site's level for one, WARNING for the other.
                    site_logging_config()
                    if name == "locks":
                        logs.setLevel(logging.WARNING)
                server_before = _server_cpu(pid)
                client_before = time.process_time()
                for _ in range(config.cpu_cycles):
                    cycle()
                client = time.process_time() - client_before
                logs.setLevel(logging.WARNING)
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
        site = samples.pop("locks_site_logging")
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
        # What the site's logging costs a cycle of the library's client.
        site_us = _median_of(row[0] for row in site)
        locks_us = results["layers"]["locks"]["client_us"]
        results["site_logging"] = {
            "client_us": site_us,
            "x_locks": None if not site_us or not locks_us else round(site_us / locks_us, 3),
        }
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
