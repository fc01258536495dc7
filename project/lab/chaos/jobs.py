"""Jobs chaos: real workers run coordinated jobs while they are paused, killed and
their messages delivered twice; the history of committed effects is then judged.

``coordination_chaos --jobs`` (and tests/processes/test_jobs_chaos.py) run
this. The controller starts ``workers`` ``celery worker`` processes (solo pool,
so SIGSTOP pauses the task itself) on the run's own Redis queue, acknowledging
late, with a short visibility timeout. For ``seconds`` it sends the tasks of
:mod:`project.lab.chaos.jobs_tasks` (some ``job_once`` messages twice, with one
task id) and, in turns, injects a fault:

- ``kill_after_commit``: waits for a ``job_once`` body to commit and kills its
  worker (SIGKILL) before the ack; Redis delivers the message again;
- ``pause``: stops a busy worker (SIGSTOP) past its leases, then resumes it;
- ``kill``: kills a worker at a random moment.

A killed worker is replaced. At the end it waits until every message was run,
and checks, over the rows the bodies committed (database clock):

- no more than ``cap`` executions of a key of ``job_capped`` at once (the
  interval of an execution is from its start row to its end row, both
  written through its permit slot's fence);
- no completed task id of ``job_once`` ran its body twice;
- no unique key of ``job_unique`` ran the bodies of two messages (each sent
  several times at once, around the enqueue's check);
- no window of the period of ``job_rated`` holds more than N starts of a key:
  judged on the limiter's log of starts (read during the run, as the limiter
  prunes it), with every committed body backed by a logged start; in the
  negative control, which logs nothing, on the bodies' rows;
- nothing lost: every task id sent has a committed body (a unique key: one).

The negative control (``fenced=False``) runs the same bodies without the
features (a plain task, ``once=False``) and the same checker finds violations.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from django.db import connections

from .celery_run import CeleryChaos, ChaosProcess, Output
from .jobs_checks import (
    lost_task_ids,
    most_at_once,
    most_in_window,
    ran_more_than_once,
    unique_keys_run_twice,
)

__all__ = [
    "JobsChaos", "JobsChaosConfig", "JobsReport", "lost_task_ids", "most_at_once", "most_in_window",
    "ran_more_than_once", "unique_keys_run_twice",
]

CAPPED = "coordination_chaos.job_capped"
ONCE = "coordination_chaos.job_once"
UNIQUE = "coordination_chaos.job_unique"
RATED = "coordination_chaos.job_rated"
TABLE = "coordination_chaos_job_effect"
JOB_FAULT_KINDS = ("kill_after_commit", "pause", "kill")


@dataclass
class JobsChaosConfig:
    seconds: float = 20.0
    workers: int = 3
    cap: int = 2
    keys: int = 2
    ttl: float = 2.0
    #: Redis's visibility timeout: a message unacknowledged this long is delivered again.
    visibility: float = 6.0
    #: Seconds between a ``job_once`` body's commit and its ack.
    ack_delay: float = 1.5
    fault_interval: float = 3.0
    faults: tuple[str, ...] = JOB_FAULT_KINDS
    #: One ``job_once`` message in this many is sent twice with one task id.
    duplicate_every: int = 3
    #: ``job_rated``'s limit: N starts per period of seconds, per key.
    rate_limit: int = 2
    rate_period: float = 3.0
    #: Copies of each ``job_unique`` key sent at once.
    unique_copies: int = 3
    fenced: bool = True
    seed: int | None = None
    broker: str | None = None
    celery_app: str = "project"
    settle_timeout: float = 120.0


@dataclass
class JobsReport:
    passed: bool
    violations: list[str]
    figures: dict[str, Any] = field(default_factory=dict)

    def summary(self) -> str:
        figures = self.figures
        verdict = "PASSED" if self.passed else "FAILED"
        lines = [
            f"jobs chaos {verdict}: {'fenced' if figures.get('fenced') else 'negative control'}, "
            f"{figures.get('seconds_run')} s, {figures.get('workers')} workers, seed {figures.get('seed')}",
            f"  sent: {figures.get('capped_sent')} capped, {figures.get('once_sent')} once "
            f"({figures.get('once_duplicated')} published twice)",
            f"  faults: {figures.get('faults')}",
            f"  capped: most at once per key {figures.get('most_at_once')} (cap {figures.get('cap')}), "
            f"{figures.get('capped_completed')} completed, {figures.get('refused')} stale writes refused",
            f"  once: {figures.get('once_bodies')} committed bodies for {figures.get('once_ids')} task ids, "
            f"{figures.get('once_redelivered')} ids delivered more than once",
            f"  unique: {figures.get('unique_keys')} keys sent {figures.get('unique_copies')} times each, "
            f"most messages of a key run {figures.get('unique_most_run')}",
            f"  rate: {figures.get('rated_sent')} sent, most starts in a window "
            f"{figures.get('rate_most_in_window')} (limit {figures.get('rate_limit')} per "
            f"{figures.get('rate_period')} s), {figures.get('rate_logged')} logged starts",
            f"  violations: {len(self.violations)}",
        ]
        lines += [f"    {violation}" for violation in self.violations[:20]]
        return "\n".join(lines) + "\n"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class JobsChaos(CeleryChaos[JobsChaosConfig]):
    """One jobs chaos run; ``run()`` always stops every process it started."""

    kind = "jobs"
    label = "jobs chaos"

    def __init__(self, config: JobsChaosConfig, out: Output | None = None) -> None:
        super().__init__(config, out)
        self.workers: list[ChaosProcess] = []
        self.faults: Counter[str] = Counter()
        self.capped_sent: list[str] = []
        self.once_sent: list[str] = []
        self.once_duplicated = 0
        self.unique_sent: dict[str, list[str]] = {}
        self.rated_sent: list[str] = []
        self.rate_keys = [f"{self.tag}-r{index}" for index in range(2)]
        self.rate_log: dict[str, set[Any]] = {key: set() for key in self.rate_keys}
        self._publishing = threading.Event()
        self._lock = threading.Lock()

    # --- the run -------------------------------------------------------------------------

    def run(self) -> JobsReport:
        report: JobsReport = super().run()
        return report

    def _run(self) -> JobsReport:
        config = self.config
        self._say(f"jobs chaos: seed {self.seed}, queue {self.queue}, workdir {self.workdir}, "
                  f"{'fenced' if config.fenced else 'negative control'}")
        self._create_table()
        for _ in range(config.workers):
            self._start_worker()
        self._wait(lambda: all(" ready." in w.text() for w in self.workers), 120, "the workers")
        self.started = time.monotonic()
        self._publishing.set()
        publisher = threading.Thread(target=self._publish, name="jobs-chaos-publisher", daemon=True)
        publisher.start()
        kinds = list(config.faults)
        turn = 0
        while time.monotonic() - self.started < config.seconds or (turn < len(kinds) and kinds):
            time.sleep(config.fault_interval * self.rng.uniform(0.5, 1.0))
            if not kinds:
                continue
            kind = kinds[turn % len(kinds)] if turn < len(kinds) else self.rng.choice(kinds)
            turn += 1
            if self._fault(kind):
                self.faults[kind] += 1
        self._publishing.clear()
        publisher.join(30)
        seconds_run = time.monotonic() - self.started
        self._settle()
        return self._judge(seconds_run)

    # --- processes -----------------------------------------------------------------------

    def _settings(self) -> dict[str, str]:
        config = self.config
        return {
            "COORDINATION_JOBS_VISIBILITY": str(config.visibility),
            "COORDINATION_JOBS_ACK_DELAY": str(config.ack_delay),
            "COORDINATION_JOBS_FENCED": "1" if config.fenced else "0",
            "COORDINATION_JOBS_CAP": str(config.cap),
            "COORDINATION_JOBS_TTL": str(config.ttl),
            "COORDINATION_JOBS_RUN": self.tag,
            "COORDINATION_JOBS_RATE": f"{config.rate_limit}/{config.rate_period:g}s",
        }

    def _start_worker(self) -> ChaosProcess:
        self.spawned += 1
        worker = self._start(f"worker{self.spawned}", [
            "worker", "-P", "solo", "-Q", self.queue, "-n", f"jobs-chaos-{self.tag}-{self.spawned}@%h",
            "--without-gossip", "--without-mingle", "--without-heartbeat", "-l", "INFO",
        ])
        self.workers.append(worker)
        return worker

    # --- the workload --------------------------------------------------------------------

    def _publish(self) -> None:
        from project.celery import app

        config = self.config
        transport = {"global_keyprefix": self.prefix}
        import redis

        client = redis.Redis.from_url(self._broker())
        with app.connection_for_write(self._broker(), transport_options=transport) as connection:
            sent = 0
            while self._publishing.is_set():
                # A backlog the workers can run down: everything sent must run by the end.
                if client.llen(self.prefix + self.queue) > 2 * config.workers:
                    time.sleep(0.2)
                    continue
                sent += 1
                key = f"{self.tag}-k{self.rng.randrange(config.keys)}"
                # Now and then one more of a key than its cap at once, so that the
                # cap has work to do (and the negative control something to break).
                burst = config.cap + 1 if sent % 4 == 1 else 1
                for _ in range(burst):
                    capped = app.send_task(CAPPED, args=(key, self.rng.uniform(0.5, 1.2)),
                                           queue=self.queue, connection=connection)
                    with self._lock:
                        self.capped_sent.append(capped.id)
                if sent % 2 == 0:
                    task_id = f"once-{self.tag}-{sent}"
                    copies = 2 if (sent // 2) % config.duplicate_every == 0 else 1
                    for _ in range(copies):
                        app.send_task(ONCE, args=(sent, 0.2), queue=self.queue, task_id=task_id,
                                      connection=connection)
                    with self._lock:
                        self.once_sent.append(task_id)
                        self.once_duplicated += copies - 1
                if sent % 6 == 3:
                    # Copies of one unique key at once, straight to the broker.
                    key = f"{self.tag}-u{sent}"
                    ids = [app.send_task(UNIQUE, args=(key, copy, 0.3), queue=self.queue,
                                         connection=connection).id for copy in range(config.unique_copies)]
                    with self._lock:
                        self.unique_sent[key] = ids
                if sent % 12 == 0:
                    # One more start of a key than its limit at once: some wait their turn.
                    key = self.rng.choice(self.rate_keys)
                    for copy in range(config.rate_limit + 1):
                        rated = app.send_task(RATED, args=(key, sent * 10 + copy), queue=self.queue,
                                              connection=connection)
                        with self._lock:
                            self.rated_sent.append(rated.id)
                self._read_rate_log()
                time.sleep(self.rng.uniform(0.1, 0.4))

    def _read_rate_log(self) -> None:
        """Add the limiter's logged starts of the run's rate keys (it prunes starts
        older than two periods, so this is read at least once a period)."""
        if not self.config.fenced:
            return
        from coordination import jobs, ratelimits

        with contextlib.suppress(Exception):  # a connection the faults broke: next time
            for key in self.rate_keys:
                self.rate_log[key].update(ratelimits.starts_of(jobs.rate_bucket(RATED, key)))

    # --- faults --------------------------------------------------------------------------

    def _fault(self, kind: str) -> bool:
        live = [worker for worker in self.workers if worker.alive() and not worker.paused]
        if len(live) < 2:
            return False
        if kind == "kill_after_commit":
            return self._kill_after_commit()
        if kind == "pause":
            worker = self._busy_worker(live)
            os.kill(worker.pid, signal.SIGSTOP)
            worker.paused = True
            self._say(f"jobs chaos: paused {worker.name} (pid {worker.pid})")
            time.sleep(self.config.ttl * 2 + 0.5)  # past its leases, under the visibility timeout
            os.kill(worker.pid, signal.SIGCONT)
            worker.paused = False
            return True
        worker = self.rng.choice(live)
        self._kill(worker)
        return True

    def _kill_after_commit(self) -> bool:
        """Kill the worker of the next ``job_once`` body that commits, before its ack."""
        after = self._database_now()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            rows = self._rows("once", "done", after)
            pids = {worker.pid: worker for worker in self.workers if worker.alive() and not worker.paused}
            for row in rows:
                if row["pid"] in pids:
                    self._kill(pids[row["pid"]])
                    return True
            time.sleep(0.05)
        return False

    def _busy_worker(self, live: Sequence[ChaosProcess]) -> ChaosProcess:
        recent = {row["pid"] for row in self._rows("cap", "start", None, last=20)}
        busy = [worker for worker in live if worker.pid in recent]
        return self.rng.choice(busy or list(live))

    def _kill(self, worker: ChaosProcess) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(worker.pid, signal.SIGKILL)
        worker.process.wait(10)
        self._say(f"jobs chaos: killed {worker.name} (pid {worker.pid})")
        self._start_worker()

    # --- the end -------------------------------------------------------------------------

    def _settle(self) -> None:
        """Wait until every sent message has been run (the queue and the unacknowledged
        set empty, nothing committed for a while), resuming any paused worker."""
        for worker in self.workers:
            if worker.paused and worker.alive():
                os.kill(worker.pid, signal.SIGCONT)
                worker.paused = False
        import redis

        client = redis.Redis.from_url(self._broker())
        quiet_since = time.monotonic()
        last_count = -1
        deadline = time.monotonic() + self.config.settle_timeout
        while time.monotonic() < deadline:
            waiting = client.llen(self.prefix + self.queue) + client.hlen(self.prefix + "unacked")
            count = len(self._rows(None, None, None))
            if count != last_count or waiting:
                quiet_since, last_count = time.monotonic(), count
            self._read_rate_log()
            if not waiting and time.monotonic() - quiet_since > self.config.ttl * 2 + 2:
                return
            time.sleep(0.5)
        self._say("jobs chaos: messages still waiting at the settle timeout")

    def _judge(self, seconds_run: float) -> JobsReport:
        from coordination.models import Execution, Rejection

        rows = self._rows(None, None, None)
        violations: list[str] = []
        most = most_at_once(rows)
        for key, peak in sorted(most.items()):
            if peak > self.config.cap:
                violations.append(f"{peak} executions of {key} at once, cap {self.config.cap}")
        twice = ran_more_than_once(rows)
        violations += [
            f"task id {task_id} ran its body {count} times" for task_id, count in sorted(twice.items())
        ]
        lost = lost_task_ids(rows, self.once_sent, "once", "body")
        violations += [f"task id {task_id} was sent and never ran its body" for task_id in lost]
        # A copy whose write its fence refused (paused past its slot's lease) is
        # fencing at work, not a lost task: it ran into the newer holder.
        ours = f"chaos-cap:{self.tag}-"  # this run's keys (and slots), not an earlier run's
        refused = set(Rejection.objects.filter(lock_key__startswith=ours).values_list("lock_key", "token"))
        executions = Execution.objects.filter(task=CAPPED, lock_key__startswith=ours)
        refused_ids = {
            task_id for task_id, key, token in executions.values_list("task_id", "lock_key", "token")
            if (key, token) in refused
        }
        lost_capped = [task_id for task_id in lost_task_ids(rows, self.capped_sent, "cap", "end")
                       if task_id not in refused_ids]
        violations += [f"capped task {task_id} never completed" for task_id in lost_capped]
        run_twice = unique_keys_run_twice(rows)
        violations += [
            f"unique key {key} ran {count} messages' bodies" for key, count in sorted(run_twice.items())
        ]
        unique_run = {row["key"] for row in rows if row["scenario"] == "unique" and row["phase"] == "body"}
        violations += [
            f"unique key {key} was sent and never ran" for key in sorted(set(self.unique_sent) - unique_run)
        ]
        period, limit = self.config.rate_period, self.config.rate_limit
        bodies: dict[str, list[Any]] = defaultdict(list)
        for row in rows:
            if row["scenario"] == "rate" and row["phase"] == "body":
                bodies[row["key"]].append(row["at"])
        # The limiter's log is what it decided; without the feature there is none,
        # and the bodies' own times are judged.
        judged = self.rate_log if self.config.fenced else bodies
        rate_most = {key: most_in_window(times, period) for key, times in judged.items()}
        violations += [f"{most} starts of {key} in one {period:g} s window, limit {limit}"
                       for key, most in sorted(rate_most.items()) if most > limit]
        if self.config.fenced:
            violations += [f"{len(times)} bodies of {key} for {len(self.rate_log[key])} logged starts"
                           for key, times in sorted(bodies.items()) if len(times) > len(self.rate_log[key])]
        lost_rated = lost_task_ids(rows, self.rated_sent, "rate", "body")
        violations += [f"rate-limited task {task_id} never ran" for task_id in lost_rated]
        once_ids = set(self.once_sent)
        # A delivery that ended well records "done" (after the body, or with the
        # stored result of a completed task id): the messages run more than once.
        deliveries = Counter(
            row["task_id"] for row in rows if row["scenario"] == "once" and row["phase"] == "done"
        )
        figures: dict[str, Any] = {
            "fenced": self.config.fenced, "seed": self.seed, "workers": self.config.workers,
            "cap": self.config.cap, "keys": self.config.keys, "ttl": self.config.ttl,
            "visibility": self.config.visibility, "seconds_run": round(seconds_run, 1),
            "capped_sent": len(self.capped_sent), "once_sent": len(self.once_sent),
            "once_duplicated": self.once_duplicated, "faults": dict(self.faults),
            "workers_started": self.spawned, "effects": len(rows),
            "most_at_once": max(most.values(), default=0),
            "capped_completed": len(self.capped_sent) - len(lost_capped),
            "refused": len(refused),
            "once_ids": len(once_ids),
            "once_bodies": sum(1 for row in rows if row["scenario"] == "once" and row["phase"] == "body"),
            "once_ran_twice": len(twice),
            "once_redelivered": sum(1 for count in deliveries.values() if count > 1),
            "unique_keys": len(self.unique_sent), "unique_copies": self.config.unique_copies,
            "unique_most_run": max(
                (len({r["task_id"] for r in rows if r["scenario"] == "unique" and r["phase"] == "body"
                      and r["key"] == key}) for key in self.unique_sent), default=0,
            ),
            "rated_sent": len(self.rated_sent), "rate_limit": limit, "rate_period": period,
            "rate_most_in_window": max(rate_most.values(), default=0),
            "rate_logged": sum(len(times) for times in self.rate_log.values()),
            "rate_bodies": sum(len(times) for times in bodies.values()),
            "lost": len(lost) + len(lost_capped) + len(lost_rated),
        }
        return JobsReport(passed=not violations, violations=violations, figures=figures)

    # --- the effects table ---------------------------------------------------------------

    def _create_table(self) -> None:
        with connections["default"].cursor() as cursor:
            cursor.execute(
                f"CREATE TABLE IF NOT EXISTS {TABLE} (id bigserial PRIMARY KEY, run text NOT NULL, "
                "scenario text NOT NULL, key text NOT NULL, phase text NOT NULL, task_id text NOT NULL, "
                "token bigint, pid integer NOT NULL, at timestamptz NOT NULL)"
            )

    def _rows(
        self, scenario: str | None, phase: str | None, after: Any, last: int | None = None
    ) -> list[dict[str, Any]]:
        sql = f"SELECT scenario, key, phase, task_id, token, pid, at FROM {TABLE} WHERE run = %s"
        params: list[Any] = [self.tag]
        for column, value in (("scenario", scenario), ("phase", phase)):
            if value is not None:
                sql += f" AND {column} = %s"
                params.append(value)
        if after is not None:
            sql += " AND at > %s"
            params.append(after)
        sql += " ORDER BY id DESC" if last else " ORDER BY id"
        if last:
            sql += f" LIMIT {int(last)}"
        try:
            with connections["default"].cursor() as cursor:
                cursor.execute(sql, params)
                names = [column[0] for column in cursor.description]
                return [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]
        except Exception:  # a connection the faults left broken: one retry on a new one
            connections["default"].close()
            with connections["default"].cursor() as cursor:
                cursor.execute(sql, params)
                names = [column[0] for column in cursor.description]
                return [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]

    @staticmethod
    def _database_now() -> Any:
        from coordination import locks

        return locks.database_now()

    # --- helpers -------------------------------------------------------------------------

    def _processes(self) -> list[ChaosProcess]:
        return self.workers

    def _cleanup(self) -> None:
        self._publishing.clear()
        super()._cleanup()

    def _forget(self) -> None:
        with connections["default"].cursor() as cursor:
            cursor.execute(f"DELETE FROM {TABLE} WHERE run = %s", [self.tag])
