"""``manage.py coordination_demo``: the seed's timeline with two real Celery workers.

::

    t0  A acquire -> lease=3s, token=n
    t1  A pause (SIGSTOP) for longer than its lease
    t2  lease expires (database clock)
    t3  B acquire -> token=n+1 -> write accepted
    t4  A resumes (SIGCONT) -> token=n -> write rejected as stale; B's balance stays

Worker A and worker B are ``celery worker`` processes started by this command on
the configured broker, each on a queue of its own (so no other worker, such as
the one ``bin/run`` starts, takes their tasks). Both run the demo's
``deposit`` task, a read-modify-write of one account's balance. With
``--no-fencing`` the same writes are plain UPDATEs: A's late write silently
overwrites B's, the lost update that the lease alone cannot prevent.

One token at every downstream: with the same grant the task then records an
outbox call and, where those stores are configured, writes an S3 object
(``--s3-endpoint``, or ``COORDINATION_DEMO_S3_ENDPOINT``) and a Redis key
(``--redis-url``, or ``COORDINATION_DEMO_REDIS_URL``, or the broker when it is
Redis). Each store refuses A's stale token on its own and keeps B's balance;
the outcome is safe only if every one does. On the embedded default (SQLite,
the filesystem broker) there is no S3 or Redis: the row and the outbox call are
fenced, and the command says the other two are off.

Exit status: 0 when the outcome is safe (B's balance stands, A's write was
refused); 1 when it is not (always the case with ``--no-fencing``: that variant
exists to show the lost update); 2 when the demo could not run (a worker did
not start, a step timed out).
"""

from __future__ import annotations

import datetime as dt
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from decimal import Decimal
from pathlib import Path
from typing import Any
from urllib.parse import quote

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import connections

from coordination import locks
from coordination.conf import app_settings
from coordination.models import Rejection

DEMO_AMOUNTS = {"A": Decimal("50.00"), "B": Decimal("20.00")}
START_TIMEOUT = 90.0


def database_url(settings_dict: dict[str, Any]) -> str:
    """A ``DATABASE_URL`` naming the database ``settings_dict`` points at (PostgreSQL,
    MariaDB or SQLite).

    Workers started by the demo (and by the test suite) use it, so they write to
    the very database this process uses, the test database included.
    """
    engine = str(settings_dict["ENGINE"])
    name = str(settings_dict["NAME"])
    if "sqlite" in engine:
        return f"sqlite:///{Path(name).resolve()}"
    schemes = {"postgresql": "postgres", "mysql": "mysql"}
    scheme = next((url for word, url in schemes.items() if word in engine), None)
    if scheme is None:
        raise CommandError(f"the demo runs on PostgreSQL, MariaDB or SQLite, not {engine}")
    user = quote(str(settings_dict.get("USER") or ""), safe="")
    password = quote(str(settings_dict.get("PASSWORD") or ""), safe="")
    credentials = f"{user}:{password}@" if password else f"{user}@" if user else ""
    host = str(settings_dict.get("HOST") or "localhost")
    port = f":{settings_dict['PORT']}" if settings_dict.get("PORT") else ""
    return f"{scheme}://{credentials}{host}{port}/{quote(name, safe='')}"


def worker_environment(broker_url: str, alias: str | None = None) -> dict[str, str]:
    """The environment of a worker process pointed at this process's database and broker."""
    env = dict(os.environ)
    env["DATABASE_URL"] = database_url(connections[alias or app_settings.DATABASE].settings_dict)
    env["CELERY_BROKER_URL"] = broker_url
    env.setdefault("DJANGO_SETTINGS_MODULE", os.environ.get("DJANGO_SETTINGS_MODULE", ""))
    root = str(getattr(settings, "BASE_DIR", os.getcwd()))
    env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
    return env


