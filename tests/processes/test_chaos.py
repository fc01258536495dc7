"""Real chaos runs: with fences the history is clean under every fault kind;
without them (the negative control) the checker finds the stale writes. The
checker itself is tested on hand-made histories in tests/unit/test_chaos_checker.py.

The workload also writes an S3 object (on moto's S3 server) and a Redis key (on
the suite's Redis) per cycle under the grant, and the checker judges them like
rows; a missing store fails the run where every service is required."""

from __future__ import annotations

import datetime as dt
import importlib.util
import io
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
from django.core.management import CommandError, call_command
from django.db import connection

from project.lab.chaos import checker
from project.lab.chaos.faults import FAULT_KINDS, postgres_bindir
from project.lab.chaos.history import read_events
from project.lab.chaos.run import ChaosConfig, ChaosRun
from tests.support.legs import missing_service

# --- real runs ------------------------------------------------------------------

ROOT = Path(__file__).resolve().parents[2]
STORE_KINDS = {"s3", "redis"}


@pytest.fixture(scope="module")
def stores() -> Iterator[dict[str, str]]:
    """The stores a run writes besides the database: ``redis_url`` (the suite's
    Redis) and ``s3_endpoint`` (a moto server answering one request at a time, so
    that its conditional writes are atomic)."""
    for name in ("redis", "moto", "boto3", "storages"):
        if importlib.util.find_spec(name) is None:
            missing_service(f"the Python package {name} (requirements/s3.txt), for the runs' stores")
    if not os.environ.get("COORDINATION_TEST_REDIS_URL"):
        missing_service("a Redis server for the runs' Redis keys: COORDINATION_TEST_REDIS_URL is not set")
    found = {"redis_url": os.environ["COORDINATION_TEST_REDIS_URL"]}
    from tests.support.s3_server import s3_server

    credentials = {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test"}
    saved = {name: os.environ.get(name) for name in credentials}
    os.environ.update(credentials)  # the runs' workers take them from the environment
    try:
        with s3_server(serial=True) as endpoint:
            yield {**found, "s3_endpoint": endpoint}
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def store_arguments(stores: dict[str, str]) -> list[str]:
    return [argument for name, value in stores.items()
            for argument in (f"--{name.replace('_', '-')}", value)]


def assert_stores_judged(figures: dict[str, Any], stores: dict[str, str]) -> None:
    """Each store of the run had its resources written and checked."""
    wanted = {"s3" if name == "s3_endpoint" else "redis" for name in stores}
    assert set(figures["stores"]) == wanted, figures["stores"]
    for store in wanted:
        assert figures["resources_by_store"].get(store) == figures["keys"], figures["resources_by_store"]
        assert figures["accepted_writes_by_store"].get(store, 0) > 0, figures["accepted_writes_by_store"]


@pytest.mark.postgres
@pytest.mark.legs("pg", reason="a 30 s run; the LTS leg runs the same workload code")
@pytest.mark.django_db(transaction=True)
def test_a_chaos_run_with_every_fault_kind_keeps_the_fencing_contract(
    tmp_path: Path, stores: dict[str, str]
) -> None:
    if postgres_bindir() is None:
        missing_service("the PostgreSQL server binaries (initdb, pg_ctl) that --manage-postgres runs")
    # As a user runs it: its own process, against a PostgreSQL server it starts,
    # so that it can restart it.
    command = [
        sys.executable, "manage.py", "coordination_chaos", "--seconds", "30", "--workers", "4",
        "--keys", "2", "--ttl", "1", "--fault-interval", "1", "--manage-postgres",
        "--json", str(tmp_path / "figures.json"),
        "--history", str(tmp_path / "history.jsonl"), *store_arguments(stores),
    ]
    # Its default database is this run's (migrated) test database; it is not written to.
    environment = {**os.environ, "DATABASE_URL": database_url()}
    run = subprocess.run(command, cwd=ROOT, env=environment, capture_output=True, text=True,
                         timeout=240, check=False)
    output = run.stdout + run.stderr
    assert run.returncode == 0, output
    figures = json.loads((tmp_path / "figures.json").read_text())
    assert figures["passed"] and figures["violations"] == [], output
    assert set(figures["faults_by_kind"]) == set(FAULT_KINDS), output
    assert figures["stale_write_attempts"] > 0
    assert figures["refused_by_reason"].get("stale_token", 0) > 0, output
    assert figures["accepted_writes"] > 50
    assert figures["worker_crashes"] == 0, output
    assert_stores_judged(figures, stores)
    # The history alone gives the same verdict.
    assert checker.check(list(read_events(tmp_path / "history.jsonl"))).passed


@pytest.mark.legs("pg", reason="a 20 s run on real workers; the LTS leg runs the same workload code")
@pytest.mark.django_db(transaction=True)
def test_a_chaos_run_of_fenced_celery_tasks_on_real_workers_keeps_the_contract(
    tmp_path: Path, stores: dict[str, str]
) -> None:
    if not os.environ.get("COORDINATION_TEST_REDIS_URL"):
        missing_service("a Redis broker (COORDINATION_TEST_REDIS_URL)")
    # The workers are `celery worker` processes; the lock is taken by fenced_task.
    command = [
        sys.executable, "manage.py", "coordination_chaos", "--celery", "--seconds", "20",
        "--ttl", "1", "--fault-interval", "0.8", "--faults", "pause,kill,terminate_backend",
        "--json", str(tmp_path / "figures.json"), *store_arguments(stores),
    ]
    environment = {
        **os.environ, "CELERY_BROKER_URL": os.environ["COORDINATION_TEST_REDIS_URL"],
        # The test database of this run, which the command and its workers then use.
        "DATABASE_URL": database_url(),
    }
    run = subprocess.run(command, cwd=ROOT, env=environment, capture_output=True, text=True,
                         timeout=240, check=False)
    output = run.stdout + run.stderr
    assert run.returncode == 0, output
    figures = json.loads((tmp_path / "figures.json").read_text())
    assert figures["celery"] and figures["passed"], output
    assert figures["accepted_writes"] > 20 and figures["worker_crashes"] == 0, output
    assert_stores_judged(figures, stores)  # the fenced task wrote them with its one grant


def database_url() -> str:
    settings = connection.settings_dict
    return (f"postgres://{quote(settings['USER'] or '')}:{quote(settings['PASSWORD'] or '')}@"
            f"{settings['HOST'] or ''}:{settings['PORT'] or ''}/{settings['NAME']}")


@pytest.mark.legs("pg", reason="the negative control; the SQLite leg runs the short fenced run below")
@pytest.mark.django_db(transaction=True)
def test_without_fencing_the_checker_finds_stale_writes_accepted(
    tmp_path: Path, stores: dict[str, str]
) -> None:
    # Pauses are the fault that makes a late writer; they come often here. The
    # objects and Redis keys are written with a plain PUT and a plain SET.
    config = ChaosConfig(seconds=10, workers=4, keys=2, ttl=0.8, fencing=False, fault_interval=0.7,
                         faults=("pause",), **stores)
    report = ChaosRun(config, out=io.StringIO()).run()
    assert not report.passed
    assert report.figures["worker_crashes"] == 0, report.summary()
    found = {violation.check for violation in report.violations}
    assert found & {"stale_write_accepted", "lost_write"}, report.summary()
    assert_stores_judged(report.figures, stores)
    # Each store is a resource of its own: the checker finds the stale writes it accepted.
    written = set(report.figures["stores"])
    assert written <= set(report.figures["violations_by_store"]), report.summary()
    # The command exits non-zero whenever fencing is off: with violations, or with
    # no stale write to show (a run that proves nothing).
    with pytest.raises(CommandError, match="no-fencing") as failed:
        call_command("coordination_chaos", "--seconds", "3", "--no-fencing", "--faults", "pause",
                     "--fault-interval", "0.6", "--ttl", "0.6", stdout=io.StringIO())
    assert failed.value.returncode == 1


@pytest.mark.legs("sqlite", reason="the PostgreSQL legs run the longer chaos runs above")
@pytest.mark.django_db(transaction=True)
def test_a_short_chaos_run_on_the_embedded_sqlite_default_keeps_the_contract(
    stores: dict[str, str]
) -> None:
    config = ChaosConfig(seconds=12, workers=4, keys=2, ttl=0.8, fault_interval=0.8, faults=("pause", "kill"),
                         **stores)
    report = ChaosRun(config, out=io.StringIO()).run()
    assert report.passed, report.summary()
    assert_stores_judged(report.figures, stores)
    assert report.figures["refused_by_reason"].get("stale_token", 0) > 0
    assert report.figures["worker_crashes"] == 0


@pytest.mark.legs("mariadb", reason="MariaDB's own run; the PostgreSQL legs run the longer ones")
@pytest.mark.django_db(transaction=True)
def test_a_chaos_run_of_every_primitive_on_mariadb_keeps_the_contract() -> None:
    # Locks, readers, permits and sets on MariaDB's grant point (its procedures
    # for acquire and release, the ORM transaction for the rest), with the
    # watermark triggers in MariaDB's dialect at the resource.
    config = ChaosConfig(seconds=10, workers=4, keys=2, ttl=0.8, fault_interval=0.8,
                         faults=("pause", "kill"), primitives=True, extend_up_to=60)
    report = ChaosRun(config, out=io.StringIO()).run()
    assert report.passed, report.summary()
    assert report.figures["worker_crashes"] == 0, report.summary()
    assert report.figures["stale_write_attempts"] > 0, report.summary()
    assert report.figures["refused_by_reason"].get("stale_token", 0) > 0, report.summary()


@pytest.mark.postgres
@pytest.mark.legs("pg", reason="a real run of every primitive; the other legs run the same code")
@pytest.mark.django_db(transaction=True)
def test_a_chaos_run_of_readers_permits_and_sets_keeps_their_invariants(tmp_path: Path) -> None:
    history = tmp_path / "history.jsonl"
    # Past its 8 s the run goes on (up to a minute) until a stale write was
    # attempted: the pauses, not luck, make one.
    config = ChaosConfig(seconds=8, workers=4, keys=2, ttl=0.8, fault_interval=0.8,
                         faults=("pause", "kill"), primitives=True, extend_up_to=60,
                         history=str(history))
    report = ChaosRun(config, out=io.StringIO()).run()

    assert report.passed, report.summary()
    assert report.figures["worker_crashes"] == 0, report.summary()
    events = list(read_events(history))
    ops = checker.build_ops(events)
    granted = {kind: sum(1 for op in ops if op.op == kind and op.ok)
               for kind in ("acquire", "acquire_permit", "acquire_many")}
    readers = sum(1 for op in ops if op.op == "acquire" and op.ok and op.result.get("mode") == "shared")
    assert min(granted.values()) > 0 and readers > 0, granted
    assert report.figures["stale_write_attempts"] > 0, report.summary()
    (semaphore,) = [e for e in events if e.get("type") == "semaphore"]
    assert any(e.get("type") == "grant_row" and e["key"].startswith(semaphore["name"] + "@")
               for e in events)

    # The same real history with each invariant broken: the checker says so.
    def found(
        extra: list[dict[str, Any]], edit: Callable[[dict[str, Any]], None] | None = None
    ) -> set[str]:
        changed = [dict(event) for event in events]
        if edit is not None:
            for event in changed:
                edit(event)
        return {v.check for v in checker.check(changed + extra).violations}

    rows = [e for e in events if e.get("type") == "grant_row"]
    first = min(e["acquired_at"] for e in rows)
    last = max(e["expires_at"] for e in rows)
    name = semaphore["name"]
    # Two more permits live over the whole run, on slots above the limit.
    intruders = [{"type": "grant_row", "key": f"{name}@{slot}", "token": 1, "holder": "intruder",
                  "acquired_at": first, "expires_at": last, "ended_at": None, "mode": "exclusive",
                  "mono": 0.0} for slot in (3, 4)]
    assert {"permit_above_limit", "permits_above_limit"} <= found(intruders)

    # A writer granted while a reader of its key is live.
    reader = next(e for e in rows if e["mode"] == "shared")
    top = max(e["token"] for e in rows if e["key"] == reader["key"])
    end = dt.datetime.fromisoformat(last)
    overlap = [
        {"type": "grant_row", "key": reader["key"], "token": top + 1, "holder": "late-reader",
         "mode": "shared", "acquired_at": (end + dt.timedelta(seconds=1)).isoformat(),
         "expires_at": (end + dt.timedelta(seconds=3)).isoformat(), "ended_at": None, "mono": 0.0},
        {"type": "grant_row", "key": reader["key"], "token": top + 2, "holder": "writer",
         "mode": "exclusive", "acquired_at": (end + dt.timedelta(seconds=2)).isoformat(),
         "expires_at": (end + dt.timedelta(seconds=4)).isoformat(), "ended_at": None, "mono": 0.0},
    ]
    assert "writer_overlaps_readers" in found(overlap)

    # A granted set acknowledged with one of its keys missing.
    whole = next(op for op in ops if op.op == "acquire_many" and op.ok)

    def drop_a_key(event: dict[str, Any]) -> None:
        if event.get("type") == "complete" and event.get("id") == whole.id:
            event["grants"] = dict(list(event["grants"].items())[:-1])

    assert "set_partial" in found([], drop_a_key)
