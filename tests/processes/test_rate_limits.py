"""Rate limits and caps per key on real prefork workers (two workers of two
processes each) with a Redis broker.

A rate of 4 starts per 2 seconds per key holds over every process: no window
of 2 seconds holds more than 4 logged starts (database time), the executions
over it are deferred and every message runs once. A job policy's cap of 2 per
customer holds while another customer's executions run beside them. The
negative controls: without the rate the same messages start far more than 4
in 2 seconds; without the cap a customer runs more than 2 at once.
"""

from __future__ import annotations

import datetime as dt
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from coordination import jobs, ratelimits
from coordination.models import JobPolicy, JobTally
from project.demo.models import Account
from tests.support import rate_limit_tasks as tasks
from tests.support.celery_workers import (
    RedisBroker,
    Worker,
    events,
    publish,
    unique,
    wait_ready,
)
from tests.support.waiting import wait_for

pytestmark = [
    pytest.mark.legs("pg", reason="prefork workers of several processes need a database with row locks"),
    pytest.mark.django_db(transaction=True),
]

LIMIT, PERIOD = tasks.RATE
# A policy change reaches every worker process within the refresh.
REFRESH = 2.0


@pytest.fixture(scope="module")
def workers(start_workers: Callable[..., Worker]) -> list[Worker]:
    queue = unique("rates")
    started = [
        start_workers(f"rates{n}", queue=queue, pool="prefork", concurrency=2, ready=False)
        for n in (1, 2)
    ]
    wait_ready(started)
    return started


def send(task: Any, workers: list[Worker], broker: RedisBroker, messages: list[tuple[Any, ...]],
         **kwargs: Any) -> None:
    with broker.connection() as conn:
        for args in messages:
            task.apply_async(args, kwargs, queue=workers[0].queue, connection=conn)


def starts(report: Path) -> list[dict[str, Any]]:
    return [event for event in events(report) if event["event"] == "start"]


def most_in_any_window(times: list[dt.datetime], period: float) -> int:
    """The most starts a half-open window ``[t, t + period)`` holds (largest when it
    opens at a start)."""
    ordered, span = sorted(times), dt.timedelta(seconds=period)
    return max((sum(1 for u in ordered if t <= u < t + span) for t in ordered), default=0)


def test_a_rate_holds_over_every_worker_process_and_every_message_runs_once(
    workers: list[Worker], broker: RedisBroker, tmp_path: Path
) -> None:
    report, run, count = tmp_path / "rated.jsonl", unique("rated"), 12
    send(tasks.rate_limited, workers, broker, [(run, n) for n in range(count)], report=str(report))

    wait_for(lambda: len(starts(report)) == count, timeout=90, what="every rate-limited message")
    time.sleep(0.5)  # a duplicate start would show up now
    ran = starts(report)
    assert Counter(event["n"] for event in ran) == {n: 1 for n in range(count)}
    assert len({event["pid"] for event in ran}) >= 2  # several processes started them

    # The database time each body's start was decided and logged at.
    logged = sorted(dt.datetime.fromisoformat(event["rate_start"]) for event in ran)
    assert len(set(logged)) == count
    assert most_in_any_window(logged, PERIOD) <= LIMIT
    # The log keeps the recent ones (older than two periods are pruned).
    kept = ratelimits.starts_of(jobs.rate_bucket(tasks.rate_limited.name, run))
    assert kept and set(kept) <= set(logged)
    # 12 starts at 4 per 2 s: the 9th is at least two periods after the 1st.
    assert (logged[-1] - logged[0]).total_seconds() >= 2 * PERIOD
    # Sent at once, faster than 4 per 2 s: those over it went back to the broker.
    assert JobTally.objects.get(task=tasks.rate_limited.name, outcome="deferred").count >= 1


def test_negative_control_without_the_rate_the_same_messages_crowd_a_window(
    workers: list[Worker], broker: RedisBroker, tmp_path: Path
) -> None:
    report, run, count = tmp_path / "unrated.jsonl", unique("unrated"), 12
    send(tasks.unlimited, workers, broker, [(run, n) for n in range(count)], report=str(report))

    wait_for(lambda: len(starts(report)) == count, timeout=90, what="every message")
    times = [dt.datetime.fromisoformat(event["at"]) for event in starts(report)]
    assert most_in_any_window(times, PERIOD) > LIMIT