class DemoFailed(CommandError):
    """The demo could not run to its end (exit status 2)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, returncode=2)


class Command(BaseCommand):
    help = (
        "Run the seed's fencing timeline with two real Celery workers: A pauses past its "
        "lease, B takes the lock and writes, A's late write is rejected. Exit 0 only if safe."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--no-fencing", action="store_true",
            help="write with a plain UPDATE instead of fenced_update, to show the lost update "
            "(exits 1: the outcome is unsafe by design)",
        )
        parser.add_argument("--json", metavar="PATH", help="also write the timeline and outcome as JSON")
        parser.add_argument(
            "--pause", type=float, default=2.5,
            help="seconds worker A stays paused (SIGSTOP), at least its lease plus B's turn",
        )
        parser.add_argument(
            "--celery-app", default="",
            help="the Celery app module the workers load (default: the current app's main module)",
        )
        parser.add_argument(
            "--beat", action="store_true",
            help="the beat demo instead: two `celery beat -S coordination.contrib.beat.FencedScheduler` "
            "processes, the leader paused past its lease, the standby taking over, no slot twice",
        )
        parser.add_argument("--beat-lease", type=float, default=5.0,
                            help="--beat: the leader's lease in seconds (default 5)")
        parser.add_argument(
            "--redis-url", default=None,
            help="also write a Redis key with the task's grant (default: $COORDINATION_DEMO_REDIS_URL, "
            "else the broker if it is Redis, else off)",
        )
        parser.add_argument(
            "--s3-endpoint", default=os.environ.get("COORDINATION_DEMO_S3_ENDPOINT", ""),
            help="also write an S3 object with FencedS3Storage at this endpoint (default: "
            "$COORDINATION_DEMO_S3_ENDPOINT, else off; credentials from the AWS_* environment)",
        )
        parser.add_argument(
            "--s3-bucket", default=os.environ.get("COORDINATION_DEMO_S3_BUCKET", "coordination-demo"),
            help="the bucket for --s3-endpoint, created if missing (default coordination-demo)",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        if options["beat"]:
            self._beat(options)
            return
        from celery import current_app

        try:
            from project.demo.downstreams import Downstreams
            from project.demo.models import Account
            from project.demo.tasks import DEMO_QUEUE_PREFIX, DEMO_TTL, deposit
        except (ImportError, RuntimeError) as error:
            raise DemoFailed(f"the demo needs the project.demo app installed: {error}") from None

        _require_migrated()
        fencing = not options["no_fencing"]
        if not 0 <= options["pause"] <= 600:
            raise CommandError("--pause must be between 0 and 600 seconds")
        app_name = options["celery_app"] or current_app.main or "project"
        run_dir = Path(tempfile.mkdtemp(prefix="coordination-demo-"))
        run_id = uuid.uuid4().hex[:8]
        queues = {name: f"{DEMO_QUEUE_PREFIX}-{run_id}-{name.lower()}" for name in ("A", "B")}
        events = run_dir / "events.jsonl"
        events.touch()
        resume = run_dir / "resume-A"
        account = Account.objects.create(owner="coordination demo", balance=Decimal("100.00"))
        vendor = connections[app_settings.DATABASE].vendor
        broker = str(current_app.conf.broker_url or "")
        self._say(
            f"coordination demo: fencing {'ON' if fencing else 'OFF (--no-fencing)'}, "
            f"database {vendor}, broker {broker.split('://', 1)[0]}, "
            f"account #{account.pk} balance {account.balance}"
        )
        stores = {**_stores(options, broker), "run": run_id}
        downstreams = Downstreams(stores, account.pk)
        try:
            downstreams.create_bucket()
        except Exception as error:
            raise DemoFailed(f"the S3 endpoint {options['s3_endpoint']} did not answer: {error}") from None
        enabled = downstreams.enabled()
        self._say("downstreams with the same grant: the account row, " + ", ".join(
            downstreams.where(store) for store in enabled
        ) + "".join(f"; {store} off ({why})" for store, why in _off(enabled).items()))
        workers = Workers(app_name, broker, run_dir)
        self._install_sigterm()
        timeline: list[dict[str, Any]] = []
        result: dict[str, Any] = {
            "fencing": fencing, "database": vendor, "broker": broker.split("://", 1)[0],
            "account": account.pk, "lease_seconds": DEMO_TTL, "timeline": timeline,
            "downstreams": {}, "downstreams_run": run_id,
        }
        started = time.monotonic()
        try:
            for name in ("A", "B"):
                workers.start(name, queues[name])
            reader = EventReader(events)

            def send(name: str, **extra: Any) -> None:
                deposit.apply_async(
                    (account.pk, str(DEMO_AMOUNTS[name])),
                    {"worker": name, "report_to": str(events), "fencing": fencing, "stores": stores,
                     **extra},
                    queue=queues[name], expires=START_TIMEOUT + 60,
                )

            send("A", resume_file=str(resume))
            acquired_a = reader.wait("A", {"acquired"}, START_TIMEOUT, workers)
            t0 = dt.datetime.fromisoformat(acquired_a["at"])
            if int(acquired_a["pid"]) != workers.pid("A"):
                raise DemoFailed(
                    f"worker A ran the task in pid {acquired_a['pid']}, not in its own process "
                    f"{workers.pid('A')}: start it with --pool=solo"
                )
            token_a = int(acquired_a["token"])
            wanted_a = Decimal(acquired_a["read"]) + DEMO_AMOUNTS["A"]

            def mark(label: str, at: dt.datetime, text: str, **fields: Any) -> None:
                offset = (at - t0).total_seconds()
                timeline.append({"step": label, "at": at.isoformat(), "offset": round(offset, 3),
                                 "text": text, **fields})
                self._say(f"{label}  +{offset:6.3f}s  {text}")

            mark(
                "t0", t0, f"A acquire -> lease={DEMO_TTL:g}s, token={token_a} "
                f"(worker A pid {acquired_a['pid']} reads balance {acquired_a['read']})",
                worker="A", token=token_a,
            )
            workers.pause("A")
            paused_at = locks.database_now()
            mark("t1", paused_at, f"A pause (SIGSTOP), longer than its lease, "
                 f"before writing {acquired_a['read']} + {DEMO_AMOUNTS['A']} = {wanted_a}", worker="A")
            expires_at = dt.datetime.fromisoformat(acquired_a["expires_at"])
            _wait_for_database_time(expires_at)
            mark("t2", expires_at, "lease expires (database clock)")
            resume.touch()  # A reads it once it runs again

            send("B")
            acquired_b = reader.wait("B", {"acquired"}, START_TIMEOUT, workers)
            written_b = reader.wait("B", {"written", "rejected"}, 30, workers)
            token_b = int(written_b["token"])
            if written_b["event"] != "written":
                raise DemoFailed(f"B's write was refused: {written_b.get('detail')}")
            balance_b = Decimal(written_b["balance"])
            mark(
                "t3", dt.datetime.fromisoformat(written_b["at"]),
                f"B acquire -> token={token_b} -> storage accepts "
                f"({acquired_b['read']} + {DEMO_AMOUNTS['B']} = {balance_b})",
                worker="B", token=token_b, outcome="accepted", balance=str(balance_b),
            )
            stores_b = reader.wait("B", {"downstreams"}, 30, workers)["stores"]
            self._say("               B's " + _outcomes(downstreams, stores_b))

            time.sleep(max(0.0, options["pause"] - (time.monotonic() - workers.paused_since("A"))))
            paused_for = time.monotonic() - workers.paused_since("A")
            workers.resume("A")
            resumed_at = locks.database_now()
            outcome_a = reader.wait("A", {"written", "rejected"}, 30, workers)
            final = Account.objects.get(pk=account.pk).balance
            if outcome_a["event"] == "rejected":
                verdict = f"storage rejects: {outcome_a['code']}"
            else:
                verdict = f"storage accepts: balance {outcome_a['balance']} overwrites B's {balance_b}"
            mark(
                "t4", resumed_at,
                f"A resumes (SIGCONT) after {paused_for:.1f}s -> token={token_a} -> {verdict}",
                worker="A", token=token_a,
                outcome="rejected" if outcome_a["event"] == "rejected" else "accepted",
                code=outcome_a.get("code", ""),
            )
            stores_a = reader.wait("A", {"downstreams"}, 30, workers)["stores"]
            self._say("               A's " + _outcomes(downstreams, stores_a))
            held = downstreams.final()
        except DemoFailed as failure:
            self._say(f"demo failed: {failure}; worker logs kept in {run_dir}")
            raise
        finally:
            workers.stop_all()
            _delete_queues(current_app, queues.values())

        for store in enabled:
            result["downstreams"][store] = {
                "where": downstreams.where(store), "A": stores_a[store], "B": stores_b[store],
                "held": held[store],
                "safe": stores_a[store]["outcome"] == "rejected" and stores_b[store]["outcome"] == "written"
                and _holds(held[store], str(balance_b), token_b),
            }
        unsafe_downstreams = [store for store in enabled if not result["downstreams"][store]["safe"]]
        safe = outcome_a["event"] == "rejected" and final == balance_b and not unsafe_downstreams
        rejection = (
            Rejection.objects.filter(lock_key=f"account:{account.pk}", token=token_a)
            .order_by("id").first()  # the row's: the task writes it first, the downstreams after
        )
        rejections = Rejection.objects.filter(lock_key=f"account:{account.pk}", token=token_a)
        result.update(
            rejected_resources=sorted(rejections.values_list("resource", flat=True)),
            safe=safe, tokens={"A": token_a, "B": token_b}, balance=str(final),
            balance_b=str(balance_b), balance_a_wanted=str(wanted_a),
            rejection=rejection.pk if rejection else None,
            seconds=round(time.monotonic() - started, 2),
        )
        if safe:
            self._say(
                f"outcome: SAFE. balance {final} is B's; A's late write with token {token_a} was "
                f"rejected (Rejection #{result['rejection']}). The grants and the rejection are in "
                "the admin: Coordination > Grants, Rejections."
            )
            self._say(
                f"every downstream refused token {token_a} on its own and holds B's {balance_b}: "
                + ", ".join(enabled) + " (Rejections, Outbox calls)"
            )
        elif fencing:
            self._say(f"outcome: UNSAFE. balance {final}, B wrote {balance_b}; downstreams that did not "
                      f"hold: {', '.join(unsafe_downstreams) or 'none'}")
        else:
            self._say(
                f"outcome: LOST UPDATE. balance {final}: A's late plain UPDATE (from its stale read) "
                f"overwrote B's {balance_b}, B's deposit of {DEMO_AMOUNTS['B']} is gone. "
                "The lease alone did not stop A; run without --no-fencing to see the fence refuse it."
            )
            self._say("downstreams: " + "; ".join(
                f"{store} holds {_held_text(result['downstreams'][store]['held'])}" for store in enabled
            ))
        if options["json"]:
            Path(options["json"]).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
        shutil.rmtree(run_dir, ignore_errors=True)
        if not safe:
            raise CommandError("the outcome is unsafe" + (" (as --no-fencing shows)" if not fencing else ""))

    def _beat(self, options: dict[str, Any]) -> None:
        """The beat demo: exit 0 when no slot ran twice and a take-over happened,
        1 when a slot ran twice, 2 when the demo could not run."""
        from celery import current_app

        from project.lab.chaos.beat import BeatChaosConfig, BeatDemo

        _require_migrated()
        config = BeatChaosConfig(
            beats=2, interval=1.0, lease=options["beat_lease"], publish_delay=0.0,
            celery_app=options["celery_app"] or current_app.main or "project",
        )
        try:
            report = BeatDemo(config, out=self.stdout).run()
        except AssertionError as error:
            raise DemoFailed(f"the beat demo could not run: {error}") from None
        self.stdout.write(report.summary())
        self._say("The terms: /admin/coordination/role/ (and their history); the slots: "
                  "/admin/coordination/beatslot/")
        if options["json"]:
            with open(options["json"], "w", encoding="utf-8") as out:
                json.dump(report.as_dict(), out, indent=2, sort_keys=True)
        if not report.passed:
            raise CommandError("; ".join(report.violations), returncode=1)

    def _say(self, line: str) -> None:
        self.stdout.write(line)
        self.stdout.flush()

    def _install_sigterm(self) -> None:
        # bin/run stops the demo with SIGTERM: unwind, so the workers are stopped too.
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, _exit_on_sigterm)


def _stores(options: dict[str, Any], broker: str) -> dict[str, Any]:
    """The demo's stores besides the database (see project.demo.downstreams)."""
    stores: dict[str, Any] = {}
    redis_url = options["redis_url"]
    if redis_url is None:
        redis_url = os.environ.get("COORDINATION_DEMO_REDIS_URL") or (
            broker if broker.startswith(("redis://", "rediss://")) else ""
        )
    if redis_url:
        stores["redis_url"] = redis_url
    if options["s3_endpoint"]:
        stores["s3"] = {"endpoint": options["s3_endpoint"], "bucket": options["s3_bucket"]}
    return stores


