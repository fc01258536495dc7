"""``manage.py coordination_bench``: the grant point and the fences against their baselines.

Prints a table, writes ``--json`` and a ``--chart`` PNG. ``--quick`` is the CI
smoke version: a few seconds, tiny sizes, numbers not meant to be read.
"""

from __future__ import annotations

import json
import os
import signal
import time
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import connections
from django.test import override_settings

from coordination.conf import app_settings
from project.lab import benchmarks


class Command(BaseCommand):
    help = (
        "Benchmark acquire + release cycles (many keys, one hot key) at 1-16 client "
        "processes, fenced_update against a plain update(), and acquire latency with "
        "few and many lock rows, side by side with the raw SQL floor, PostgreSQL "
        "advisory locks, python-redis-lock and (when running) etcd and ZooKeeper."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--json", dest="json_path", help="write the results as JSON here")
        parser.add_argument("--chart", dest="chart_path", help="write a PNG chart here")
        parser.add_argument("--quick", action="store_true", help="smoke run: seconds, tiny sizes")
        parser.add_argument(
            "--clients", default="1,2,4,8,16", help="client process counts (default 1,2,4,8,16)"
        )
        parser.add_argument(
            "--duration", type=float, default=3.0, help="seconds per measurement (default 3)"
        )
        parser.add_argument(
            "--rounds", type=int, default=3,
            help="rounds per measurement, systems shuffled each round (default 3)",
        )
        parser.add_argument(
            "--redis-url",
            help="Redis for the python-redis-lock peer, the Celery worker's broker and the stores part",
        )
        parser.add_argument(
            "--etcd-url",
            help="etcd v3 JSON gateway for the etcd peer (default COORDINATION_BENCH_ETCD_URL; "
            "bin/bench-peers.sh starts one)",
        )
        parser.add_argument(
            "--zookeeper",
            help="ZooKeeper hosts for the kazoo peer (default COORDINATION_BENCH_ZOOKEEPER; "
            "bin/bench-peers.sh starts one)",
        )
        parser.add_argument(
            "--scale-locks", default="1000,1000000",
            help="lock rows for the small and the large latency runs (default 1000,1000000)",
        )
        parser.add_argument(
            "--scale-grants", type=int, default=10_000_000,
            help="grant history rows added for the large run (default 10000000)",
        )
        parser.add_argument(
            "--scale-database",
            help="PostgreSQL database for the row-count runs (created if missing); "
            "default: a schema of the configured database",
        )
        parser.add_argument(
            "--systems",
            help="cycle systems to run, comma-separated (default: all; the two floors always run)",
        )
        parser.add_argument(
            "--s3-endpoint",
            help="an S3-compatible endpoint for the stores part (default: moto's S3 server, started here)",
        )
        parser.add_argument("--skip-scale", action="store_true", help="skip the row-count runs")
        parser.add_argument(
            "--only",
            choices=[
                "cycles", "cpu", "statements", "fenced", "scale", "wakeup", "fairness", "celery", "stores",
            ],
            action="append",
            help="run only these parts (repeatable)",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        # SIGTERM as Ctrl-C: psycopg then cancels the statement running on the
        # server (a 10^7-row load, say) instead of leaving it to hold its locks,
        # and the finally blocks drop the bench's schemas and stop its worker.
        def interrupt(signum: int, frame: Any) -> None:
            raise KeyboardInterrupt

        previous = signal.signal(signal.SIGTERM, interrupt)
        try:
            self._run(options)
        except KeyboardInterrupt:
            raise CommandError("interrupted; the bench's schemas were dropped") from None
        finally:
            signal.signal(signal.SIGTERM, previous)

    def _run(self, options: dict[str, Any]) -> None:
        config = self._config(options)
        parts = set(
            options["only"]
            or ["cycles", "cpu", "statements", "fenced", "scale", "wakeup", "fairness", "celery", "stores"]
        )
        vendor = connections[app_settings.DATABASE].vendor
        results: dict[str, Any] = {
            "machine": benchmarks.machine(),
            "config": {k: v for k, v in vars(config).items() if k != "redis_url"},
            "quick": options["quick"],
        }
        if vendor == "mysql":
            flush = results["machine"].get("innodb_flush_log_at_trx_commit")
            results["note"] = (
                "MariaDB run: the floors are MariaDB's SQL (project/lab/benchmarks/mariadb.py), "
                "app_functions the app's stored procedures; the CPU, statement and row-count "
                "runs need PostgreSQL. "
                + ("Commits are durable (innodb_flush_log_at_trx_commit=1)." if flush == "1" else
                   f"Commits are not durable (innodb_flush_log_at_trx_commit={flush}): a user's "
                   "server commits durably (bin/bench-mariadb.sh starts one).")
            )
        elif vendor != "postgresql":
            results["note"] = (
                "SQLite run: only the locks cycles and fenced_update apply; the raw SQL floor, "
                "advisory locks and the row-count runs need PostgreSQL."
            )
        began = time.perf_counter()
        # As in production: DEBUG would log every query of the ORM paths.
        with override_settings(DEBUG=False), benchmarks.bench_database() as alias, (
            benchmarks.bench_settings(alias, RECORD_WRITES=False)
        ):
            if "cycles" in parts:
                results["cycles"] = benchmarks.cycle_suite(config, vendor, self._progress)
            if "cpu" in parts:
                results["cpu"] = (
                    benchmarks.cpu_suite(config, alias, self._progress)
                    if vendor == "postgresql" else {"skipped": "PostgreSQL only"}
                )
            if "statements" in parts:
                results["statements"] = (
                    benchmarks.statements_suite(config, alias, self._progress)
                    if vendor == "postgresql" else {"skipped": "PostgreSQL only"}
                )
            if "fenced" in parts:
                self._progress("fenced_update against update()")
                results["fenced"] = benchmarks.fenced_suite(config, alias)
            if "wakeup" in parts:
                results["wakeup"] = benchmarks.wakeup_suite(config, alias, self._progress)
            if "fairness" in parts:
                results["fairness"] = benchmarks.fairness_suite(config, alias, self._progress)
            if "celery" in parts:
                results["celery"] = benchmarks.celery_suite(config, alias, self._progress)
            if "stores" in parts:
                results["stores"] = benchmarks.stores_suite(config, self._progress)
        if "scale" in parts and config.include_scale:
            if vendor != "postgresql":
                results["scale"] = {"skipped": "the bulk row generation is PostgreSQL only"}
            else:
                # Few rows and many, each in a schema of its own, measured side by
                # side; both schemas are dropped on the way out, whatever happens.
                with override_settings(DEBUG=False), benchmarks.bench_database(
                    config.scale_database, schema=f"{benchmarks.BENCH_SCHEMA}_small",
                    alias=f"{benchmarks.BENCH_ALIAS}_small",
                ) as small, benchmarks.bench_database(
                    config.scale_database, schema=f"{benchmarks.BENCH_SCHEMA}_large",
                    alias=f"{benchmarks.BENCH_ALIAS}_large",
                ) as large:
                    results["scale"] = benchmarks.scale_suite(config, small, large, self._progress)
        results["seconds"] = round(time.perf_counter() - began, 1)
        self.stdout.write(benchmarks.table(results))
        if options["json_path"]:
            with open(options["json_path"], "w") as out:
                json.dump(results, out, indent=2, default=str)
        if options["chart_path"] and "cycles" in results:
            benchmarks.chart(results, options["chart_path"])

    def _config(self, options: dict[str, Any]) -> benchmarks.BenchConfig:
        small, large = (int(n) for n in options["scale_locks"].split(","))
        redis_url = (
            options["redis_url"]
            or os.environ.get("COORDINATION_TEST_REDIS_URL")
            or _redis_broker(os.environ.get("CELERY_BROKER_URL", ""))
        )
        config = benchmarks.BenchConfig(
            clients=[int(n) for n in options["clients"].split(",")],
            duration=options["duration"],
            rounds=options["rounds"],
            scale_small=small,
            scale_large=large,
            scale_grants=options["scale_grants"],
            redis_url=redis_url,
            etcd_url=options["etcd_url"] or os.environ.get("COORDINATION_BENCH_ETCD_URL") or None,
            zookeeper=options["zookeeper"] or os.environ.get("COORDINATION_BENCH_ZOOKEEPER") or None,
            scale_database=options["scale_database"],
            include_scale=not options["skip_scale"],
            systems=options["systems"].split(",") if options["systems"] else None,
            s3_endpoint=options["s3_endpoint"],
        )
        if options["quick"]:
            config.clients = [1, 2]
            config.duration = 0.3
            config.rounds = 1
            config.fenced_rounds = 100
            config.scale_small, config.scale_large, config.scale_grants = 100, 1000, 5000
            config.scale_samples = 50
            config.wakeup_samples = 3
            config.fair_threads = 3
            config.celery_rounds = 20
            config.statement_cycles = 50
            config.store_writes = 20
            config.cpu_cycles, config.cpu_blocks = 50, 1
        return config

    def _progress(self, message: str) -> None:
        self.stderr.write(f"  {message}")


def _redis_broker(url: str) -> str | None:
    return url if url.startswith(("redis://", "rediss://")) else None
