"""Real beats on PostgreSQL and Redis: two ``celery beat -S FencedScheduler``
processes and one ``celery worker``, a schedule entry every second; the leader
is paused past its lease (SIGSTOP, then SIGCONT once a new term sent a slot),
then killed (SIGKILL) and a new beat started. The checker over the whole history
(project/lab/chaos/beat.py) asserts that no slot ran twice, that every sent slot
ran, and that every lost slot is the last claim of a beat that died.

Short on purpose (CI budget): one pause and one kill, a 5 s lease (the shortest
docs/celery.md calls safe with the keep-alive). ``coordination_chaos --beat``
runs the same for as long as asked, with the negative control.
"""

from __future__ import annotations

import io

import pytest

from project.lab.chaos.beat import BeatChaos, BeatChaosConfig
from tests.support.celery_workers import redis_url, wait_until_workers_disconnect


@pytest.mark.postgres
@pytest.mark.legs(
    "pg",
    reason="real beat processes on PostgreSQL; the other legs run the scheduler in process",
)
@pytest.mark.django_db(transaction=True)
def test_two_fenced_beats_never_run_a_slot_twice_through_a_pause_and_a_kill_of_the_leader() -> None:
    out = io.StringIO()
    config = BeatChaosConfig(seconds=1.0, beats=2, interval=1.0, lease=5.0, broker=redis_url(),
                             min_faults=1, lead_between_faults=2.0)
    try:
        report = BeatChaos(config, out=out).run()
    finally:
        wait_until_workers_disconnect()
    figures = report.figures
    print(out.getvalue(), report.summary(), figures)  # shown with -s, and on failure
    assert report.passed, (report.violations, figures, out.getvalue())
    assert figures["slots_executed_twice"] == 0
    assert figures["pauses"] >= 1 and figures["kills"] >= 1 and figures["restarts"] >= 1
    assert figures["takeovers"] >= 2 and figures["terms"] >= 3
    assert figures["slots_sent"] >= 6
    assert figures["slots_lost"] == figures["lost_accounted"]
    # A take-over comes within the lease plus the standby's poll and a new
    # leader's first pass; generous for a loaded machine.
    assert figures["takeover_max"] < config.lease + 10, figures


@pytest.mark.postgres
@pytest.mark.legs("pg", reason="real beat processes; the negative control needs one leg")
@pytest.mark.django_db(transaction=True)
def test_negative_control_two_stock_beats_run_every_slot_twice() -> None:
    # Celery's own scheduler on two beats: each sends every entry.
    config = BeatChaosConfig(seconds=6.0, beats=2, interval=1.0, fenced=False, broker=redis_url())
    out = io.StringIO()
    try:
        report = BeatChaos(config, out=out).run()
    finally:
        wait_until_workers_disconnect()
    assert not report.passed, (report.figures, out.getvalue())
    assert report.figures["duplicates"] >= 2, (report.figures, out.getvalue())