def _off(enabled: list[str]) -> dict[str, str]:
    why = {"object": "no S3 endpoint: --s3-endpoint or COORDINATION_DEMO_S3_ENDPOINT",
           "redis": "no Redis: --redis-url, COORDINATION_DEMO_REDIS_URL or a Redis broker"}
    return {store: text for store, text in why.items() if store not in enabled}


def _outcomes(downstreams: Any, outcomes: dict[str, dict[str, str]]) -> str:
    return ", ".join(
        f"{store} {_WRITTEN[store] if said['outcome'] == 'written' else 'refused: ' + said.get('code', '')}"
        for store, said in outcomes.items()
    )


_WRITTEN = {"object": "written", "redis": "written", "outbox": "call recorded"}


def _holds(held: Any, balance: str, token: int) -> bool:
    """A store holds B's balance and nothing else: the object's or key's value, or
    exactly one outbox call, B's."""
    if isinstance(held, list):
        return held == [{"token": token, "balance": balance}]
    return bool(held == balance)


def _held_text(held: Any) -> str:
    if isinstance(held, list):
        return f"{len(held)} calls to send (" + ", ".join(
            f"token {call['token']}: {call['balance']}" for call in held
        ) + ")"
    return str(held)


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def _require_migrated() -> None:
    from django.db.migrations.executor import MigrationExecutor

    connection = connections[app_settings.DATABASE]
    executor = MigrationExecutor(connection)
    if executor.migration_plan(executor.loader.graph.leaf_nodes()):
        raise DemoFailed("the database has unapplied migrations: run 'manage.py migrate' first")


