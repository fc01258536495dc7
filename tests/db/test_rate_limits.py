"""Rate limits and caps per key, in this process: the limiter's decision on the
database clock, executions over a rate deferred (or waiting) and never lost,
a job policy's rate and cap per key, and a copy paused past its cap permit's
lease refused at the resource. Real workers: tests/processes/test_rate_limits.py."""

from __future__ import annotations

import datetime as dt
import threading
import time
from typing import Any

import pytest
from django.db import connections
from prometheus_client import REGISTRY

from coordination import jobs, locks, ratelimits, signals
from coordination.contrib.celery import fenced_task
from coordination.contrib.execution import Skipped, current_execution
from coordination.exceptions import InvalidInput, StaleToken
from coordination.fencing import fence
from coordination.models import JobPolicy, JobTally, RateStart
from coordination.ratelimits import Rate, parse_rate, take_start
from coordination.semaphores import acquire_permit
from tests.support.waiting import wait_for, wait_until_database_time_passes

pytestmark = pytest.mark.django_db(transaction=True)

ran: list[tuple[str, int]] = []


@pytest.fixture(autouse=True)
def fresh_policies(uncached_policies: None) -> None:
    ran.clear()


def most_in_any_window(times: list[dt.datetime], period: float) -> int:
    """The most starts any half-open window ``[t, t + period)`` holds: a window's
    count is largest when it opens at a start, so those are the windows to try."""
    ordered = sorted(times)
    span = dt.timedelta(seconds=period)
    return max((sum(1 for u in ordered if t <= u < t + span) for t in ordered), default=0)


def test_rates_parse_as_drf_throttle_rates_and_bad_ones_are_refused() -> None:
    assert parse_rate("10/m") == Rate(10, 60.0)
    assert parse_rate("100/hour") == Rate(100, 3600.0)
    assert parse_rate("5/s") == Rate(5, 1.0)
    assert parse_rate("10/30s") == Rate(10, 30.0)
    assert parse_rate((3, 1.5)) == Rate(3, 1.5)
    for bad in ("10", "ten/m", "10/ms", "0/m", "10/0s", "10/8d", "", (True, 1), None, 10):
        with pytest.raises(InvalidInput):
            parse_rate(bad)


def test_a_task_declaring_a_bad_rate_or_a_rate_key_it_cannot_render_is_refused_at_once() -> None:
    def body(n: int) -> None: ...

    with pytest.raises(InvalidInput, match="is not a rate"):
        fenced_task(lock="r:{n}", rate="10/fortnight", name="t.bad_rate")(body)
    with pytest.raises(InvalidInput, match=r"names \{customer\}"):
        fenced_task(lock="r:{n}", rate="10/m", rate_key="{customer}", name="t.bad_key")(body)
    with pytest.raises(InvalidInput, match="needs a rate"):
        fenced_task(lock="r:{n}", rate_key="{n}", name="t.no_rate")(body)


def test_the_limiter_grants_n_starts_then_refuses_with_the_oldest_starts_countdown() -> None:
    rate = Rate(3, 1.0)
    granted = [take_start("unit|a", rate) for _ in range(3)]
    assert all(decision.granted for decision in granted)
    refused = take_start("unit|a", rate)
    assert not refused.granted and refused.in_window == 3
    # The time until the oldest start leaves the window, on the database clock.
    expected = (granted[0].at + dt.timedelta(seconds=1) - refused.at).total_seconds()
    assert refused.countdown == pytest.approx(expected, abs=0.002)
    assert 0 < refused.countdown <= 1.0
    assert take_start("unit|b", rate).granted  # another key counts alone
    wait_until_database_time_passes(granted[0].at + dt.timedelta(seconds=1))
    assert take_start("unit|a", rate).granted
    assert most_in_any_window(ratelimits.starts_of("unit|a"), 1.0) <= 3


def test_threads_racing_for_one_key_never_put_more_than_n_starts_in_any_window() -> None:
    rate, stop, errors = Rate(4, 0.5), time.monotonic() + 2.5, []

    def race() -> None:
        try:
            while time.monotonic() < stop:
                if not take_start("race|k", rate).granted:
                    time.sleep(0.01)
        except Exception as error:  # pragma: no cover - reported below
            errors.append(error)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=race) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    starts = ratelimits.starts_of("race|k")
    assert len(starts) > 4  # more than one window's worth: the limiter let later ones in
    assert most_in_any_window(starts, 0.5) <= 4


def test_old_starts_are_pruned_by_the_keys_own_decisions_and_by_prune_starts() -> None:
    rate = Rate(5, 0.2)
    first = take_start("prune|k", rate)
    wait_until_database_time_passes(first.at + dt.timedelta(seconds=0.45))
    take_start("prune|k", rate)
    assert len(ratelimits.starts_of("prune|k")) == 1  # the first was older than two periods
    assert ratelimits.prune_starts(older_than=0.0) >= 1
    assert not RateStart.objects.exists()


