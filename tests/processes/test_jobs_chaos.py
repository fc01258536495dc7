"""Real workers run coordinated jobs through pauses, kills after a body's commit and
messages published twice; the checker over the committed rows
(project/lab/chaos/jobs.py) finds no key above its cap, no completed task id run
twice, no unique key run by two messages, no window over its rate and nothing
lost. The negative control, the same bodies without the features, finds every
kind of violation.

Short on purpose (CI budget); ``coordination_chaos --jobs`` runs the same for as
long as asked.
"""

from __future__ import annotations

import io
from typing import Any

import pytest

from project.lab.chaos.jobs import JobsChaos, JobsChaosConfig, JobsReport
from tests.support.celery_workers import redis_url, wait_until_workers_disconnect

pytestmark = [
    pytest.mark.postgres,
    pytest.mark.legs("pg", reason="real workers paused and killed; the chaos table is PostgreSQL's"),
    pytest.mark.django_db(transaction=True),
]


def _run(config: JobsChaosConfig) -> tuple[JobsReport, dict[str, Any]]:
    out = io.StringIO()
    try:
        report = JobsChaos(config, out=out).run()
    finally:
        wait_until_workers_disconnect()
    print(out.getvalue(), report.summary())  # shown with -s, and on failure
    return report, report.figures


def test_jobs_keep_their_cap_and_never_run_a_completed_task_id_twice_under_faults() -> None:
    config = JobsChaosConfig(seconds=12.0, workers=3, cap=2, keys=2, broker=redis_url())
    report, figures = _run(config)
    assert report.passed, (report.violations, figures)
    assert figures["faults"].get("kill_after_commit", 0) >= 1, figures
    assert figures["faults"].get("pause", 0) >= 1, figures
    # The faults bit: a finished task's message was delivered again, and copies ran at once.
    assert figures["once_redelivered"] >= 1, figures
    assert figures["most_at_once"] == 2, figures
    assert figures["once_bodies"] == figures["once_ids"], figures
    # Every unique key was sent three times at once; one message of each ran.
    assert figures["unique_keys"] >= 1 and figures["unique_most_run"] == 1, figures
    # Bursts over the rate were spread out by the limiter, every body under a logged start.
    assert figures["rated_sent"] >= 3 and figures["rate_most_in_window"] == 2, figures
    assert figures["rate_logged"] >= figures["rate_bodies"] == figures["rated_sent"], figures


def test_negative_control_without_the_features_finds_every_violation() -> None:
    config = JobsChaosConfig(seconds=8.0, workers=3, cap=2, keys=1, fenced=False,
                             faults=("kill_after_commit",), broker=redis_url())
    report, figures = _run(config)
    assert not report.passed
    assert figures["most_at_once"] > 2, figures
    assert figures["once_ran_twice"] >= 1, figures
    assert figures["unique_most_run"] > 1, figures
    assert figures["rate_most_in_window"] > 2, figures