def _delete_queues(app: Any, names: Any) -> None:
    """Remove this run's queues from the broker (best effort: they are empty by now)."""
    from kombu import Exchange, Queue

    try:
        with app.connection_for_write() as connection:
            channel = connection.default_channel
            for name in names:
                # Declared here so that this channel knows the binding it must remove.
                queue = Queue(name, Exchange(name, type="direct"), routing_key=name, channel=channel)
                queue.declare()
                queue.delete()
    except Exception as error:  # pragma: no cover - cleanup only
        sys.stderr.write(f"could not delete the demo queues: {error}\n")


def _wait_for_database_time(moment: dt.datetime, margin: float = 0.05) -> None:
    deadline = time.monotonic() + 30
    while locks.database_now() <= moment + dt.timedelta(seconds=margin):
        if time.monotonic() > deadline:
            raise DemoFailed(f"the database clock did not pass {moment.isoformat()}")
        time.sleep(0.02)


class EventReader:
    """Follows the JSON lines the demo task writes, with database times."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.seen: list[dict[str, Any]] = []
        self._read = 0

    def _poll(self) -> None:
        lines = self.path.read_text(encoding="utf-8").split("\n")[:-1]  # only complete lines
        self.seen.extend(json.loads(line) for line in lines[self._read :] if line.strip())
        self._read = len(lines)

    def wait(self, worker: str, events: set[str], timeout: float, workers: Workers) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            self._poll()
            for event in self.seen:
                if event["worker"] == worker and event["event"] in events:
                    self.seen.remove(event)
                    return event
            workers.check_alive()
            if time.monotonic() > deadline:
                wanted = "/".join(sorted(events))
                raise DemoFailed(f"worker {worker} did not report {wanted} in {timeout:g} s")
            time.sleep(0.02)


class Workers:
    """The demo's two ``celery worker`` processes (solo pool, one queue each)."""

    def __init__(self, app_name: str, broker_url: str, run_dir: Path) -> None:
        self.app_name = app_name
        self.env = worker_environment(broker_url)
        self.run_dir = run_dir
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        self.paused: dict[str, float] = {}

    def start(self, name: str, queue: str) -> None:
        log = open(self.run_dir / f"worker-{name}.log", "wb")  # noqa: SIM115  (closed with the process)
        command = [
            sys.executable, "-m", "celery", "-A", self.app_name, "worker", "--pool=solo",
            "-Q", queue, "-n", f"demo-{name.lower()}-{uuid.uuid4().hex[:8]}@%h",
            "--without-gossip", "--without-mingle", "--without-heartbeat", "-l", "INFO",
        ]
        self.processes[name] = subprocess.Popen(
            command, env=self.env, cwd=self.env["PYTHONPATH"].split(os.pathsep)[0],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
        )
        log.close()

    def pid(self, name: str) -> int:
        return self.processes[name].pid

    def pause(self, name: str) -> None:
        # Recorded first: a stop that interrupts this line still finds the worker paused.
        self.paused[name] = time.monotonic()
        os.kill(self.pid(name), signal.SIGSTOP)

    def paused_since(self, name: str) -> float:
        return self.paused[name]

    def resume(self, name: str) -> None:
        os.kill(self.pid(name), signal.SIGCONT)
        self.paused.pop(name, None)

    def check_alive(self) -> None:
        for name, process in self.processes.items():
            if process.poll() is not None:
                log = (self.run_dir / f"worker-{name}.log").read_text(errors="replace")[-2000:]
                raise DemoFailed(f"worker {name} exited with status {process.returncode}:\n{log}")

    def stop_all(self) -> None:
        """Stop every worker, within bin/run's grace (10 s before it kills this
        command): a paused worker is killed at once (stopped, it would not see a
        SIGTERM), the others get SIGTERM and then SIGKILL after 6 s. A second
        Ctrl-C or bin/run's SIGTERM during the stop does not cut it short,
        which would leave a worker behind."""
        interrupts = (signal.SIGINT, signal.SIGTERM)
        in_main = threading.current_thread() is threading.main_thread()
        previous = [signal.signal(number, signal.SIG_IGN) for number in interrupts] if in_main else []
        try:
            for name, process in self.processes.items():
                if process.poll() is None:
                    if name in self.paused:
                        process.kill()
                    else:
                        process.terminate()
            deadline = time.monotonic() + 6
            for process in self.processes.values():
                try:
                    process.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
        finally:
            for number, handler in zip(interrupts, previous, strict=False):
                signal.signal(number, handler)