# --- executions ---------------------------------------------------------------------


@fenced_task(lock="limited:{customer}:{n}", ttl=5, rate=(2, 1.0), rate_key="{customer}")
def limited(customer: str, n: int) -> int:
    ran.append((customer, n))
    return n


def test_an_execution_over_the_rate_waits_the_limiters_countdown_when_it_cannot_be_sent_again() -> None:
    """Called in process there is no message to send again: the third start of
    customer a waits in the caller until the window has room, and still runs."""
    seen: list[float] = []

    def note(sender: Any, countdown: float = 0.0, **kwargs: Any) -> None:
        seen.append(countdown)

    counted = REGISTRY.get_sample_value("coordination_jobs_rate_limited_total", {"task": limited.name}) or 0.0
    signals.task_rate_limited.connect(note)
    try:
        assert [limited("a", n) for n in range(3)] == [0, 1, 2]
        assert limited("b", 9) == 9
    finally:
        signals.task_rate_limited.disconnect(note)
    after = REGISTRY.get_sample_value("coordination_jobs_rate_limited_total", {"task": limited.name})
    assert after is not None and after >= counted + 1
    assert ran == [("a", 0), ("a", 1), ("a", 2), ("b", 9)]
    assert seen and 0 < seen[0] <= 1.0
    bucket = jobs.rate_bucket(limited.name, "a")
    assert len(ratelimits.starts_of(bucket)) == 3
    assert most_in_any_window(ratelimits.starts_of(bucket), 1.0) <= 2
    assert JobTally.objects.get(task=limited.name, outcome="deferred").count >= 1
    assert len(ratelimits.starts_of(jobs.rate_bucket(limited.name, "b"))) == 1


def test_a_policys_rate_replaces_the_decorators_and_counts_per_its_template() -> None:
    JobPolicy(task="tests.db.*", rate_limit=1, rate_period=30, rate_key="{n}").save()
    assert limited("a", 1) == 1
    assert limited("b", 2) == 2  # another n: its own count
    bucket = jobs.rate_bucket("tests.db.*", "1")
    assert len(ratelimits.starts_of(bucket)) == 1
    # Over it: the countdown is the whole period, so waiting is not the outcome here.
    over = take_start(bucket, Rate(1, 30.0))
    assert not over.granted and 29 < over.countdown <= 30


def test_long_rate_keys_fit_the_column_and_keep_their_own_counts() -> None:
    # A task name and a rendered key can pass 255 characters (MariaDB's bound on a
    # unique text column): such keys end in their digest and are still counted apart.
    scope = "tests." + "x" * 200
    first, second = jobs.rate_bucket(scope, "a" * 100), jobs.rate_bucket(scope, "a" * 99 + "b")
    assert len(first) == len(second) == 255 and first != second
    assert jobs.rate_bucket(scope, "short") == f"{scope}|short"
    assert take_start(first, Rate(1, 30.0)).granted
    assert take_start(second, Rate(1, 30.0)).granted
    assert not take_start(first, Rate(1, 30.0)).granted


def test_an_execution_over_its_rate_gives_its_lock_back_before_it_is_deferred() -> None:
    deferred: list[tuple[float, str]] = []
    from coordination.contrib.execution import FencedExecution

    JobPolicy(task="rated.one", rate_limit=1, rate_period=30).save()
    take_start(jobs.rate_bucket("rated.one", ""), Rate(1, 30.0))  # the one start of the period
    execution = FencedExecution("rated:key", holder="h", ttl=5, name="rated.one")
    outcome = execution.run(lambda: "ran", defer=lambda countdown, why: deferred.append((countdown, why)))
    assert outcome is None and len(deferred) == 1
    countdown, why = deferred[0]
    assert why == "rate_limited" and 29 < countdown <= 30
    assert locks.acquire("rated:key", holder="next", ttl=5).token == 2  # released, not left held


# --- a cap per key ------------------------------------------------------------------


@fenced_task(lock="capped:{customer}:{n}", ttl=5, on_busy="skip")
def capped(customer: str, n: int) -> str:
    ran.append((customer, n))
    execution = current_execution()
    assert execution is not None and execution.cap_permit is not None
    return execution.cap_permit.key


def test_a_cap_per_key_takes_a_fenced_permit_per_customer_and_other_customers_run() -> None:
    JobPolicy(task=capped.name, key_cap=1, cap_key="{customer}").save()
    held = acquire_permit(jobs.cap_name(capped.name, "a"), limit=1, holder="another copy", ttl=30)
    try:
        busy = capped("a", 1)
        assert isinstance(busy, Skipped) and busy["reason"] == "lock_held"
        assert capped("b", 2) == f"cap:{capped.name}:b@1"  # another customer runs freely
    finally:
        locks.release(held)
    assert capped("a", 3) == f"cap:{capped.name}:a@1"
    assert ran == [("b", 2), ("a", 3)]


