"""The chaos controller: start workers, inject faults, collect the history, check it."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from django.conf import settings
from django.core.management import call_command
from django.db import DatabaseError, InterfaceError, connections

from .checker import Report, check
from .faults import FAULT_KINDS, ManagedPostgres
from .history import HistoryWriter, iso, merge, read_events
from .patroni import (
    CLUSTER_FAULT_KINDS,
    ClusterFaults,
    PatroniCluster,
    PatroniError,
    disable_guard,
    failover_figures,
    restore_guard,
)
from .stores import StoreWrites, prepare_stores
from .worker import HOLDING, STARTING

__all__ = ["ChaosConfig", "ChaosError", "ChaosRun"]

MANAGED_ALIAS = "coordination_chaos"
# After the first round (every kind once), pauses are the fault that makes stale
# writes happen, so they come most often.
FAULT_WEIGHTS = {
    "pause": 0.5, "kill": 0.12, "terminate_backend": 0.2, "restart_fast": 0.09, "restart_immediate": 0.09,
}


class ChaosError(RuntimeError):
    """The run could not be carried out (as opposed to a run that found violations)."""


@dataclass
class ChaosConfig:
    seconds: float = 30.0
    workers: int = 4
    keys: int = 2
    ttl: float = 1.0
    seed: int | None = None
    fencing: bool = True
    manage_postgres: bool = False
    history: str | None = None
    fault_interval: float = 1.5
    documents: bool | None = None  # None: when coordination.documents is installed
    # An S3 object and a Redis key per account, written under the cycle's grant
    # (project.lab.chaos.stores): each store is in the workload when given.
    redis_url: str = ""
    s3_endpoint: str = ""
    s3_bucket: str = "coordination-chaos"
    faults: tuple[str, ...] = field(default=FAULT_KINDS)
    celery: bool = False  # the workers are `celery worker` processes running a fenced task
    # Readers, permits of a semaphore and sets of two keys besides exclusive
    # grants (plain workers only; see project.lab.chaos.worker).
    primitives: bool = False
    permits: int = 2  # the semaphore's limit when ``primitives`` is on
    celery_app: str = "project"
    # Seconds the run may go on past ``seconds`` while no stale write was attempted.
    extend_up_to: float = 60.0
    # --patroni: against the Patroni cluster of bin/cluster.sh, with cluster faults
    # (project.lab.chaos.patroni); synchronous replication and the promotion guard.
    patroni: bool = False
    cluster_faults: tuple[str, ...] = field(default=CLUSTER_FAULT_KINDS)
    cluster_interval: float = 5.0  # mean seconds between a recovery and the next cluster fault
    # --patroni --unsafe: the negative control (asynchronous replication, the
    # guard disabled, WAL shipping stopped for lag_seconds before the primary dies).
    unsafe: bool = False
    lag_seconds: float = 3.0
    # With patroni: the run goes on past ``seconds`` (up to ``extend_up_to`` more)
    # until at least this many cluster faults were injected, so that a slow
    # recovery of the cluster cannot leave a run without the failovers it is for.
    min_cluster_faults: int = 0


@dataclass
class WorkerProcess:
    name: str
    process: subprocess.Popen[bytes]
    phase: Path
    stderr: Path
    paused_until: float | None = None

    def holding(self) -> bool:
        return self._phase() == HOLDING

    def starting(self) -> bool:
        return self._phase() == STARTING

    def _phase(self) -> bytes:
        with contextlib.suppress(OSError):
            return self.phase.read_bytes()[:1]
        return b""


class Output(Protocol):
    def write(self, text: str, /) -> Any: ...


class ChaosRun:
    """One chaos run. ``run()`` always stops its workers and managed server."""

    def __init__(self, config: ChaosConfig, out: Output | None = None) -> None:
        self.config = config
        self.out = out or sys.stdout
        self.seed = config.seed if config.seed is not None else random.randrange(2**32)
        self.rng = random.Random(self.seed)
        self.server: ManagedPostgres | None = None
        self.alias = "default"
        self.workers: list[WorkerProcess] = []
        self.spawned = 0
        self.workdir = Path(tempfile.mkdtemp(prefix="coordination-chaos-"))
        self.log: HistoryWriter | None = None
        self.accounts: list[int] = []
        self.documents = False
        self.stores: dict[str, Any] = {}
        self.started = 0.0
        self.queue = f"coordination-chaos-{os.getpid()}-{self.seed:x}"
        self.crashes = 0
        self.sent = 0
        self.semaphore = f"chaos-permits-{os.getpid()}-{self.seed:x}"
        self.cluster: PatroniCluster | None = None
        self.cluster_faults: ClusterFaults | None = None
        self.cluster_config: dict[str, Any] = {}  # Patroni's settings this run changed, as they were
        self.guard_definition: str | None = None  # the guard --unsafe replaced, to put back

    # --- the run ----------------------------------------------------------------

    def run(self) -> Report:
        # SIGTERM ends the run like Ctrl-C does: through the cleanup below.
        previous = signal.getsignal(signal.SIGTERM) or signal.SIG_DFL
        main_thread = threading.current_thread() is threading.main_thread()
        if main_thread:
            signal.signal(signal.SIGTERM, _raise_interrupt)
        try:
            return self._run()
        finally:
            self._cleanup()
            if main_thread:
                signal.signal(signal.SIGTERM, previous)

    def _run(self) -> Report:
        config = self.config
        self.log = HistoryWriter(self.workdir / "controller.jsonl")
        self._prepare_database()
        kinds = self._available_faults()
        self.log.write({"type": "run", "config": {**asdict(config), "seed": self.seed},
                        "faults_available": kinds, "documents": self.documents, "database": self.vendor,
                        "stores": sorted(self.stores)})
        if self.primitives:
            # The checker counts this semaphore's live permits against its limit.
            self.log.write({"type": "semaphore", "name": self.semaphore, "limit": config.permits})
        self._say(
            f"chaos: {config.workers} workers, {config.keys} keys, ttl {config.ttl:g} s, "
            f"{config.seconds:g} s, seed {self.seed}, fencing {'on' if config.fencing else 'OFF'}, "
            f"{'celery workers running a fenced task, ' if config.celery else ''}"
            f"{'readers, permits and sets too, ' if self.primitives else ''}"
            f"{''.join(f'{store} too, ' for store in sorted(self.stores))}"
            f"faults: {', '.join(kinds) or 'none'}"
        )
        for _ in range(config.workers):
            self._spawn()
        self._wait_until_ready()
        self.started = time.monotonic()
        if self.cluster is not None:
            self.cluster_faults = ClusterFaults(
                self.cluster, random.Random(self.rng.randrange(2**32)), self.workdir / "cluster.jsonl",
                kinds=config.cluster_faults, sync=not config.unsafe, unsafe=config.unsafe,
                interval=config.cluster_interval, lag_seconds=config.lag_seconds, say=self._say,
                started=self.started,
            )
            self.cluster_faults.start()
        deadline = self.started + config.seconds
        pending = list(kinds)
        self.rng.shuffle(pending)
        next_fault = self.started + self._fault_gap()
        next_sample = self.started
        # A run in which no stale write was attempted proves nothing, whatever the
        # checker says. On a loaded machine the random pauses may all miss (too
        # short, or nobody took the lock over meanwhile), so the run goes on past
        # ``seconds``, pausing holders for longer than a lease, until one bit or
        # ``extend_up_to`` more seconds have passed. So does a run whose cluster
        # faults have not all come yet (``min_cluster_faults``).
        extended = False
        needs_stale_write = "pause" in kinds and not config.unsafe
        needs_cluster_faults = self.cluster_faults is not None and config.min_cluster_faults > 0
        limit = deadline + (config.extend_up_to if needs_stale_write or needs_cluster_faults else 0.0)
        next_look = deadline
        while (now := time.monotonic()) < limit:
            if now >= deadline and now >= next_look:
                stale_write_missing = needs_stale_write and not self._stale_write_attempted()
                if not stale_write_missing and self._cluster_faults_injected() >= config.min_cluster_faults:
                    break
                if stale_write_missing and not extended:
                    extended = True
                    self._say(f"chaos: no stale write attempted in {config.seconds:g} s; running on "
                              f"(pauses longer than a lease) for up to {config.extend_up_to:g} s more")
                next_look = now + 2.0
            if config.celery:
                self._send_tasks(now)
            self._resume_due(now)
            self._replace_exited()
            if now >= next_sample:
                # A failed sample (no primary right now) waits longer: each try
                # can take a connect timeout per node.
                next_sample = now + (0.3 if self._sample() else 2.0)
            if kinds and now >= next_fault:
                if extended:
                    self._inject("pause", long_pause=True)
                else:
                    kind = pending.pop() if pending else self._weighted_fault(kinds)
                    if not self._inject(kind) and kind not in pending:
                        pending.append(kind)  # no worker to pause now: try it again next time
                next_fault = time.monotonic() + self._fault_gap()
            time.sleep(0.02)
        if self.cluster_faults is not None:
            self._say("chaos: stopping the cluster faults; waiting for every node to be back")
            try:
                self.cluster_faults.finish()
            except PatroniError as error:
                raise ChaosError(str(error)) from error
            assert self.cluster is not None
            self.cluster.wait(lambda: self.cluster and self.cluster.healthy(False), "a healthy cluster", 240)
        self._stop_workers()
        self._sample()
        return self._finish()

    @property
    def primitives(self) -> bool:
        return self.config.primitives and not self.config.celery

    @property
    def lock_keys(self) -> list[str]:
        """Every lock key of the run: the accounts' and, with primitives, the slots'."""
        keys = [f"account:{pk}" for pk in self.accounts]
        if self.primitives:
            keys += [f"{self.semaphore}@{slot}" for slot in range(1, self.config.permits + 1)]
        return keys

    @property
    def vendor(self) -> str:
        return str(connections[self.alias].vendor)

    def _say(self, message: str) -> None:
        self.out.write(message + "\n")
        if hasattr(self.out, "flush"):
            self.out.flush()

    def _fault_gap(self) -> float:
        return self.rng.uniform(0.5, 1.5) * self.config.fault_interval

    def _weighted_fault(self, kinds: list[str]) -> str:
        return self.rng.choices(kinds, weights=[FAULT_WEIGHTS[kind] for kind in kinds])[0]

    def _available_faults(self) -> list[str]:
        kinds = [kind for kind in self.config.faults if kind in FAULT_KINDS]
        if self.config.unsafe:
            return []  # the negative control: only the lag and the kill of the primary
        if self.vendor != "postgresql":
            kinds = [kind for kind in kinds if kind in {"pause", "kill"}]
        if self.server is None:
            kinds = [kind for kind in kinds if not kind.startswith("restart")]
        return kinds

    # --- database ---------------------------------------------------------------

    def _prepare_database(self) -> None:
        from project.demo.models import Account

        if self.config.patroni:
            self._prepare_cluster()
        elif self.config.manage_postgres:
            self._say("chaos: starting a throwaway PostgreSQL server ...")
            self.server = ManagedPostgres()
            self.server.start()
            self.alias = MANAGED_ALIAS
            settings.DATABASES[self.alias] = self.server.settings_dict()
            connections.configure_settings(settings.DATABASES)
            call_command("migrate", database=self.alias, verbosity=0, interactive=False)
            self._say(f"chaos: PostgreSQL on port {self.server.port} under {self.server.root}")
        wanted = self.config.documents
        available = importlib.util.find_spec("coordination.documents") is not None
        self.documents = available if wanted is None else (wanted and available)
        run_id = f"{self.seed:x}"
        try:
            self.stores = prepare_stores(
                f"{os.getpid()}-{run_id}", redis_url=self.config.redis_url,
                s3_endpoint=self.config.s3_endpoint, s3_bucket=self.config.s3_bucket,
            )
        except RuntimeError as error:
            raise ChaosError(str(error)) from None
        for index in range(self.config.keys):
            account = Account.objects.using(self.alias).create(owner=f"chaos-{run_id}-{index}")
            self.accounts.append(account.pk)

    def _prepare_cluster(self) -> None:
        """Connect to the running cluster of bin/cluster.sh, set its replication mode,
        migrate it; for --unsafe, disable the guard and allow any lag at promotion."""
        cluster = PatroniCluster()
        if cluster.leader() is None:
            raise ChaosError("--patroni needs the Patroni cluster running with a leader "
                             "(bin/cluster.sh start)")
        self.cluster = cluster
        for node in cluster.start_stopped_nodes():
            self._say(f"chaos: node{node} was down; started it")
        wanted: dict[str, Any] = {
            "synchronous_mode": not self.config.unsafe, "synchronous_mode_strict": not self.config.unsafe,
        }
        if self.config.unsafe:
            # Patroni would not promote a standby lagging more than 1 MiB; the
            # negative control must fail over whatever the lag.
            wanted["maximum_lag_on_failover"] = 2**40
        found = cluster.config()
        self.cluster_config = {name: found.get(name) for name in wanted}
        cluster.patch_config(wanted)
        mode = "asynchronous" if self.config.unsafe else "synchronous (strict)"
        self._say(f"chaos: Patroni cluster, {mode} replication; waiting for two streaming standbys ...")
        cluster.wait(lambda: cluster.healthy(not self.config.unsafe), "a leader and two standbys", 240)
        self.alias = MANAGED_ALIAS
        settings.DATABASES[self.alias] = cluster.database_settings()
        connections.configure_settings(settings.DATABASES)
        self._query(lambda cursor: cursor.execute("SELECT 1"))
        call_command("migrate", database=self.alias, verbosity=0, interactive=False)
        if self.config.unsafe:
            self.guard_definition = self._query(disable_guard)
            self._say("chaos: --unsafe: the promotion guard is DISABLED in the cluster's database")

    def _restore_cluster(self) -> None:
        """Put back what _prepare_cluster changed (best effort: the cluster may be gone)."""
        if self.guard_definition is not None:
            definition = self.guard_definition
            with contextlib.suppress(Exception):
                self._query(lambda cursor: restore_guard(cursor, definition))
                self.guard_definition = None
            if self.guard_definition is not None:
                self._say("chaos: could not put the promotion guard back: the cluster's database "
                          "has none; bin/cluster.sh stop removes the cluster")
        if self.cluster is not None and self.cluster_config:
            restored = dict(self.cluster_config)
            if restored.get("synchronous_mode") is None:
                restored.update(synchronous_mode=False, synchronous_mode_strict=False)
            with contextlib.suppress(Exception):
                self.cluster.patch_config(restored)

    def _worker_database(self, name: str) -> dict[str, Any]:
        database: dict[str, Any] = json.loads(
            json.dumps(connections[self.alias].settings_dict, default=str)
        )
        if database["ENGINE"].endswith("postgresql"):
            # The name lets the controller find this worker's backend to terminate it.
            database["OPTIONS"] = {**database.get("OPTIONS", {}), "application_name": _app_name(name)}
        database["CONN_MAX_AGE"] = None
        return database

    def _query(self, work: Callable[[Any], Any], timeout: float | None = None) -> Any:
        """Run a controller query, tolerating a server that is restarting (or, on the
        cluster, a primary that is failing over)."""
        if timeout is None:
            timeout = 180.0 if self.config.patroni else 10.0
        deadline = time.monotonic() + timeout
        while True:
            try:
                with connections[self.alias].cursor() as cursor:
                    return work(cursor)
            except (DatabaseError, InterfaceError):
                with contextlib.suppress(Exception):
                    connections[self.alias].close()
                if time.monotonic() > deadline:
                    raise ChaosError(f"the database did not come back within {timeout:g} s") from None
                time.sleep(0.2)

    # --- workers -----------------------------------------------------------------

    def _spawn(self) -> WorkerProcess:
        self.spawned += 1
        name = f"w{self.spawned}"
        phase = self.workdir / f"{name}.phase"
        phase.write_bytes(STARTING)
        config = {
            "worker": name, "number": self.spawned, "parent": os.getpid(),
            "accounts": self.accounts, "ttl": self.config.ttl,
            "seed": self.rng.randrange(2**32), "fencing": self.config.fencing,
            "documents": self.documents, "stores": self.stores,
            "history": str(self.workdir / f"{name}.jsonl"),
            "primitives": self.primitives, "semaphore": self.semaphore, "limit": self.config.permits,
            "phase": str(phase), "settings": settings.SETTINGS_MODULE,
            "database": self._worker_database(name),
        }
        config_path = self.workdir / f"{name}.json"
        config_path.write_text(json.dumps(config))
        stderr = self.workdir / f"{name}.stderr"
        environment = {
            **os.environ, "PYTHONPATH": os.pathsep.join(_import_roots()),
            "DJANGO_SETTINGS_MODULE": settings.SETTINGS_MODULE,
        }
        command = [sys.executable, "-m", "project.lab.chaos.worker", str(config_path)]
        if self.config.celery:
            from .celery_tasks import CONFIG_ENVIRONMENT

            environment[CONFIG_ENVIRONMENT] = str(config_path)
            if self.cluster is not None:
                # The worker points its default database at the cluster once Django
                # has made the connection wrapper, whose class follows the site's
                # default ENGINE: that must be PostgreSQL too.
                environment["DATABASE_URL"] = "postgres://coordination@127.0.0.1/coordination"
            # The solo pool runs the task in the worker process itself, so a
            # SIGSTOP of that process pauses the task mid-way.
            command = [
                sys.executable, "-m", "celery", "-A", self.config.celery_app, "worker",
                "-P", "solo", "--prefetch-multiplier", "1", "-Q", self.queue, "-n", f"{name}@%h",
                "--include", "project.lab.chaos.celery_tasks",
                "--without-gossip", "--without-mingle", "--without-heartbeat", "-l", "WARNING",
            ]
        with open(stderr, "wb") as errors:
            process = subprocess.Popen(
                command, stdin=subprocess.DEVNULL, stdout=errors, stderr=errors, env=environment,
            )
        worker = WorkerProcess(name, process, phase, stderr)
        self.workers.append(worker)
        return worker

    def _wait_until_ready(self, timeout: float = 120) -> None:
        """The run's clock starts when every worker has started (Celery workers take
        seconds on a loaded machine)."""
        deadline = time.monotonic() + timeout
        while any(worker.starting() for worker in self.workers):
            for worker in self.workers:
                if worker.process.poll() is not None:
                    raise ChaosError(
                        f"worker {worker.name} exited with {worker.process.returncode} while starting:\n"
                        + worker.stderr.read_text(errors="replace")[-3000:]
                    )
            if time.monotonic() > deadline:
                raise ChaosError(f"workers did not start within {timeout:g} s")
            time.sleep(0.05)

    def _replace_exited(self) -> None:
        for worker in list(self.workers):
            code = worker.process.poll()
            if code is None:
                continue
            self.workers.remove(worker)
            tail = worker.stderr.read_text(errors="replace")[-2000:]
            assert self.log is not None
            self.log.write({"type": "worker_exit", "worker": worker.name, "returncode": code, "stderr": tail})
            self._say(f"chaos: worker {worker.name} exited with {code} on its own; starting another\n{tail}")
            self.crashes += 1
            if self.crashes > 20:
                raise ChaosError(f"workers keep exiting on their own; the last one said:\n{tail}")
            self._spawn()

    def _resume_due(self, now: float) -> None:
        for worker in self.workers:
            if worker.paused_until is not None and now >= worker.paused_until:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(worker.process.pid, signal.SIGCONT)
                worker.paused_until = None

    def _stop_workers(self) -> None:
        for worker in self.workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker.process.pid, signal.SIGCONT)
                worker.paused_until = None
                worker.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 3 * self.config.ttl + 10
        for worker in self.workers:
            with contextlib.suppress(subprocess.TimeoutExpired):
                worker.process.wait(max(0.1, deadline - time.monotonic()))
        for worker in self.workers:
            if worker.process.poll() is None:
                worker.process.kill()
                worker.process.wait()

    def _send_tasks(self, now: float) -> None:
        """Keep the Celery workers busy: about one task per worker and lease length.
        Tasks expire unstarted after a few leases, so a backlog never builds up."""
        from .celery_tasks import chaos_cycle

        due = int((now - self.started) * self.config.workers / self.config.ttl) + self.config.workers
        while self.sent < due:
            chaos_cycle.apply_async(
                args=[self.rng.choice(self.accounts)], queue=self.queue, expires=3 * self.config.ttl
            )
            self.sent += 1

    def _delete_queue(self) -> None:
        """Remove the run's queue and its binding from the broker (best effort)."""
        from celery import current_app
        from kombu import Exchange, Queue

        with contextlib.suppress(Exception), current_app.connection_for_write() as connection:
            # Declared here so that this channel knows the binding it must remove.
            queue = Queue(self.queue, Exchange(self.queue, type="direct"), routing_key=self.queue,
                          channel=connection.default_channel)
            queue.declare()
            queue.delete()

    # --- faults ------------------------------------------------------------------

    def _inject(self, kind: str, *, long_pause: bool = False) -> bool:
        """Inject one fault of ``kind``; False if there was nothing to inject it into.

        ``long_pause``: a pause of 2 to 4 leases, so that the lease runs out and
        another worker can take the lock over while this one sleeps.
        """
        assert self.log is not None
        fault: dict[str, Any] = {"type": "fault", "kind": kind}
        if kind == "pause":
            worker = self._pick_holding()
            if worker is None:
                return False
            low, high = (2.0, 4.0) if long_pause else (0.5, 3.0)
            duration = self.rng.uniform(low, high) * self.config.ttl
            fault.update(worker=worker.name, seconds=round(duration, 3), holding=worker.holding())
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker.process.pid, signal.SIGSTOP)
                worker.paused_until = time.monotonic() + duration
        elif kind == "kill":
            worker = self.rng.choice(self.workers)
            fault["worker"] = worker.name
            worker.process.kill()
            worker.process.wait()
            self.workers.remove(worker)
            fault["replacement"] = self._spawn().name
        elif kind == "terminate_backend":
            worker = self.rng.choice([w for w in self.workers if w.paused_until is None] or self.workers)
            fault["worker"] = worker.name
            try:
                # On the cluster, at most a connect timeout: during a failover there is
                # no primary to find the backend on, and the main loop must go on.
                fault["terminated"] = self._query(
                    lambda cursor: _terminate(cursor, _app_name(worker.name)),
                    timeout=0.0 if self.config.patroni else None,
                )
            except ChaosError:
                return False
        else:
            assert self.server is not None
            mode = kind.removeprefix("restart_")
            with contextlib.suppress(Exception):
                connections[self.alias].close()
            fault["seconds"] = round(self.server.restart(mode), 3)
        self.log.write(fault)
        self._say(f"chaos: t+{time.monotonic() - self.started:5.1f}s fault {kind} "
                  f"{fault.get('worker', '')}".rstrip())
        return True

    def _cluster_faults_injected(self) -> int:
        return self.cluster_faults.injected if self.cluster_faults is not None else 0

    def _stale_write_attempted(self) -> bool:
        """Whether the history so far holds a write with a token older than one
        already used on its resource (the histories are flushed line by line)."""
        events = [event for path in sorted(self.workdir.glob("*.jsonl")) for event in read_events(path)]
        events.sort(key=lambda event: float(event.get("mono", 0.0)))
        return check(events).stale_attempts > 0

    def _pick_holding(self) -> WorkerProcess | None:
        """A running worker that holds a lease and has not written yet, if one shows up
        soon (its pause then straddles the lease's expiry); else any running worker."""
        running = [w for w in self.workers if w.paused_until is None and not w.starting()]
        if len(running) <= 1:
            return None  # keep someone running, to take the lock over
        deadline = time.monotonic() + self.config.ttl
        while time.monotonic() < deadline:
            holding = [w for w in running if w.holding()]
            if holding:
                return self.rng.choice(holding)
            time.sleep(0.005)
        return self.rng.choice(running)

    # --- observations and the final state ----------------------------------------

    def _sample(self) -> bool:
        """Log the counters and watermarks; False if the database did not answer."""
        assert self.log is not None
        keys = self.lock_keys
        try:
            observed = _observe(self.alias, keys, self.accounts)
        except (DatabaseError, InterfaceError):
            with contextlib.suppress(Exception):
                connections[self.alias].close()
            return False
        for name, token, step in observed:
            self.log.write({"type": "observe", "object": name, "token": token, "step": step})
        return True

    def _finish(self) -> Report:
        from coordination.models import Document, Fence, Grant, IdempotencyRecord, Lock
        from project.demo.models import Account

        assert self.log is not None
        log, alias = self.log, self.alias
        self._query(lambda cursor: cursor.execute("SELECT 1"))  # wait for a restarting server
        keys = self.lock_keys
        for grant in Grant.objects.using(alias).filter(lock__key__in=keys).select_related("lock"):
            log.write({"type": "grant_row", "key": grant.lock.key, "token": grant.token,
                       "holder": grant.holder, "acquired_at": iso(grant.acquired_at),
                       "expires_at": iso(grant.expires_at), "ended_at": iso(grant.ended_at),
                       "end_reason": grant.end_reason, "mode": grant.mode})
        for lock in Lock.objects.using(alias).filter(key__in=keys):
            log.write({"type": "lock_row", "key": lock.key, "token": lock.token})
        for account in Account.objects.using(alias).filter(pk__in=self.accounts):
            log.write({"type": "final", "resource": f"account:{account.pk}", "token": account.fence,
                       "step": account.fence_step, "value": int(account.balance)})
        fences = {f.resource: f for f in Fence.objects.using(alias).filter(lock_key__in=keys)}
        for resource in [f"ledger:{pk}" for pk in self.accounts] + [
            f"ledger:{key}" for key in keys if not key.startswith("account:")
        ]:
            ledger = IdempotencyRecord.objects.using(alias).filter(key__startswith=f"chaos:{resource}:")
            records = {record.key: record.result for record in ledger}
            log.write({"type": "stored_resource", "resource": resource})
            for record_key, result in records.items():
                token, step = record_key.rsplit(":", 2)[-2:]
                log.write({"type": "stored", "resource": resource, "token": int(token), "step": int(step),
                           "value": (result or {}).get("value")})
            row = fences.get(resource)
            if row is not None:
                stored = records.get(f"chaos:{resource}:{row.token}:{row.step}") or {}
                log.write({"type": "final", "resource": resource, "token": row.token, "step": row.step,
                           "value": stored.get("value")})
        if self.documents:
            names = [f"chaos-{pk}" for pk in self.accounts]
            for document in Document.objects.using(alias).filter(name__in=names):
                row = Fence.objects.using(alias).get(pk=document.fence_id)
                log.write({"type": "final", "resource": row.resource, "token": row.token, "step": row.step,
                           "value": (document.data or {}).get("value")})
        for event in StoreWrites(self.stores, self.config.fencing).final_events(self.accounts):
            log.write(event)
        log.close()
        paths = sorted(self.workdir.glob("*.jsonl"))
        target = Path(self.config.history) if self.config.history else self.workdir / "history.merged"
        events = merge(paths, target)
        report = check(events)
        if not self.config.history and self.config.fencing and not self.config.unsafe and not report.passed:
            # A fenced run failed: keep the evidence.
            handle, kept = tempfile.mkstemp(prefix="coordination-chaos-history-", suffix=".jsonl")
            os.close(handle)
            shutil.copyfile(target, kept)
            self._say(f"chaos: the history of this failed run is kept in {kept}")
        report.figures.update(
            seed=self.seed, seconds=self.config.seconds, workers=self.config.workers, keys=self.config.keys,
            ttl=self.config.ttl, fencing=self.config.fencing, workers_started=self.spawned,
            documents=self.documents, stores=sorted(self.stores),
            managed_postgres=self.server is not None, database=self.vendor,
            faults_requested=list(self._available_faults()),
            faults_missing=sorted(set(self._available_faults()) - set(report.figures["faults_by_kind"])),
            worker_crashes=sum(1 for event in events if event.get("type") == "worker_exit"),
            celery=self.config.celery, tasks_sent=self.sent, primitives=self.primitives,
            patroni=self.config.patroni, unsafe=self.config.unsafe,
        )
        if self.config.patroni:
            from coordination.backends.postgresql import FAILOVER_MARGIN

            report.figures.update(failover_figures(events, FAILOVER_MARGIN))
        return report

    # --- cleanup ----------------------------------------------------------------------

    def _cleanup(self) -> None:
        for worker in self.workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker.process.pid, signal.SIGCONT)
            if worker.process.poll() is None:
                worker.process.kill()
            with contextlib.suppress(Exception):
                worker.process.wait(10)
        self.workers.clear()
        if self.config.celery:
            self._delete_queue()
        if self.stores:
            with contextlib.suppress(Exception):
                StoreWrites(self.stores, True).cleanup(self.accounts)
        if self.log is not None:
            with contextlib.suppress(Exception):
                self.log.close()
        if self.cluster_faults is not None and self.cluster_faults.is_alive():
            with contextlib.suppress(Exception):
                self.cluster_faults.finish()
        if self.cluster is not None:
            self._restore_cluster()
        if self.alias == MANAGED_ALIAS:
            with contextlib.suppress(Exception):
                connections[self.alias].close()
            with contextlib.suppress(Exception):
                del connections[self.alias]
            settings.DATABASES.pop(self.alias, None)
        if self.server is not None:
            self.server.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _app_name(worker: str) -> str:
    return f"coordination-chaos-{os.getpid()}-{worker}"


