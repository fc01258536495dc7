"""Acquire + release cycles per system and number of clients, as ratios to the floor."""

from __future__ import annotations

import functools
import random
import statistics
from collections.abc import Callable
from typing import Any

from .common import BenchConfig, ClientFactory, run_clients
from .cpu import _median_of
from .systems import (
    SYSTEM_GIVES,
    advisory_client,
    app_functions_client,
    etcd_available,
    etcd_client,
    floor_client,
    locks_client,
    redis_available,
    redis_client,
    zookeeper_available,
    zookeeper_cleanup,
    zookeeper_client,
)


def cycle_suite(config: BenchConfig, vendor: str, progress: Callable[[str], None]) -> dict[str, Any]:
    """Acquire + release cycles over many keys and on one hot key, per system."""
    systems: dict[str, Callable[[bool], ClientFactory]] = {
        "locks": locks_client,
        # The same, logging as the site's settings configure it (what a user gets).
        "locks_site_logging": lambda hot: locks_client(hot, site_logging=True),
    }
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
    elif vendor == "mysql":
        from . import mariadb

        systems = {
            "raw_sql_floor": mariadb.floor_client,
            "floor_with_history": lambda hot: mariadb.floor_client(hot, history=True),
            "app_functions": mariadb.app_procedures_client,
            **systems,
            "locks_orm": lambda hot: locks_client(hot, grant_point="orm"),
        }
        skipped["pg_advisory"] = "PostgreSQL only; this run is on MariaDB"
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
            if name == "locks_site_logging":
                # What the site's logging costs: within a round, against WARNING.
                row["ratio_to_locks"] = _ratio_of(runs[name], runs.get("locks"))
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