def test_a_copy_paused_past_its_cap_permits_lease_is_refused_at_the_resource() -> None:
    """A (no keep-alive, a short lease: a copy stopped past it) holds slot s of the
    customer's cap; the other slot is held throughout. B is granted slot s with
    the next token and writes; A's later write, fenced by its slot, is refused."""
    JobPolicy(task=paused_copy.name, key_cap=2, cap_key="{customer}").save()
    other = acquire_permit(jobs.cap_name(paused_copy.name, "a"), limit=2, holder="other", ttl=60)
    outcomes: dict[str, Any] = {}
    a = threading.Thread(target=lambda: outcomes.update(a=_in_thread(paused_copy, "a", "A")))
    a.start()
    wait_for(lambda: "A-paused" in outcomes_log, timeout=15, what="A past its lease")
    outcomes["B"] = paused_copy("a", "B")
    a.join(timeout=30)
    locks.release(other)
    assert outcomes["B"] == "written"
    assert outcomes["a"] == "refused"
    slot_a, slot_b = outcomes_log["A-permit"], outcomes_log["B-permit"]
    assert slot_a[0] == slot_b[0] != other.key and slot_b[1] == slot_a[1] + 1


outcomes_log: dict[str, Any] = {}


@fenced_task(lock="copy:{customer}:{who}", ttl=0.5, keepalive=False, on_busy="raise")
def paused_copy(customer: str, who: str) -> str:
    execution = current_execution()
    assert execution is not None and execution.cap_permit is not None
    permit = execution.cap_permit
    outcomes_log[f"{who}-permit"] = (permit.key, permit.token)
    with fence(permit.key, permit):
        outcomes_log[f"{who}-written"] = True
    if who == "A":
        wait_until_database_time_passes(permit.expires_at)  # paused past its lease
        outcomes_log["A-paused"] = True
        wait_for(lambda: "B-written" in outcomes_log, timeout=15, what="B's write")
        try:
            with fence(permit.key, permit):
                return "written"
        except StaleToken:
            return "refused"
    return "written"


def _in_thread(task: Any, *args: Any) -> Any:
    try:
        return task(*args)
    finally:
        connections.close_all()


# --- the django.tasks twin ----------------------------------------------------------

try:
    from django.tasks import task_backends
except ImportError:  # Django 5.2: no django.tasks
    HAS_DJANGO_TASKS = False
else:
    HAS_DJANGO_TASKS = True

needs_django_tasks = pytest.mark.skipif(not HAS_DJANGO_TASKS, reason="django.tasks is Django 6.0+")

if HAS_DJANGO_TASKS:
    from coordination.contrib import tasks as contrib_tasks

    @contrib_tasks.fenced_task(lock="twin:{customer}", ttl=5, rate="1/m", rate_key="{customer}")
    def twin_limited(customer: str) -> str:
        ran.append((customer, 0))
        return customer


@needs_django_tasks
def test_the_django_tasks_twin_enqueues_a_run_over_the_rate_again_after_the_countdown(
    settings: Any,
) -> None:
    settings.TASKS = {"default": {"BACKEND": "django.tasks.backends.dummy.DummyBackend"}}
    assert twin_limited.call("a") == "a"

    outcome = twin_limited.call("a")  # what the backend's worker does with a second message

    assert outcome["coordination"] == "deferred" and outcome["reason"] == "rate_limited"
    [again] = task_backends["default"].results
    assert again.task.run_after is not None and again.args == ["a"]
    assert twin_limited.call("b") == "b"  # another customer: its own count
    assert ran == [("a", 0), ("b", 0)]


@needs_django_tasks
def test_a_twin_declaring_a_rate_key_it_cannot_render_is_refused() -> None:
    with pytest.raises(InvalidInput, match="names"):
        contrib_tasks.fenced(lock="x:{a}", rate="1/m", rate_key="{b}")(lambda a: a)


if HAS_DJANGO_TASKS:

    @contrib_tasks.fenced_task(lock="atwin:{customer}", ttl=5, rate="1/m", rate_key="{customer}")
    async def async_limited(customer: str) -> str:
        ran.append((customer, 1))
        return customer


@needs_django_tasks
def test_an_async_twin_over_its_rate_is_enqueued_again_as_the_sync_one_is(settings: Any) -> None:
    settings.TASKS = {"default": {"BACKEND": "django.tasks.backends.dummy.DummyBackend"}}
    assert async_limited.call("a") == "a"
    outcome = async_limited.call("a")
    assert outcome["coordination"] == "deferred" and outcome["reason"] == "rate_limited"
    assert ran == [("a", 1)]
    assert locks.acquire("atwin:a", holder="next", ttl=5).token == 3  # both runs released the key
