"""``manage.py coordination_chaos``: prove the fencing contract under faults.

Worker processes take locks and write through the fences while the command
pauses (SIGSTOP), kills (SIGKILL) and disconnects (``pg_terminate_backend``)
them, and restarts PostgreSQL when it manages its own server. The history is
then checked (see :mod:`project.lab.chaos.checker`); the exit status is 1 on
any violation, or when no stale write was attempted (the faults did not bite).

``--beat`` runs the beat chaos instead (:mod:`project.lab.chaos.beat`): several
``celery beat -S coordination.contrib.beat.FencedScheduler`` processes (with
``--beat-database``, ``FencedDatabaseScheduler`` on a django-celery-beat
``PeriodicTask``) and a worker, the leader paused past its lease and killed;
with ``--no-fencing``, the negative control (Celery's stock scheduler, or
django-celery-beat's ``DatabaseScheduler``, on every beat, which shows the
duplicates). Same ``--json`` report and exit statuses.

``--jobs`` runs the jobs chaos (:mod:`project.lab.chaos.jobs`): real workers
run tasks capped per key and tasks that must not run a completed task id again,
while workers are killed between a body's commit and its ack, paused past their
leases and killed; some messages are published twice. With ``--no-fencing``,
the negative control: the same bodies without the features. Same ``--json``
report and exit statuses.

``--patroni`` runs the workload against the Patroni + etcd cluster of
bin/cluster.sh (start it first) with synchronous replication while the primary
is killed, paused and switched over (:mod:`project.lab.chaos.patroni`); the
summary adds the failovers, the unavailability per failover and the tokens the
promotion guard skipped; with ``--celery`` the workers are Celery workers, as
without ``--patroni``. With ``--unsafe``, the negative control: asynchronous
replication, the guard disabled, WAL shipping stopped before the primary is
killed; the checker must find reused tokens or lost acknowledged writes.
"""

from __future__ import annotations

import json
from argparse import ArgumentParser
from typing import Any

from django.apps import apps
from django.core.management.base import BaseCommand, CommandError

from project.lab.chaos.beat import BeatChaos, BeatChaosConfig
from project.lab.chaos.faults import FAULT_KINDS, ManagedServerError
from project.lab.chaos.jobs import JOB_FAULT_KINDS, JobsChaos, JobsChaosConfig
from project.lab.chaos.patroni import CLUSTER_FAULT_KINDS, PatroniError
from project.lab.chaos.run import ChaosConfig, ChaosError, ChaosRun


