"""Real ``celery worker`` processes for the worker tests, and reading their reports.

Workers run ``tests.support.celery_worker_settings``: the site's settings pointed at
the test database this pytest process created (``connection.settings_dict``
names it after creation) and at the broker a test chooses.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
from django.db import connection

from tests.support.legs import missing_service

REPO = Path(__file__).resolve().parents[2]
#: How the database sessions of the workers started here are named (PostgreSQL).
WORKER_SESSION_PREFIX = "coordination-test-worker:"
#: Every worker started, until its sessions were seen to end.
_started: list[Worker] = []


def redis_url() -> str:
    url = os.environ.get("COORDINATION_TEST_REDIS_URL", "")
    if not url:
        missing_service(
            "a Redis broker: COORDINATION_TEST_REDIS_URL is not set (bin/test starts one; by hand: "
            "export COORDINATION_TEST_REDIS_URL=redis://127.0.0.1:6379/0)"
        )
    return url


@dataclass(frozen=True)
class RedisBroker:
    """A Redis broker URL and the key prefix that keeps one test's keys apart."""

    url: str
    prefix: str
    queues: set[str] = field(default_factory=set, compare=False)

    @classmethod
    def fresh(cls) -> RedisBroker:
        return cls(redis_url(), unique("coordination-test") + ":")

    def connection(self) -> Any:
        from project.celery import app

        return app.connection_for_write(
            self.url, transport_options={"global_keyprefix": self.prefix}
        )

    def queue_length(self, queue: str) -> int:
        return int(redis.Redis.from_url(self.url).llen(self.prefix + queue))

    def unacked_on(self, queue: str) -> int:
        """Messages of ``queue`` delivered to a worker and not yet acknowledged."""
        client = redis.Redis.from_url(self.url)
        pending = client.hvals(self.prefix + "unacked")
        return sum(1 for raw in pending if json.loads(raw)[2] == queue)

    def clean(self) -> None:
        client = redis.Redis.from_url(self.url)
        keys = list(client.scan_iter(match=self.prefix + "*", count=500))
        # Exchange bindings are kept outside the prefix by kombu.
        for queue in self.queues:
            keys += [f"_kombu.binding.{queue}", f"_kombu.binding_permanent.{queue}"]
        if keys:
            client.delete(*keys)


def publish(task: Any, queue: str, broker: RedisBroker | None, *args: Any, **options: Any) -> Any:
    """``task.apply_async`` of ``args`` (and ``kwargs=``, Celery's options) to ``queue``
    on ``broker``'s Redis, or, with None, on the site's own broker: the embedded
    default's filesystem one, which the workers started with ``broker=None`` share."""
    kwargs = options.pop("kwargs", {})
    if broker is None:
        return task.apply_async(args, kwargs, queue=queue, **options)
    with broker.connection() as conn:
        return task.apply_async(args, kwargs, queue=queue, connection=conn, **options)


def worker_environment(broker: str | None, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("CELERY_BROKER_URL", None)
    env.update(
        DJANGO_SETTINGS_MODULE="tests.support.celery_worker_settings",
        COORDINATION_TEST_WORKER_DATABASE=str(connection.settings_dict["NAME"]),
        PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        COORDINATION_LOG_LEVEL="INFO",
    )
    if broker:
        env["COORDINATION_TEST_WORKER_BROKER"] = broker
    else:
        env.pop("COORDINATION_TEST_WORKER_BROKER", None)
    env.update(extra)
    return env


@dataclass
class Worker:
    name: str
    queue: str
    process: subprocess.Popen[bytes]
    log: Path
    #: The ``application_name`` of the worker's database sessions (PostgreSQL).
    session_name: str = ""

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def stop(self) -> None:
        # Nothing of a test worker needs a graceful shutdown: leases expire, the
        # test's queues are deleted, and the database drops the connections.
        # SIGKILL ends a stopped process too (tests pause one with
        # tests.support.pausing.paused, which resumes it whatever happens).
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)  # the worker and its pool children
        self.process.wait(10)