def _import_roots() -> Iterator[str]:
    """Directories the worker needs on its path: the app's, this site's and the settings'."""
    import coordination

    yield str(Path(coordination.__file__).resolve().parent.parent)
    yield str(Path(__file__).resolve().parents[3])  # holds project/, for project.lab.chaos.worker
    spec = importlib.util.find_spec(settings.SETTINGS_MODULE.partition(".")[0])
    if spec is not None and spec.origin:
        yield str(Path(spec.origin).resolve().parent.parent)
    yield os.getcwd()
    yield from (path for path in os.environ.get("PYTHONPATH", "").split(os.pathsep) if path)


def _terminate(cursor: Any, application_name: str) -> int:
    # Only backends of this run's own database, and only the worker's.
    cursor.execute(
        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
        "WHERE datname = current_database() AND application_name = %s",
        [application_name],
    )
    return int(cursor.fetchone()[0])


def _observe(alias: str, keys: list[str], accounts: list[int]) -> list[tuple[str, int, int]]:
    """The counters and watermarks of the run's locks and resources, right now."""
    from coordination.models import Fence, Lock
    from project.demo.models import Account

    locks = Lock.objects.using(alias).filter(key__in=keys).values_list("key", "token")
    fences = Fence.objects.using(alias).filter(lock_key__in=keys).values_list("resource", "token", "step")
    rows = Account.objects.using(alias).filter(pk__in=accounts).values_list("pk", "fence", "fence_step")
    return (
        [(f"lock:{key}", token, 0) for key, token in locks]
        + [(f"fence:{resource}", token, step) for resource, token, step in fences]
        + [(f"account:{pk}", fence, step) for pk, fence, step in rows]
    )