class Command(BaseCommand):
    help = (
        "Run worker processes that take locks and make fenced writes while faults are "
        "injected, then check the whole history. Exit status 1 on any violation."
    )

    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.add_argument("--seconds", type=float, default=30.0, help="how long to run (default 30)")
        parser.add_argument("--workers", type=int, default=4, help="worker processes (default 4)")
        parser.add_argument("--keys", type=int, default=2, help="lock keys, one Account each (default 2)")
        parser.add_argument("--ttl", type=float, default=1.0,
                            help="lease seconds (default 1; at least 2 with --jobs)")
        parser.add_argument("--seed", type=int, default=None, help="random seed (default: random, printed)")
        parser.add_argument("--json", dest="json_path", metavar="PATH", help="write the figures here")
        parser.add_argument("--history", metavar="PATH", help="write the merged JSON lines history here")
        parser.add_argument(
            "--no-fencing", dest="fencing", action="store_false",
            help="negative control: the same writes as plain updates; the checker must fail",
        )
        parser.add_argument(
            "--manage-postgres", action="store_true",
            help="run against a throwaway PostgreSQL server this command starts, so it can restart it",
        )
        parser.add_argument(
            "--fault-interval", type=float, default=1.5, help="mean seconds between faults (default 1.5)"
        )
        parser.add_argument(
            "--faults", default=",".join(FAULT_KINDS),
            help=f"comma-separated fault kinds (default: all of {', '.join(FAULT_KINDS)})",
        )
        parser.add_argument(
            "--celery", action="store_true",
            help="the workers are `celery worker` processes running a fenced_task (needs a broker)",
        )
        parser.add_argument(
            "--primitives", action="store_true",
            help="workers also take readers (acquire_shared), permits of a semaphore of limit "
                 "--permits (acquire_permit) and sets of two keys (acquire_many); the checker "
                 "judges their invariants (not with --celery)",
        )
        parser.add_argument("--permits", type=int, default=2,
                            help="the semaphore's limit with --primitives (default 2)")
        parser.add_argument(
            "--celery-app", default="project", help="the Celery app module for --celery (default project)"
        )
        parser.add_argument(
            "--no-documents", dest="documents", action="store_false", default=None,
            help="leave the fenced document store out of the workload",
        )

        parser.add_argument(
            "--redis-url", default="",
            help="also write one Redis key per account through the fenced Redis writes (extra [redis])",
        )
        parser.add_argument(
            "--s3-endpoint", default="",
            help="also write one object per account through FencedS3Storage at this S3 endpoint "
            "(extra [s3]; credentials from the AWS_* environment)",
        )
        parser.add_argument("--s3-bucket", default="coordination-chaos",
                            help="the bucket for --s3-endpoint, created if missing "
                                 "(default coordination-chaos)")
        cluster = parser.add_argument_group("--patroni: failover chaos on bin/cluster.sh's cluster")
        cluster.add_argument(
            "--patroni", action="store_true",
            help="run against the running Patroni cluster (bin/cluster.sh start), synchronous "
                 "replication, and kill, pause and switch over its primary",
        )
        cluster.add_argument(
            "--unsafe", action="store_true",
            help="with --patroni, the negative control: asynchronous replication, the promotion "
                 "guard disabled, replication stopped before the primary is killed; the checker must fail",
        )
        cluster.add_argument(
            "--cluster-faults", default=",".join(CLUSTER_FAULT_KINDS),
            help=f"comma-separated cluster fault kinds (default: all of {', '.join(CLUSTER_FAULT_KINDS)})",
        )
        cluster.add_argument("--cluster-interval", type=float, default=5.0,
                             help="mean seconds from a recovered cluster to its next fault (default 5)")
        cluster.add_argument("--lag-seconds", type=float, default=3.0,
                             help="--unsafe: seconds the primary's WAL senders stay stopped (default 3)")

        beat = parser.add_argument_group("--beat: several celery beats, one leader (needs a broker)")
        beat.add_argument(
            "--beat", action="store_true",
            help="run beats with FencedScheduler and a worker, pause and kill the leader, check "
                 "that no slot ran twice (with --no-fencing: the stock scheduler's duplicates)",
        )
        beat.add_argument(
            "--beat-database", action="store_true",
            help="the schedule in a django-celery-beat PeriodicTask row, sent by FencedDatabaseScheduler "
                 "(with --no-fencing: django-celery-beat's DatabaseScheduler); needs django-celery-beat "
                 "and whole-second --beat-interval",
        )
        beat.add_argument("--beats", type=int, default=2, help="beat processes (default 2)")
        beat.add_argument("--beat-interval", type=float, default=1.0,
                          help="seconds between the schedule's slots (default 1)")
        beat.add_argument("--beat-lease", type=float, default=5.0,
                          help="the beat leader's lease, seconds (default 5)")
        beat.add_argument("--beat-lock-delay", type=float, default=0.0,
                          help="seconds the role stays unwinnable after a lease expired (default 0)")
        beat.add_argument("--beat-publish-delay", type=float, default=0.25,
                          help="seconds between a slot's claim and its publication, so that kills "
                               "sometimes leave lost slots (default 0.25)")

        jobs = parser.add_argument_group("--jobs: coordinated jobs on real workers (needs a Redis broker)")
        jobs.add_argument(
            "--jobs", action="store_true",
            help="run capped and once-only tasks on workers killed after a commit, paused and killed; "
                 "check the cap, that no completed task id ran twice and that nothing was lost "
                 "(with --no-fencing: the same bodies without the features)",
        )
        jobs.add_argument("--job-cap", type=int, default=2, help="executions at once per key (default 2)")
        jobs.add_argument(
            "--job-faults", default=",".join(JOB_FAULT_KINDS),
            help=f"comma-separated fault kinds (default: all of {', '.join(JOB_FAULT_KINDS)})",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        if options["beat"]:
            self._beat(options)
            return
        if options["jobs"]:
            self._jobs(options)
            return
        faults = tuple(kind.strip() for kind in options["faults"].split(",") if kind.strip())
        unknown = set(faults) - set(FAULT_KINDS)
        if unknown:
            raise CommandError(f"unknown fault kinds: {', '.join(sorted(unknown))}")
        if options["workers"] < 2 or options["keys"] < 1 or options["ttl"] <= 0 or options["seconds"] <= 0:
            raise CommandError("need --workers >= 2, --keys >= 1, --ttl > 0 and --seconds > 0")
        cluster_faults = tuple(kind.strip() for kind in options["cluster_faults"].split(",") if kind.strip())
        if set(cluster_faults) - set(CLUSTER_FAULT_KINDS) or not cluster_faults:
            raise CommandError(f"--cluster-faults: choose from {', '.join(CLUSTER_FAULT_KINDS)}")
        if options["unsafe"] and not options["patroni"]:
            raise CommandError("--unsafe is the negative control of --patroni")
        if options["patroni"] and options["manage_postgres"]:
            raise CommandError("--patroni runs against the cluster of bin/cluster.sh: no --manage-postgres")
        if not apps.is_installed("project.demo"):
            raise CommandError(
                "coordination_chaos writes to the demo app's Account rows: add project.demo to "
                "INSTALLED_APPS (it is in this repository's site)"
            )
        config = ChaosConfig(
            seconds=options["seconds"], workers=options["workers"], keys=options["keys"],
            ttl=options["ttl"], seed=options["seed"], fencing=options["fencing"],
            manage_postgres=options["manage_postgres"], history=options["history"],
            fault_interval=options["fault_interval"], documents=options["documents"], faults=faults,
            redis_url=options["redis_url"], s3_endpoint=options["s3_endpoint"],
            s3_bucket=options["s3_bucket"],
            celery=options["celery"], celery_app=options["celery_app"],
            primitives=options["primitives"], permits=options["permits"],
            patroni=options["patroni"], unsafe=options["unsafe"], cluster_faults=cluster_faults,
            cluster_interval=options["cluster_interval"], lag_seconds=options["lag_seconds"],
        )
        if config.primitives and config.celery:
            raise CommandError("--primitives runs plain workers; leave out --celery")
        try:
            report = ChaosRun(config, out=self.stdout).run()
        except KeyboardInterrupt:
            raise CommandError("interrupted; workers and the managed server were stopped") from None
        except (ChaosError, ManagedServerError, PatroniError) as error:
            raise CommandError(f"the chaos run could not be carried out: {error}") from None
        self.stdout.write(report.summary())
        if options["json_path"]:
            with open(options["json_path"], "w", encoding="utf-8") as out:
                json.dump(report.as_dict(), out, indent=2, sort_keys=True)
        if not report.passed:
            if config.unsafe and report.violations:
                raise CommandError(
                    f"--unsafe: {len(report.violations)} violations, as expected without the promotion "
                    "guard and synchronous replication",
                    returncode=1,
                )
            if not config.fencing:
                raise CommandError(
                    f"--no-fencing: {len(report.violations)} violations, as expected without fences",
                    returncode=1,
                )
            raise CommandError(
                f"{len(report.violations)} violations; stale writes attempted: {report.stale_attempts}",
                returncode=1,
            )

    def _beat(self, options: dict[str, Any]) -> None:
        if options["beats"] < 2 or options["seconds"] <= 0 or options["beat_lease"] <= 0:
            raise CommandError("need --beats >= 2, --seconds > 0 and --beat-lease > 0")
        if options["beat_database"]:
            if not apps.is_installed("django_celery_beat"):
                raise CommandError("--beat-database needs django-celery-beat installed and in "
                                   "INSTALLED_APPS (docs/beat.md)")
            every = options["beat_interval"]
            if every < 1 or every != int(every):
                raise CommandError("--beat-database: --beat-interval is whole seconds "
                                   "(a PeriodicTask's unit)")
        config = BeatChaosConfig(
            seconds=options["seconds"], beats=options["beats"], interval=options["beat_interval"],
            lease=options["beat_lease"], lock_delay=options["beat_lock_delay"],
            publish_delay=options["beat_publish_delay"],
            fenced=options["fencing"], seed=options["seed"], celery_app=options["celery_app"],
            database=options["beat_database"],
        )
        try:
            report = BeatChaos(config, out=self.stdout).run()
        except KeyboardInterrupt:
            raise CommandError("interrupted; the beats and the worker were stopped") from None
        except (AssertionError, ValueError) as error:
            raise CommandError(f"the beat chaos run could not be carried out: {error}") from None
        self.stdout.write(report.summary())
        if options["json_path"]:
            with open(options["json_path"], "w", encoding="utf-8") as out:
                json.dump(report.as_dict(), out, indent=2, sort_keys=True)
        if not report.passed:
            if not config.fenced:
                raise CommandError(
                    f"--no-fencing: {report.figures.get('duplicates')} duplicate executions, as "
                    "expected of the stock scheduler on several beats",
                    returncode=1,
                )
            raise CommandError(f"{len(report.violations)} violations", returncode=1)

    def _jobs(self, options: dict[str, Any]) -> None:
        faults = tuple(kind.strip() for kind in options["job_faults"].split(",") if kind.strip())
        if set(faults) - set(JOB_FAULT_KINDS):
            raise CommandError(f"--job-faults: choose from {', '.join(JOB_FAULT_KINDS)}")
        if options["workers"] < 2 or options["job_cap"] < 1 or options["seconds"] <= 0:
            raise CommandError("need --workers >= 2, --job-cap >= 1 and --seconds > 0")
        config = JobsChaosConfig(
            seconds=options["seconds"], workers=options["workers"], cap=options["job_cap"],
            keys=options["keys"], ttl=max(options["ttl"], 2.0), faults=faults,
            fenced=options["fencing"], seed=options["seed"], celery_app=options["celery_app"],
        )
        try:
            report = JobsChaos(config, out=self.stdout).run()
        except KeyboardInterrupt:
            raise CommandError("interrupted; the workers were stopped") from None
        except AssertionError as error:
            raise CommandError(f"the jobs chaos run could not be carried out: {error}") from None
        self.stdout.write(report.summary())
        if options["json_path"]:
            with open(options["json_path"], "w", encoding="utf-8") as out:
                json.dump(report.as_dict(), out, indent=2, sort_keys=True, default=str)
        if not report.passed:
            if not config.fenced:
                raise CommandError(
                    f"--no-fencing: {len(report.violations)} violations, as expected without the features",
                    returncode=1,
                )
            raise CommandError(f"{len(report.violations)} violations", returncode=1)
