"""The CI smoke run of ``manage.py coordination_bench --quick``: it runs, and its JSON
has the structure the docs and the chart rely on. No timing is asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from itertools import pairwise
from pathlib import Path
from urllib.parse import quote

import pytest
from django.conf import settings
from django.db import connection

from tests.support.legs import missing_service, services_required

pytestmark = pytest.mark.django_db(transaction=True)

ROW_FIELDS = {"clients", "ops", "refused", "ops_per_s", "p50_ms", "p99_ms", "ratio_to_floor"}


def database_url() -> str:
    db = connection.settings_dict
    if connection.vendor == "sqlite":
        return f"sqlite:///{db['NAME']}"
    credentials = quote(db["USER"] or "") + (f":{quote(db['PASSWORD'])}" if db["PASSWORD"] else "")
    return f"postgres://{credentials}@{db['HOST'] or 'localhost'}:{db['PORT'] or 5432}/{db['NAME']}"


@pytest.mark.legs("pg", "sqlite", reason="the bench measures the grant point, not the Django version")
def test_quick_bench_writes_json_table_and_chart(tmp_path: Path) -> None:
    out, chart = tmp_path / "bench.json", tmp_path / "bench.png"
    if not os.environ.get("COORDINATION_TEST_REDIS_URL") and services_required():
        missing_service("a Redis server for the bench's Redis peer and worker (COORDINATION_TEST_REDIS_URL)")

    # As CI runs it: the command in its own process, against the test database.
    done = subprocess.run(
        [sys.executable, str(settings.BASE_DIR / "manage.py"), "coordination_bench", "--quick",
         "--json", str(out), "--chart", str(chart)],
        env={**os.environ, "DATABASE_URL": database_url()},
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]

    results = json.loads(out.read_text())
    postgres = connection.vendor == "postgresql"
    cycles = results["cycles"]
    expected = {"locks"} | ({"raw_sql_floor", "pg_advisory"} if postgres else set())
    if os.environ.get("COORDINATION_TEST_REDIS_URL"):
        expected.add("redis_lock")  # CI provides Redis: the peer must have run
    assert expected <= set(cycles["systems"])
    # The consensus peers run only when their services do (never required): each
    # either ran or says why not, and every system says what it gives.
    assert {"etcd", "zookeeper"} <= set(cycles["systems"]) | set(cycles["skipped"])
    assert set(cycles["systems"]) <= set(cycles["gives"])
    assert all({"token", "durable"} <= set(what) for what in cycles["gives"].values())
    for workload in ("many_keys", "hot_key"):
        for name in cycles["systems"]:
            series = cycles[workload][name]
            assert [row["clients"] for row in series] == [1, 2]
            assert all(set(row) >= ROW_FIELDS for row in series)
            assert sum(row["ops"] for row in series) > 0, f"{name} did no {workload} cycle"
    # The library once more with the site's own LOGGING, against it at WARNING.
    assert "locks_site_logging" in cycles["systems"]
    for workload in ("many_keys", "hot_key"):
        assert all(row["ratio_to_locks"] > 0 for row in cycles[workload]["locks_site_logging"])
    assert "locks with the site's LOGGING x locks at WARNING" in done.stdout
    floor = cycles["many_keys"].get("raw_sql_floor")
    if postgres:
        assert floor is not None and all(row["ratio_to_floor"] == 1.0 for row in floor)
        # Every layer of a cycle in the same run, each with its ratio to the one below.
        layers = ["raw_sql_floor", "floor_with_history", "app_functions", "locks"]
        assert cycles["layers"] == layers
        for workload in ("many_keys", "hot_key"):
            for below, name in pairwise(layers):
                for row in cycles[workload][name]:
                    assert row["layer_below"] == below
                    assert row["ratio_to_layer_below"] > 0
        assert "layers, each x the one below" in done.stdout
    else:
        assert "app_functions" in cycles["skipped"]
    # Each layer's CPU per cycle, the server's where it runs on this machine (the test's does).
    cpu = results["cpu"]
    if postgres:
        assert list(cpu["layers"]) == ["raw_sql_floor", "floor_with_history", "app_functions", "locks"]
        for name, row in cpu["layers"].items():
            assert row["client_us"] > 0, name
            assert "server" in cpu or row["server_us"] is not None, name
        assert "CPU per cycle" in done.stdout
        assert cpu["site_logging"]["client_us"] > 0 and cpu["site_logging"]["x_locks"] > 0
    else:
        assert "skipped" in cpu
    # Per statement where the server loads pg_stat_statements; else it says why not.
    statements = results["statements"]
    if "skipped" not in statements:
        for name in ("raw_sql_floor", "floor_with_history", "app_functions"):
            assert statements[name]["server_wal_bytes_per_cycle"] > 0
            assert any(row["toplevel"] for row in statements[name]["statements"])
    fenced = results["fenced"]
    for mode in ("autocommit", "in_transaction"):
        assert fenced[mode]["fenced_update"]["ops"] > 0 and fenced[mode]["plain_update"]["ops"] > 0
    assert fenced["fenced_over_plain"] > 0
    if postgres:
        small, large = results["scale"]["runs"]
        assert small["lock_rows"] < large["lock_rows"] and large["grant_rows"] > 0
        assert small["cycles"] == large["cycles"] > 0  # side by side, the same count each
        assert results["scale"]["large_over_small_p99"] > 0
        assert results["scale"]["no_flush_wait"]["runs"][1]["cycles"] == large["cycles"]
        assert isinstance(results["scale"]["checkpoint_after_load"], bool)
        assert results["scale"]["shared_buffers"]
        # Run where the role may set wal_compression (a superuser, as the test
        # server's is), else skipped with the reason; never silently missing.
        compressed = results["scale"]["wal_compression"]
        if "skipped" not in compressed:
            assert compressed["method"] in ("lz4", "pglz")
            assert compressed["runs"][1]["cycles"] == large["cycles"]
    else:
        assert "skipped" in results["scale"]
    assert ("notify" in results["wakeup"]) is postgres and results["wakeup"]["polling"]["samples"]
    for mode in ("fair", "unfair"):
        row = results["fairness"][mode]
        # Each thread's share is reported, and some thread got the lock (how evenly
        # is timing, which this smoke run does not judge).
        assert row["threads"] == 3 and row["cycles_per_s"] > 0
        assert 0 <= row["grants_per_thread_min"] <= row["grants_per_thread_max"]
        assert row["grants_per_thread_max"] >= 1
    celery = results["celery"]
    assert set(celery) == {
        "end_to_end", "end_to_end_persistent", "end_to_end_persistent_working", "in_process"
    }
    assert celery["end_to_end_persistent_working"].get("work_ms", 10) == 10
    assert celery["in_process"]["fenced"]["tasks"] > 0 and celery["in_process"]["fenced_over_unfenced"] > 0
    assert celery["in_process"]["fenced_once"]["tasks"] > 0 and celery["in_process"]["once_over_fenced"] > 0
    assert celery["in_process"]["once_repeat"]["tasks"] > 0
    # Where each task's time went, part by part (how long is timing: not judged).
    assert {"acquire", "body", "release", "rest"} <= set(celery["in_process"]["fenced_steps_us"])
    assert set(celery["in_process"]["unfenced_steps_us"]) == {"body", "rest"}
    assert all(us >= 0 for us in celery["in_process"]["fenced_steps_us"].values())
    for part in ("end_to_end", "end_to_end_persistent", "end_to_end_persistent_working"):
        worker = celery[part]
        if os.environ.get("COORDINATION_TEST_REDIS_URL"):  # CI provides Redis: the worker ran
            for variant in ("fenced", "unfenced", "fenced_once"):
                assert worker[variant]["tasks"] > 0 and worker[variant]["tasks_per_s"] > 0
            assert worker["fenced_over_unfenced"] > 0 and worker["fenced_over_unfenced_throughput"] > 0
        else:
            assert "skipped" in worker or worker["fenced"]["tasks"] > 0
    # A fenced write to each store beside a plain one (moto's S3 server, started by the bench).
    stores = results["stores"]
    assert stores["writes"] == 20
    measured = ["s3"] + (["redis"] if os.environ.get("COORDINATION_TEST_REDIS_URL") else [])
    for name in measured:
        row = stores[name]
        assert row["plain_p50_ms"] > 0 and row["fenced_p50_ms"] > 0 and row["fenced_over_plain"] > 0, row
    assert "fenced store writes against plain ones" in done.stdout
    assert "acquire + release cycles, many keys" in done.stdout
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.postgres
@pytest.mark.legs("pg", reason="the row-count runs are PostgreSQL only")
def test_sigterm_during_the_load_cancels_it_and_drops_the_schemas() -> None:
    """A bench stopped while it loads rows cancels the load on the server and
    drops its schemas; before, SIGTERM left both schemas (and the load running)."""
    bench = subprocess.Popen(
        [sys.executable, str(settings.BASE_DIR / "manage.py"), "coordination_bench",
         "--only", "scale", "--scale-locks", "10,100000000", "--scale-grants", "100000000"],
        env={**os.environ, "DATABASE_URL": database_url()},
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    try:
        assert bench.stderr is not None
        for line in bench.stderr:  # the progress lines
            if "loading 100000000 lock rows" in line:
                break
        else:
            pytest.fail(f"the bench never started the large load (exit {bench.wait()})")
        schemas = f"coordination_bench_{bench.pid}_%"
        with connection.cursor() as cursor:
            cursor.execute("SELECT count(*) FROM pg_namespace WHERE nspname LIKE %s", [schemas])
            assert cursor.fetchone()[0] == 2  # both exist while it loads
        bench.terminate()
        _, rest = bench.communicate(timeout=60)
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait()
        with connection.cursor() as cursor:  # nothing of a failed run outlives the test
            cursor.execute(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
                " WHERE application_name LIKE %s AND pid <> pg_backend_pid()",
                [f"coordination_bench_{bench.pid}_%"],
            )
    assert bench.returncode == 1 and "interrupted" in rest, rest[-2000:]
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_namespace WHERE nspname LIKE %s", [schemas])
        assert cursor.fetchone()[0] == 0
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
            " AND pid <> pg_backend_pid() AND query LIKE %s AND state = 'active'",
            ["%generate_series%"],
        )
        assert cursor.fetchone()[0] == 0  # the load was cancelled, not left running


def test_site_logging_client_logs_as_the_site_configures() -> None:
    """The bench's clients log at WARNING; the site-logging system undoes that and
    logs as ``LOGGING`` says (before it existed, every client ran at WARNING)."""
    import logging

    from project.lab.benchmarks.systems import site_logging_config

    logger = logging.getLogger("coordination")
    before = logger.level
    try:
        logger.setLevel(logging.WARNING)
        site_logging_config()
        site_level = settings.LOGGING["loggers"]["coordination"]["level"]
        assert logger.level == logging.getLevelName(site_level) != logging.WARNING
    finally:
        logger.setLevel(before)
