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
dicts so that the command can print, chart and dump them as JSON. One module
per part: ``common`` (the schema, the clients, the machine), ``systems`` (what
a cycle runs), ``cycles``, ``cpu`` (statements and CPU per cycle), ``fenced``,
``scale``, ``waiting`` (wake-ups, fairness), ``celery``, ``stores`` (fenced
writes to S3 and Redis), ``output`` (table, chart).
"""

from __future__ import annotations

from .celery import (
    celery_apply_suite,
    celery_suite,
    celery_worker_suite,
)
from .common import (
    BENCH_ALIAS,
    BENCH_SCHEMA,
    BenchConfig,
    ClientFactory,
    Operation,
    bench_database,
    bench_models,
    bench_settings,
    fenced_model,
    machine,
    run_clients,
)
from .cpu import (
    cpu_suite,
    statements_suite,
)
from .cycles import (
    LAYERS,
    cycle_suite,
)
from .fenced import (
    fenced_suite,
)
from .output import (
    chart,
    table,
)
from .scale import (
    scale_suite,
)
from .stores import (
    stores_suite,
)
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
from .waiting import (
    fairness_suite,
    wakeup_suite,
)

__all__ = [
    "BENCH_ALIAS",
    "BENCH_SCHEMA",
    "LAYERS",
    "SYSTEM_GIVES",
    "BenchConfig",
    "ClientFactory",
    "Operation",
    "advisory_client",
    "app_functions_client",
    "bench_database",
    "bench_models",
    "bench_settings",
    "celery_apply_suite",
    "celery_suite",
    "celery_worker_suite",
    "chart",
    "cpu_suite",
    "cycle_suite",
    "etcd_available",
    "etcd_client",
    "fairness_suite",
    "fenced_model",
    "fenced_suite",
    "floor_client",
    "locks_client",
    "machine",
    "redis_available",
    "redis_client",
    "run_clients",
    "scale_suite",
    "statements_suite",
    "stores_suite",
    "table",
    "wakeup_suite",
    "zookeeper_available",
    "zookeeper_cleanup",
    "zookeeper_client",
]