def start_worker(
    name: str,
    queue: str,
    log_dir: Path,
    *,
    broker: RedisBroker | str | None,
    pool: str = "solo",
    concurrency: int = 1,
    **env: str,
) -> Worker:
    if isinstance(broker, RedisBroker):
        broker.queues.add(queue)
        env = {"COORDINATION_TEST_REDIS_PREFIX": broker.prefix, **env}
        broker = broker.url
    log = log_dir / f"{name}.log"
    session_name = unique(f"{WORKER_SESSION_PREFIX}{name[:20]}")
    env = {"COORDINATION_TEST_WORKER_SESSION": session_name, **env}
    command = [
        sys.executable, "-m", "celery", "-A", "project", "worker",
        "-P", pool, "-c", str(concurrency), "-Q", queue, "-n", f"{name}@%h",
        "--without-gossip", "--without-mingle", "--without-heartbeat", "-l", "INFO",
    ]
    with open(log, "wb") as out:
        process = subprocess.Popen(
            command, cwd=REPO, env=worker_environment(broker, **env), stdin=subprocess.DEVNULL,
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )
    worker = Worker(name=name, queue=queue, process=process, log=log, session_name=session_name)
    _started.append(worker)
    return worker


def wait_ready(workers: Iterable[Worker], timeout: float = 90) -> None:
    pending = list(workers)
    deadline = time.monotonic() + timeout
    while pending:
        for worker in list(pending):
            if " ready." in worker.log_text():
                pending.remove(worker)
            elif worker.process.poll() is not None:
                raise AssertionError(f"worker {worker.name} exited:\n{worker.log_text()[-3000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(
                "workers not ready in time:\n"
                + "\n".join(f"--- {w.name}\n{w.log_text()[-2000:]}" for w in pending)
            )
        time.sleep(0.1)


def wait_until_workers_disconnect(timeout: float = 15) -> None:
    """After killing workers: wait for their database sessions to end, so that
    pytest can drop the test database at the end of the run (PostgreSQL only).

    Only the sessions of workers whose process has ended are waited for: each
    worker's sessions carry its own ``application_name``. The workers a module
    keeps running, and this process's own connections, stay open meanwhile."""
    if connection.vendor != "postgresql":
        return
    ended = [worker for worker in _started if worker.process.poll() is not None]
    names = [worker.session_name for worker in ended]
    deadline = time.monotonic() + timeout
    with connection.cursor() as cursor:
        while names and time.monotonic() < deadline:
            cursor.execute(
                "SELECT count(*) FROM pg_stat_activity "
                "WHERE datname = current_database() AND application_name = ANY(%s)",
                [names],
            )
            (others,) = cursor.fetchone()
            if not others:
                for worker in ended:
                    _started.remove(worker)
                return
            time.sleep(0.1)


def wait_until_other_sessions_idle(timeout: float = 30, quiet_for: float = 1.0) -> None:
    """Wait until no other session of the test database is inside a transaction,
    and stays so for ``quiet_for`` seconds (PostgreSQL only).

    A test that ends on an event a worker reported may leave that worker's task
    still finishing (a release, a rejection row, a result). A transactional
    test's teardown then TRUNCATEs every table, and a worker transaction that
    holds one of them while waiting for another is a deadlock the server breaks
    by failing one side: sometimes the teardown. Idle sessions (workers between
    tasks, a keep-alive between renewals) hold no table locks and do not count.
    """
    if connection.vendor != "postgresql":
        return
    deadline = time.monotonic() + timeout
    quiet_since: float | None = None
    busy: list[tuple[Any, ...]] = []
    with connection.cursor() as cursor:
        while time.monotonic() < deadline:
            cursor.execute(
                "SELECT pid, state, left(query, 120) FROM pg_stat_activity "
                "WHERE datname = current_database() AND pid <> pg_backend_pid() "
                "AND xact_start IS NOT NULL"
            )
            busy = cursor.fetchall()
            now = time.monotonic()
            if busy:
                quiet_since = None
            elif quiet_since is None:
                quiet_since = now
            elif now - quiet_since >= quiet_for:
                return
            time.sleep(0.05)
    raise AssertionError(f"other sessions still in a transaction after {timeout} s: {busy}")


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def events(path: Path) -> list[dict[str, Any]]:
    """The report's events, each a line a worker appended. A line still being
    written (a read can see part of another process's write) is left for the
    next read: only lines ended by their newline count."""
    if not path.exists():
        return []
    complete = path.read_text().rpartition("\n")[0]
    return [json.loads(line) for line in complete.splitlines() if line.strip()]


def wait_for_event(
    path: Path,
    predicate: Callable[[dict[str, Any]], bool],
    *,
    timeout: float = 30,
    workers: Iterable[Worker] = (),
) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        for event in events(path):
            if predicate(event):
                return event
        if time.monotonic() > deadline:
            logs = "\n".join(f"--- {w.name}\n{w.log_text()[-3000:]}" for w in workers)
            raise AssertionError(f"no such event in time; events so far: {events(path)}\n{logs}")
        time.sleep(0.05)
