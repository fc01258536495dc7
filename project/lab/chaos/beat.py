"""Beat chaos: several ``celery beat`` processes, one worker, the leader paused and killed.

``coordination_chaos --beat`` (and tests/processes/test_beat_processes.py) run
this. The controller starts ``beats`` beat processes with
``-S coordination.contrib.beat.FencedScheduler`` and one ``celery worker``
(solo pool) on the run's own queue, with one schedule entry every
``interval`` seconds. Then, in turns, it finds the leader (its holder names
its pid) and either pauses it (SIGSTOP) past its lease and resumes it
(SIGCONT) once a new term has sent a slot, or kills it (SIGKILL) and starts a
new beat in its place. At the end it stops the beats (SIGTERM), waits for the
worker to run what was sent, and checks the history:

- no slot executed twice (each execution records its ``coordination_slot``);
- every executed slot was claimed, and every slot marked sent was executed;
- every lost slot (claimed, never marked sent) is the last slot its term
  claimed, by a beat process that died (killed, or stopped at the end);
- at least one take-over happened, so the faults bit.

The negative control (``fenced=False``) runs Celery's stock scheduler on the
same number of beats, each with its own schedule file: every beat sends every
entry, and the report counts the duplicate executions. Both runs are judged by
the same :func:`executed_more_than_once` (a stock message names no slot: its
slot is the interval it ran in).

With ``database=True`` the schedule is a django-celery-beat ``PeriodicTask`` row
(one per run, removed at the end) and the beats run
``coordination.contrib.beat.FencedDatabaseScheduler``; the negative control
runs django-celery-beat's own ``DatabaseScheduler`` on every beat.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import statistics
import subprocess
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

from django.db import connections

from .celery_run import CeleryChaos, ChaosProcess, Output

__all__ = [
    "BeatChaos", "BeatChaosConfig", "BeatDemo", "BeatReport", "executed_more_than_once", "slot_of",
]

FENCED_SCHEDULER = "coordination.contrib.beat.FencedScheduler"
STOCK_SCHEDULER = "celery.beat:PersistentScheduler"
FENCED_DATABASE_SCHEDULER = "coordination.contrib.beat.FencedDatabaseScheduler"
STOCK_DATABASE_SCHEDULER = "django_celery_beat.schedulers:DatabaseScheduler"


@dataclass
class BeatChaosConfig:
    seconds: float = 60.0
    beats: int = 2
    interval: float = 1.0
    lease: float = 5.0
    lock_delay: float = 0.0
    # Seconds each beat spends between a slot's claim and its publication, so that
    # some kills land there and leave lost slots to account for.
    publish_delay: float = 0.25
    fenced: bool = True
    seed: int | None = None
    broker: str | None = None  # default: the site's CELERY_BROKER_URL
    celery_app: str = "project"
    # At least this many faults of each kind (pause, kill) before the run may end.
    min_faults: int = 1
    # Seconds a leader leads (sends slots) between faults, at least.
    lead_between_faults: float = 3.0
    # The schedule in a django-celery-beat PeriodicTask row (FencedDatabaseScheduler;
    # the negative control: its stock DatabaseScheduler) instead of beat_schedule.
    # The interval is then whole seconds (an IntervalSchedule's unit).
    database: bool = False
    # The faults a run chooses from, in turns first, then at random.
    faults: tuple[str, ...] = ("pause", "kill")


@dataclass
class BeatReport:
    passed: bool
    violations: list[str] = field(default_factory=list)
    figures: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> str:
        f = self.figures
        if not f.get("fenced", True):
            return (
                f"beat negative control ({f.get('scheduler')}, {f.get('beats')} beats, "
                f"{f.get('seconds_run', 0):.0f} s): {f.get('executions')} executions for about "
                f"{f.get('intervals')} intervals: {f.get('duplicates')} duplicates, "
                f"{f.get('runs_per_period')} runs per period\n"
            )
        lines = [
            f"beat chaos ({f.get('scheduler')}): {f.get('seconds_run', 0):.0f} s, {f.get('beats')} beats, "
            f"lease {f.get('lease')} s, every {f.get('interval')} s, {f.get('executions')} executions, "
            f"{f.get('runs_per_period')} runs per period",
            f"  slots claimed {f.get('slots_claimed')}, sent {f.get('slots_sent')}, executed "
            f"{f.get('slots_executed')}, executed twice {f.get('slots_executed_twice')}, "
            f"lost {f.get('slots_lost')} (accounted for {f.get('lost_accounted')})",
            f"  faults: {f.get('pauses')} pauses, {f.get('kills')} kills, {f.get('restarts')} restarts; "
            f"take-overs {f.get('takeovers')}, terms {f.get('terms')}, stale claims refused "
            f"{f.get('stale_claims_refused')}",
            f"  take-over time p50 {f.get('takeover_p50')} s, p99 {f.get('takeover_p99')} s, "
            f"max {f.get('takeover_max')} s",
            "  PASSED" if self.passed else "  FAILED: " + "; ".join(self.violations[:10]),
        ]
        return "\n".join(lines) + "\n"


class BeatChaos(CeleryChaos[BeatChaosConfig]):
    """One beat chaos run; ``run()`` always stops every process it started."""

    kind = "beat"
    label = "beat chaos"

    def __init__(self, config: BeatChaosConfig, out: Output | None = None) -> None:
        super().__init__(config, out)
        self.role = f"chaos-beat-{self.tag}"
        self.executions = self.workdir / "executions.jsonl"
        self.beats: list[ChaosProcess] = []
        self.periodic_task = f"chaos-tick-{self.tag}"  # the PeriodicTask row of a database run
        self.worker: ChaosProcess | None = None
        self.dead: set[int] = set()  # pids of beats killed or stopped: their lost slots are accounted for
        self.faults: list[dict[str, Any]] = []

    # --- the run -------------------------------------------------------------------

    def run(self) -> BeatReport:
        report: BeatReport = super().run()
        return report

    def _run(self) -> BeatReport:
        config = self.config
        self._say(f"beat chaos: seed {self.seed}, role {self.role}, workdir {self.workdir}")
        if config.database:
            self._create_periodic_task()
        self.worker = worker = self._start("worker", [
            "worker", "-P", "solo", "-Q", self.queue, "-n", f"beat-chaos-{self.tag}@%h",
            "--without-gossip", "--without-mingle", "--without-heartbeat", "-l", "INFO",
        ])
        for _ in range(config.beats):
            self._start_beat()
        self._wait(lambda: " ready." in worker.text(), 120, "the worker to be ready")
        self.started = time.monotonic()
        if not config.fenced:
            return self._negative_control()
        self._wait(lambda: self._leader() is not None, 120, "a first leader")
        kinds = list(config.faults)
        done: Counter[str] = Counter()
        turn = 0
        while True:
            elapsed = time.monotonic() - self.started
            enough = all(done[kind] >= config.min_faults for kind in kinds)
            if elapsed >= config.seconds and enough:
                break
            self._let_leader_send(config.lead_between_faults)
            # Anywhere in the interval: a fault right after a send (when the wait
            # above returns) would never land between a claim and its publication.
            time.sleep(self.rng.uniform(0, config.interval))
            kind = kinds[turn % len(kinds)] if turn < len(kinds) else self.rng.choice(kinds)
            turn += 1
            self._fault(kind)
            done[kind] += 1
        self._let_leader_send(config.lead_between_faults)
        return self._finish()

    # --- processes -------------------------------------------------------------------

    def _settings(self) -> dict[str, str]:
        return {
            "COORDINATION_BEAT_QUEUE": self.queue,
            "COORDINATION_BEAT_ROLE": self.role,
            "COORDINATION_BEAT_INTERVAL": str(self.config.interval),
            "COORDINATION_BEAT_LEASE": str(self.config.lease),
            "COORDINATION_BEAT_LOCK_DELAY": str(self.config.lock_delay),
            "COORDINATION_BEAT_EXECUTIONS": str(self.executions),
            "COORDINATION_BEAT_PUBLISH_DELAY": str(self.config.publish_delay),
            "COORDINATION_BEAT_SCHEDULE_FROM": "database" if self.config.database else "settings",
        }

    def _start_beat(self) -> ChaosProcess:
        self.spawned += 1
        name = f"beat{self.spawned}"
        scheduler = self.scheduler
        arguments = ["beat", "-S", scheduler, "-l", "INFO", "--pidfile", str(self.workdir / f"{name}.pid"),
                     "-s", str(self.workdir / f"{name}-schedule")]
        beat = self._start(name, arguments)
        self.beats.append(beat)
        return beat

    @property
    def scheduler(self) -> str:
        if self.config.database:
            return FENCED_DATABASE_SCHEDULER if self.config.fenced else STOCK_DATABASE_SCHEDULER
        return FENCED_SCHEDULER if self.config.fenced else STOCK_SCHEDULER

    def _create_periodic_task(self) -> None:
        """The run's schedule as a django-celery-beat row, as the admin would add it.

        Every enabled row is sent by the beats, so a database that holds
        others is refused: the run would send the site's own periodic tasks.
        """
        from django_celery_beat.models import IntervalSchedule, PeriodicTask

        every = self.config.interval
        if every < 1 or every != int(every):
            raise ValueError(f"a PeriodicTask's interval is whole seconds, not {every:g}")
        others = list(PeriodicTask.objects.filter(enabled=True).values_list("name", flat=True)[:5])
        if others:
            raise ValueError(f"the database has enabled periodic tasks ({', '.join(others)}) "
                             "that the run's beats would send; use a database without them")
        interval, _ = IntervalSchedule.objects.get_or_create(every=int(every),
                                                             period=IntervalSchedule.SECONDS)
        PeriodicTask.objects.create(name=self.periodic_task, task="coordination_chaos.beat_tick",
                                    interval=interval, queue=self.queue)

    def _delete_periodic_task(self) -> None:
        if self.config.database:
            from django_celery_beat.models import PeriodicTask

            PeriodicTask.objects.filter(name=self.periodic_task).delete()

    # --- faults ------------------------------------------------------------------------

    def _leader(self) -> tuple[int, int] | None:
        """(pid, term) of the current leader, from the role's lock (database time)."""
        from coordination import election

        found = election.leader(self.role)
        if found is None:
            return None
        pid = found.holder.rpartition(":")[2]
        return (int(pid), found.term) if pid.isdigit() else None

    def _sent_by(self, term: int) -> int:
        from coordination.models import BeatSlot

        return BeatSlot.objects.filter(role=self.role, term=term, sent_at__isnull=False).count()

    def _let_leader_send(self, seconds: float) -> None:
        """Wait until a leader leads and has sent slots for ``seconds`` worth of interval."""
        wanted = max(2, int(seconds / self.config.interval))

        def leading() -> bool:
            leader = self._leader()
            return leader is not None and self._sent_by(leader[1]) >= wanted

        self._wait(leading, 60 + self.config.lease * 4, "a leader sending slots")

    def _beat_of(self, pid: int) -> ChaosProcess:
        for beat in self.beats:
            if beat.pid == pid:
                return beat
        raise RuntimeError(f"the leader pid {pid} is no beat of this run")

    def _fault(self, kind: str) -> None:
        from coordination import locks

        leader = self._leader()
        assert leader is not None
        pid, term = leader
        beat = self._beat_of(pid)
        at = locks.database_now()
        if kind == "pause":
            os.kill(pid, signal.SIGSTOP)
            beat.paused = True
            self._say(f"{self.label}: paused leader {beat.name} (pid {pid}, term {term})")
        else:
            os.kill(pid, signal.SIGKILL)
            beat.process.wait(10)
            self.dead.add(pid)
            self._say(f"{self.label}: killed leader {beat.name} (pid {pid}, term {term})")
        new_term = self._wait(
            lambda: (found := self._leader()) is not None and found[1] > term
            and self._sent_by(found[1]) >= 1 and found[1],
            60 + self.config.lease * 4, "a new term sending a slot",
        )
        self.faults.append({"kind": kind, "pid": pid, "term": term, "at": at.isoformat(),
                            "new_term": int(new_term)})
        if kind == "pause":
            os.kill(pid, signal.SIGCONT)
            beat.paused = False
            self._say(f"{self.label}: resumed {beat.name}; term {new_term} leads")
        else:
            restarted = self._start_beat()
            self.faults.append({"kind": "restart", "pid": restarted.pid})
            self._say(f"{self.label}: term {new_term} leads; started {restarted.name}")

    # --- the end ----------------------------------------------------------------------

    def _stop_beats(self) -> None:
        for beat in self.beats:
            if beat.alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(beat.pid, signal.SIGCONT)
                    os.kill(beat.pid, signal.SIGTERM)
        for beat in self.beats:
            try:
                beat.process.wait(20)
            except subprocess.TimeoutExpired:
                beat.process.kill()
                beat.process.wait(10)
            self.dead.add(beat.pid)

    def _read_executions(self) -> list[dict[str, Any]]:
        if not self.executions.exists():
            return []
        return [json.loads(line) for line in self.executions.read_text().splitlines() if line.strip()]

    def _finish(self) -> BeatReport:
        from coordination.models import BeatSlot, Grant, Rejection

        seconds_run = time.monotonic() - self.started
        self._stop_beats()
        slots = list(BeatSlot.objects.filter(role=self.role).order_by("due_at"))
        sent = {slot.identity for slot in slots if slot.sent_at is not None}
        # The worker runs what was sent: wait on that state, not on a clock.
        with contextlib.suppress(AssertionError):
            self._wait(lambda: sent <= {e["slot"] for e in self._read_executions()}, 60,
                       "the worker to run every sent slot")
        executions = self._read_executions()
        counts = Counter(slot_of(e, self.config.interval) for e in executions)
        claimed = {slot.identity: slot for slot in slots}
        violations: list[str] = []
        more_than_once = executed_more_than_once(executions, self.config.interval)
        twice = sorted(more_than_once)
        violations += [f"slot {slot} executed {more_than_once[slot]} times" for slot in twice]
        violations += [f"executed slot {slot} was never claimed" for slot in counts if slot not in claimed]
        violations += [f"sent slot {slot} was never executed" for slot in sorted(sent - set(counts))]
        last_of_term: dict[int, BeatSlot] = {}
        for slot in slots:
            if slot.term not in last_of_term or slot.claimed_at > last_of_term[slot.term].claimed_at:
                last_of_term[slot.term] = slot
        lost = [slot for slot in slots if slot.sent_at is None]
        accounted = 0
        for slot in lost:
            pid = slot.claimed_by.rpartition(":")[2]
            died = pid.isdigit() and int(pid) in self.dead
            last = last_of_term[slot.term].pk == slot.pk
            if died and last:
                accounted += 1
            else:
                violations.append(
                    f"lost slot {slot.identity} (term {slot.term}, {slot.claimed_by}) is not the last "
                    "claim of a beat that died"
                )
        terms = list(Grant.objects.filter(lock__key=f"election:{self.role}").order_by("token"))
        takeovers = [fault for fault in self.faults if fault["kind"] in {"pause", "kill"}]
        if not takeovers:
            violations.append("no take-over happened: the faults did not bite")
        times = []
        for fault in takeovers:
            first = (BeatSlot.objects.filter(role=self.role, term=fault["new_term"])
                     .order_by("claimed_at").values_list("claimed_at", flat=True).first())
            if first is not None:
                from django.utils.dateparse import parse_datetime

                started = parse_datetime(fault["at"])
                assert started is not None
                times.append((first - started).total_seconds())
        figures: dict[str, Any] = {
            "fenced": True, "scheduler": self.scheduler, "runs_per_period": self._runs_per_period(executions),
            "seed": self.seed, "beats": self.config.beats, "lease": self.config.lease,
            "lock_delay": self.config.lock_delay, "interval": self.config.interval,
            "publish_delay": self.config.publish_delay,
            "seconds_run": round(seconds_run, 1), "slots_claimed": len(slots), "slots_sent": len(sent),
            "slots_executed": len(counts), "executions": len(executions),
            "slots_executed_twice": len(twice), "slots_lost": len(lost), "lost_accounted": accounted,
            "pauses": sum(1 for f in self.faults if f["kind"] == "pause"),
            "kills": sum(1 for f in self.faults if f["kind"] == "kill"),
            "restarts": sum(1 for f in self.faults if f["kind"] == "restart"),
            "takeovers": len(takeovers), "terms": len(terms),
            # Claims of deposed leaders (resumed after a pause) that the role's fence refused.
            "stale_claims_refused": Rejection.objects.filter(lock_key=f"election:{self.role}").count(),
            "takeover_p50": _percentile(times, 50), "takeover_p99": _percentile(times, 99),
            "takeover_max": round(max(times), 2) if times else None,
            "takeover_seconds": [round(t, 2) for t in times],
        }
        return BeatReport(passed=not violations, violations=violations, figures=figures)

    def _negative_control(self) -> BeatReport:
        while time.monotonic() - self.started < self.config.seconds:
            time.sleep(0.5)
        seconds_run = time.monotonic() - self.started
        self._stop_beats()
        time.sleep(min(5.0, 3 * self.config.interval))  # let the worker finish what is queued
        executions = self._read_executions()
        slots = {slot_of(e, self.config.interval) for e in executions}
        more_than_once = executed_more_than_once(executions, self.config.interval)
        duplicates = sum(count - 1 for count in more_than_once.values())
        figures = {
            "fenced": False, "scheduler": self.scheduler,
            "runs_per_period": self._runs_per_period(executions),
            "seed": self.seed, "beats": self.config.beats, "interval": self.config.interval,
            "seconds_run": round(seconds_run, 1), "executions": len(executions),
            "intervals": len(slots), "duplicates": duplicates,
        }
        violations = []
        if duplicates:
            violations.append(f"{duplicates} executions beyond one per interval (stock scheduler)")
        return BeatReport(passed=not violations, violations=violations, figures=figures)

    def _runs_per_period(self, executions: list[dict[str, Any]]) -> float | None:
        """Executions per schedule period, from the first to the last execution
        (worker clock): about 1 when each period runs once, 2 when two beats send."""
        if len(executions) < 2:
            return None
        times = sorted(float(e["at"]) for e in executions)
        periods = (times[-1] - times[0]) / self.config.interval + 1
        return round(len(executions) / periods, 2)

    # --- helpers ------------------------------------------------------------------------

    def _diagnostics(self) -> str:
        """For a failed wait: the role's lock row and what every session of the
        database is doing (a paused process may hold a transaction open)."""
        from coordination import election
        from coordination.models import Lock

        lines = [f"beats: {[(b.name, b.pid, 'paused' if b.paused else 'running') for b in self.beats]}"]
        try:
            row = Lock.objects.filter(key=election.ROLE_PREFIX + self.role).values().first()
            lines.append(f"role lock: {row}")
            with connections["default"].cursor() as cursor:
                cursor.execute(
                    "SELECT pid, application_name, state, wait_event_type, wait_event, "
                    "now() - xact_start, left(query, 160) FROM pg_stat_activity "
                    "WHERE datname = current_database() AND pid <> pg_backend_pid()"
                )
                lines.extend(f"session: {row}" for row in cursor.fetchall())
        except Exception as error:  # diagnostics only: never hide the failure itself
            lines.append(f"(database state not read: {error})")
        return "\n".join(lines)

    def _processes(self) -> list[ChaosProcess]:
        return [*self.beats, *([self.worker] if self.worker else [])]

    def _forget(self) -> None:
        self._delete_periodic_task()


