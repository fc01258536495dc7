"""Real beats on django-celery-beat's rows: two ``celery beat -S
coordination.contrib.beat.FencedDatabaseScheduler`` processes and one ``celery
worker`` on PostgreSQL and Redis, a ``PeriodicTask`` every 2 seconds. The
leader is paused (SIGSTOP) past its 5 s lease until the other beat's new term
has sent a slot, then resumed (SIGCONT); then the new leader is paused the
same way, so each beat is paused in turn. The chaos checker
(project/lab/chaos/beat.py) asserts over the whole history that no slot ran
twice and every sent slot ran; here, also that the task ran about once per
period.

The negative control runs django-celery-beat's own ``DatabaseScheduler`` on
the same two beats and the same row: each beat sends every period.

The harness pauses and resumes the beats itself; whatever happens, its
``run()`` resumes (SIGCONT) and kills every process it started and waits for
them. It waits on rows (a new term's claimed slots), never on a clock window.
"""

from __future__ import annotations

import io

import pytest

from project.lab.chaos.beat import BeatChaos, BeatChaosConfig
from tests.support.celery_workers import redis_url, wait_until_workers_disconnect

pytestmark = [
    pytest.mark.postgres,
    pytest.mark.legs("pg", reason="real beat processes; the lts leg runs the scheduler in process"),
    pytest.mark.django_db(transaction=True),
]

INTERVAL = 2.0


def run(config: BeatChaosConfig) -> tuple[BeatChaos, dict[str, object], str]:
    out = io.StringIO()
    chaos = BeatChaos(config, out=out)
    try:
        report = chaos.run()
    finally:
        wait_until_workers_disconnect()
    text = out.getvalue() + report.summary()
    print(text, report.figures)  # shown with -s, and on failure
    return chaos, {**report.figures, "passed": report.passed, "violations": report.violations}, text


def test_two_fenced_database_beats_each_paused_in_turn_run_the_task_once_per_period() -> None:
    config = BeatChaosConfig(
        seconds=1.0, beats=2, interval=INTERVAL, lease=5.0, broker=redis_url(), database=True,
        faults=("pause",), min_faults=2, lead_between_faults=2 * INTERVAL,
    )
    chaos, figures, text = run(config)
    assert figures["passed"], (figures, text)
    assert figures["scheduler"] == "coordination.contrib.beat.FencedDatabaseScheduler"
    paused = [fault["pid"] for fault in chaos.faults if fault["kind"] == "pause"]
    assert len(paused) >= 2 and len(set(paused)) == 2, (chaos.faults, text)  # each beat, in turn
    assert figures["takeovers"] >= 2 and figures["terms"] >= 3, figures
    assert figures["slots_executed_twice"] == 0
    assert figures["slots_sent"] >= 6, figures
    # About once per period: a take-over skips the periods of the gap (collapsed
    # into one slot), never doubles one. Two beats sending would give about 2.
    runs_per_period = figures["runs_per_period"]
    assert isinstance(runs_per_period, float) and runs_per_period <= 1.25, figures


def test_negative_control_two_stock_database_schedulers_run_each_period_twice() -> None:
    config = BeatChaosConfig(seconds=6 * INTERVAL, beats=2, interval=INTERVAL, fenced=False,
                             broker=redis_url(), database=True)
    _, figures, text = run(config)
    assert figures["scheduler"] == "django_celery_beat.schedulers:DatabaseScheduler"
    assert not figures["passed"], (figures, text)
    assert figures["duplicates"] >= 2, (figures, text)
    runs_per_period = figures["runs_per_period"]
    assert isinstance(runs_per_period, float) and runs_per_period >= 1.4, figures