def _customers(
    queue: str, broker: RedisBroker | None, report: Path, *, a: int = 6, b: int = 2, hold: float = 1.5
) -> None:
    """``a`` executions of customer a and ``b`` of customer b, each running ``hold`` s."""
    counters = {name: Account.objects.create(owner=f"running {name}") for name in ("a", "b")}
    everyone = Account.objects.create(owner="running everyone")
    for customer, n in [("a", n) for n in range(a)] + [("b", 10 + n) for n in range(b)]:
        publish(tasks.per_customer, queue, broker, customer, n, kwargs={
            "counter": counters[customer].pk, "everyone": everyone.pk, "report": str(report),
            "hold": hold,
        })
    wait_for(lambda: len([e for e in events(report) if e["event"] == "end"]) == a + b, timeout=120,
             what="every customer's execution")


def test_a_policy_cap_of_two_per_customer_holds_while_other_customers_run(
    workers: list[Worker], broker: RedisBroker, tmp_path: Path
) -> None:
    JobPolicy(task=tasks.per_customer.name, key_cap=2, cap_key="{customer}").save(
        changed_by="test", via="orm"
    )
    time.sleep(REFRESH + 0.5)  # every worker process reads it
    report = tmp_path / "capped.jsonl"
    _customers(workers[0].queue, broker, report)

    ran = starts(report)
    assert Counter(event["customer"] for event in ran) == {"a": 6, "b": 2}
    assert max(event["running"] for event in ran if event["customer"] == "a") == 2
    # b ran beside a's two: the cap is per customer, not per task.
    assert max(event["overall"] for event in ran if event["customer"] == "b") >= 3
    wait_for(lambda: jobs.running(tasks.per_customer.name) == [], timeout=30, what="leases released")


def test_negative_control_without_the_cap_a_customer_runs_more_than_two_at_once(
    workers: list[Worker], broker: RedisBroker, tmp_path: Path
) -> None:
    report = tmp_path / "uncapped.jsonl"
    _customers(workers[0].queue, broker, report)
    assert max(event["running"] for event in starts(report) if event["customer"] == "a") > 2


@pytest.mark.legs("sqlite", reason="the embedded default's own run; the PostgreSQL leg runs the ones above")
def test_on_the_embedded_default_a_cap_per_customer_holds_over_a_prefork_worker(
    start_workers: Callable[..., Worker], tmp_path: Path,
) -> None:
    """A cap of 1 per customer on a worker of 2 processes: customer a's executions
    never overlap (counted by the database), while b's runs beside one of them."""
    JobPolicy(task=tasks.per_customer.name, key_cap=1, cap_key="{customer}").save(
        changed_by="test", via="orm"
    )
    worker = start_workers("caps-embedded", embedded=True, pool="prefork", concurrency=2)
    report = tmp_path / "capped.jsonl"
    # Long enough for the filesystem broker, polled every second, to hand b's message over.
    _customers(worker.queue, None, report, a=3, b=1, hold=4.0)

    ran = starts(report)
    assert Counter(event["customer"] for event in ran) == {"a": 3, "b": 1}
    assert max(event["running"] for event in ran if event["customer"] == "a") == 1
    assert max(event["overall"] for event in ran) == 2  # b beside one of a's


@pytest.mark.legs("sqlite", reason="the embedded default's own run; the PostgreSQL leg runs the ones above")
def test_on_the_embedded_default_a_rate_holds_over_a_prefork_worker_on_the_filesystem_broker(
    start_workers: Callable[..., Worker], tmp_path: Path,
) -> None:
    """SQLite and Celery's filesystem transport, the setup ``bin/run`` gives a new user."""
    worker = start_workers("rates-embedded", embedded=True, pool="prefork", concurrency=2)
    report, run, count = tmp_path / "embedded.jsonl", unique("embedded"), 8
    # The key's whole rate used just now: the first messages, however slowly this
    # broker hands them over, start inside the window and must wait their turn.
    bucket = jobs.rate_bucket(tasks.rate_limited.name, run)
    used = [ratelimits.take_start(bucket, ratelimits.Rate(*tasks.RATE)) for _ in range(LIMIT)]
    assert all(decision.granted for decision in used)
    for n in range(count):
        tasks.rate_limited.apply_async((run, n), {"report": str(report)}, queue=worker.queue)
    wait_for(lambda: len(starts(report)) == count, timeout=90, what="every message")
    ran = starts(report)
    assert Counter(event["n"] for event in ran) == {n: 1 for n in range(count)}
    logged = sorted(dt.datetime.fromisoformat(event["rate_start"]) for event in ran)
    assert most_in_any_window([decision.at for decision in used] + logged, PERIOD) <= LIMIT
    assert (logged[-1] - logged[0]).total_seconds() >= PERIOD
    # Over the rate: some went back to the broker, and still ran.
    assert JobTally.objects.get(task=tasks.rate_limited.name, outcome="deferred").count >= 1