def slot_of(execution: dict[str, Any], interval: float) -> str:
    """The slot an execution (a line of the run's executions file) ran for.

    The FencedScheduler names it in the message (the ``coordination_slot``
    header). Celery's stock scheduler names none: its slot is the interval of
    the worker's clock the execution ran in, since each entry is due once per
    interval.
    """
    slot = execution.get("slot")
    if slot:
        return str(slot)
    return f"interval {int(float(execution['at']) // interval)}"


def executed_more_than_once(executions: list[dict[str, Any]], interval: float) -> dict[str, int]:
    """Every slot of ``executions`` that ran more than once, with how many times.

    The one duplicate check of a beat run, fenced or not: empty means no slot
    ran twice.
    """
    counts = Counter(slot_of(execution, interval) for execution in executions)
    return {slot: count for slot, count in counts.items() if count > 1}


def _percentile(values: list[float], percent: int) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return round(values[0], 2)
    ordered = sorted(values)
    if percent == 50:
        return round(statistics.median(ordered), 2)
    rank = min(len(ordered) - 1, max(0, round(percent / 100 * (len(ordered) - 1))))
    return round(ordered[rank], 2)


DEMO_ROLE = "demo-beat"


class BeatDemo(BeatChaos):
    """``coordination_demo --beat``: two beats in the terminal, the leader paused past
    its lease, the standby taking over, the paused one refused when it wakes up.

    The role is ``demo-beat`` on every run, so the admin's election roles page
    (``/admin/coordination/role/``) shows its terms piling up, and the beat slots
    page each slot with the term that claimed it.
    """

    def __init__(self, config: BeatChaosConfig, out: Output | None = None) -> None:
        super().__init__(config, out)
        self.label = "beat demo"
        self.role = DEMO_ROLE
        self._offsets: dict[str, int] = {}

    def _run(self) -> BeatReport:
        from coordination import election
        from coordination.models import Rejection

        config = self.config
        known = election.leader(self.role)
        if known is not None:
            raise AssertionError(f"role {self.role!r} is led by {known.holder}; is another demo running?")
        self._say(f"beat demo: two beats ({FENCED_SCHEDULER}), one worker, a slot every "
                  f"{config.interval:g} s, lease {config.lease:g} s")
        self.worker = self._start("worker", [
            "worker", "-P", "solo", "-Q", self.queue, "-n", f"beat-demo-{self.tag}@%h",
            "--without-gossip", "--without-mingle", "--without-heartbeat", "-l", "WARNING",
        ])
        for _ in range(2):
            self._start_beat()
        self.started = time.monotonic()
        self._wait(lambda: self._leader() is not None, 120, "a first leader")
        self._let_leader_send(3 * config.interval)
        leader = self._leader()
        assert leader is not None
        refused_before = Rejection.objects.filter(lock_key=election.role_key(self.role)).count()
        self._fault("pause")
        self._say(f"beat demo: waiting for the resumed beat to try its old term {leader[1]} ...")
        with contextlib.suppress(AssertionError):
            self._wait(
                lambda: Rejection.objects.filter(lock_key=election.role_key(self.role)).count()
                > refused_before or self._stepped_down(leader[0]),
                3 * config.lease + 10, "the resumed beat to step down",
            )
        self._let_leader_send(3 * config.interval)
        report = self._finish()
        self._echo()
        return report

    def _stepped_down(self, pid: int) -> bool:
        return any(beat.pid == pid and "no longer leads" in beat.text() for beat in self.beats)

    def _wait(self, condition: Any, timeout: float, what: str) -> Any:
        def echoing() -> Any:
            self._echo()
            return condition()

        return super()._wait(echoing, timeout, what)

    def _echo(self) -> None:
        """Print the beats' own lines about leading, sending and being refused."""
        for beat in self.beats:
            text = beat.text()
            start = self._offsets.get(beat.name, 0)
            self._offsets[beat.name] = len(text)
            for line in text[start:].splitlines():
                if "coordination." not in line or line.startswith("["):
                    continue
                if any(word in line for word in ("leads", "sent slot", "refused", "no longer leads")):
                    self._say(f"  [{beat.name} pid {beat.pid}] {line.split(' ', 4)[-1]}")
