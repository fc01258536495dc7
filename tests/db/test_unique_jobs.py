"""Unique jobs in this process: the claims of coordination.unique and the decorator's
enqueue and start checks, with messages sent to a filesystem broker of the test's own
(nothing consumes them) and bodies run with ``apply()``. Runs on every leg, the
embedded default (SQLite) included. Real workers and several producer processes:
tests/processes/test_unique_jobs.py."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery.exceptions import Retry
from prometheus_client import REGISTRY

from coordination import locks, signals, unique
from coordination.contrib.celery import fenced_task
from coordination.exceptions import InvalidInput
from coordination.models import JobTally, UniqueClaim
from project.celery import app
from tests.support.waiting import wait_until_database_time_passes

pytestmark = pytest.mark.django_db(transaction=True)

ran: list[tuple[str, Any]] = []


def dup(result: Any) -> bool:
    """Whether an enqueue was a duplicate (False where nothing says so)."""
    return bool(getattr(result, "duplicate", False))


@fenced_task(lock="ujob:{customer}:{n}", unique="ujob:{customer}", unique_for="succeeded", ttl=5, bind=True)
def until_succeeded(self: Any, customer: int, n: int = 0, *, enqueue_again: bool = False) -> Any:
    ran.append((self.request.id, n))
    if enqueue_again:  # while running: a duplicate enqueue gets this execution
        again = self.apply_async((customer, n + 1))
        return {"id": again.id, "duplicate": dup(again)}
    return n


@fenced_task(lock="qjob:{customer}:{n}", unique="qjob:{customer}", unique_for="queued", ttl=5, bind=True)
def while_queued(self: Any, customer: int, n: int = 0) -> Any:
    ran.append((self.request.id, n))
    return n


@fenced_task(lock="rjob:{customer}:{n}", unique="rjob:{customer}", unique_for="running", ttl=5, bind=True)
def while_running(self: Any, customer: int, n: int = 0, *, nested: bool = False) -> Any:
    ran.append((self.request.id, n))
    if nested:
        again = self.apply_async((customer, n + 1))
        return {"id": again.id, "duplicate": dup(again)}
    return n


@fenced_task(lock="sjob:{customer}:{n}", unique="sjob:{customer}", unique_for=2, ttl=5, bind=True)
def for_two_seconds(self: Any, customer: int, n: int = 0) -> Any:
    ran.append((self.request.id, n))
    return n


@fenced_task(lock="fjob:{customer}", unique="fjob:{customer}", unique_for="succeeded", ttl=5,
             bind=True, max_retries=1)
def flaky(self: Any, customer: int, *, fail: str = "") -> Any:
    ran.append((self.request.id, self.request.retries))
    if fail == "retry":
        raise self.retry(exc=ValueError("again"), countdown=60)
    if fail == "for good":
        raise ValueError("failed for good")
    return "ok"


@fenced_task(lock="plain:{customer}:{n}", ttl=5)
def not_unique(customer: int, n: int = 0) -> int:
    return n


@pytest.fixture(autouse=True)
def _forget_runs() -> Iterator[None]:
    ran.clear()
    yield
    ran.clear()


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[Any]:
    """A filesystem broker in a folder of the test's own: its messages are files."""
    folder = tmp_path / "broker"
    folder.mkdir()
    with app.connection_for_write(
        "filesystem://", transport_options={"data_folder_in": str(folder), "data_folder_out": str(folder)}
    ) as conn:
        conn.folder = folder
        yield conn


def sent(conn: Any) -> int:
    return len(list(conn.folder.iterdir()))


def enqueue(task: Any, conn: Any, *args: Any, **options: Any) -> Any:
    return task.apply_async(args, connection=conn, queue="unique-tests", **options)


def run_message(task: Any, result: Any, *args: Any, **kwargs: Any) -> Any:
    """Run the message ``result`` names here, as a worker would."""
    return task.apply(args, kwargs, task_id=result.id).get(propagate=False)


# --- the enqueue ------------------------------------------------------------------


def test_a_duplicate_enqueue_sends_nothing_and_returns_the_holders_id(broker: Any) -> None:
    first = enqueue(until_succeeded, broker, 7)
    second = enqueue(until_succeeded, broker, 7, 1)
    other = enqueue(until_succeeded, broker, 8)

    assert first.duplicate is False and other.duplicate is False
    assert dup(second) is True
    assert second.id == first.id
    assert other.id != first.id
    assert sent(broker) == 2
    assert unique.holder_of("ujob:7") == first.id


def test_without_unique_every_enqueue_is_sent(broker: Any) -> None:
    """The control: the same enqueues of a task that declares no uniqueness."""
    ids = {enqueue(not_unique, broker, 7).id, enqueue(not_unique, broker, 7).id}
    assert len(ids) == 2
    assert sent(broker) == 2


def test_a_message_that_could_not_be_sent_gives_its_claim_up(broker: Any) -> None:
    with pytest.raises(TypeError):
        until_succeeded.apply_async((7,), connection=broker, queue="unique-tests", expires=object())
    assert unique.holder_of("ujob:7") is None
    assert enqueue(until_succeeded, broker, 7).duplicate is False


# --- the worker's check -----------------------------------------------------------


def test_a_duplicate_message_that_reaches_a_worker_does_not_run(broker: Any) -> None:
    holder = enqueue(until_succeeded, broker, 7)
    seen: list[dict[str, Any]] = []

    def on_skipped(sender: Any, **kwargs: Any) -> None:
        seen.append(kwargs)

    labels = {"task": until_succeeded.name, "reason": "duplicate"}
    counted = REGISTRY.get_sample_value("coordination_jobs_deduplicated_total", labels) or 0.0
    signals.task_skipped.connect(on_skipped)
    try:
        # A message sent around the check: another task id, the same key.
        outcome = until_succeeded.apply((7, 1), task_id="sent-around-the-check").get()
    finally:
        signals.task_skipped.disconnect(on_skipped)
    assert REGISTRY.get_sample_value("coordination_jobs_deduplicated_total", labels) == counted + 1

    assert outcome["coordination"] == "skipped"
    assert outcome["reason"] == "duplicate"
    assert outcome["existing"] == holder.id
    assert ran == []
    assert [kwargs["reason"] for kwargs in seen] == ["duplicate"]
    assert JobTally.objects.get(task=until_succeeded.name, outcome="skipped").count == 1
    # The holder's own message runs, and ends the claim when it succeeded.
    assert run_message(until_succeeded, holder, 7) == 0
    assert ran == [(holder.id, 0)]
    assert unique.holder_of("ujob:7") is None


# --- the scopes -------------------------------------------------------------------


def test_until_succeeded_holds_while_queued_and_running_and_ends_on_success(broker: Any) -> None:
    holder = enqueue(until_succeeded, broker, 7)
    again = run_message(until_succeeded, holder, 7, enqueue_again=True)

    assert again == {"id": holder.id, "duplicate": True}  # enqueued while it ran
    assert unique.holder_of("ujob:7") is None
    assert enqueue(until_succeeded, broker, 7).duplicate is False


def test_until_succeeded_holds_across_a_retry_and_ends_when_it_failed_for_good(broker: Any) -> None:
    holder = enqueue(flaky, broker, 7)
    with pytest.raises(Retry):
        flaky.apply((7,), {"fail": "retry"}, task_id=holder.id, throw=True)
    assert unique.holder_of("fjob:7") == holder.id  # the retry waits with the key
    assert enqueue(flaky, broker, 7).id == holder.id

    failed = flaky.apply((7,), {"fail": "for good"}, task_id=holder.id)
    assert failed.failed()
    assert unique.holder_of("fjob:7") is None
    assert enqueue(flaky, broker, 7).duplicate is False


def test_while_queued_ends_when_its_message_starts(broker: Any) -> None:
    holder = enqueue(while_queued, broker, 7)
    assert enqueue(while_queued, broker, 7).id == holder.id
    assert while_queued.apply((7, 1), task_id="around-the-check").get()["reason"] == "duplicate"

    assert run_message(while_queued, holder, 7) == 0
    assert unique.holder_of("qjob:7") is None
    assert enqueue(while_queued, broker, 7).duplicate is False


def test_while_running_holds_only_while_an_execution_runs(broker: Any) -> None:
    first, second = enqueue(while_running, broker, 7), enqueue(while_running, broker, 7)
    assert not dup(first) and not dup(second) and first.id != second.id  # queued twice

    nested = run_message(while_running, first, 7, nested=True)

    assert nested == {"id": first.id, "duplicate": True}
    assert unique.holder_of("rjob:7") is None
    assert run_message(while_running, second, 7) == 0  # the first ended: the second runs


def test_for_n_seconds_holds_from_the_enqueue_by_the_database_clock(broker: Any) -> None:
    holder = enqueue(for_two_seconds, broker, 7)
    assert run_message(for_two_seconds, holder, 7) == 0  # its own message runs
    assert enqueue(for_two_seconds, broker, 7).id == holder.id  # done, but within 2 s
    assert for_two_seconds.apply((7, 1), task_id="another").get()["reason"] == "duplicate"

    claim = UniqueClaim.objects.get(key="sjob:7")
    assert claim.holds_until is not None
    wait_until_database_time_passes(claim.holds_until)
    assert enqueue(for_two_seconds, broker, 7).duplicate is False


def test_a_running_claim_ends_with_its_lease_when_nothing_ends_it(broker: Any) -> None:
    """A worker killed mid-run: no end_claim, no release; the lease expires."""
    holder = enqueue(until_succeeded, broker, 7)
    grant = locks.acquire("ujob:7:0", holder="killed worker", ttl=1.0)
    assert unique.claim_start(
        "ujob:7", task=until_succeeded.name, task_id=holder.id, scope="succeeded", grant=grant
    ) is None
    assert enqueue(until_succeeded, broker, 7).id == holder.id

    wait_until_database_time_passes(grant.expires_at)

    assert unique.holder_of("ujob:7") is None
    assert enqueue(until_succeeded, broker, 7).duplicate is False


def test_a_waiting_claim_ends_after_the_bound(broker: Any, settings: Any) -> None:
    settings.COORDINATION = {"UNIQUE_QUEUED_FOR": 1.0}
    holder = enqueue(while_queued, broker, 7)
    claim = UniqueClaim.objects.get(key="qjob:7")
    assert claim.task_id == holder.id
    assert claim.holds_until - claim.claimed_at <= dt.timedelta(seconds=1.5)
    wait_until_database_time_passes(claim.holds_until)
    assert enqueue(while_queued, broker, 7).duplicate is False


def test_prune_deletes_only_claims_that_ended_long_enough_ago(broker: Any) -> None:
    held = enqueue(until_succeeded, broker, 7)
    ended = enqueue(until_succeeded, broker, 8)
    assert run_message(until_succeeded, ended, 8) == 0
    UniqueClaim.objects.create(key="ujob:9", task=until_succeeded.name, task_id="x", scope="queued")

    assert unique.prune(older_than=0.0) == 1  # ujob:9: never held; ujob:8's row was deleted
    assert unique.prune(older_than=0.0) == 0
    assert unique.holder_of("ujob:7") == held.id
    assert set(UniqueClaim.objects.values_list("key", flat=True)) == {"ujob:7"}


# --- the declaration --------------------------------------------------------------


def test_declaring_a_unique_task_checks_its_template_and_scope() -> None:
    with pytest.raises(InvalidInput, match="customr"):
        fenced_task(lock="x:{customer}", unique="x:{customr}")(lambda customer: None)
    for wrong in ("forever", 0, -5, True, None):
        with pytest.raises(InvalidInput, match="unique_for"):
            fenced_task(lock="x:{customer}", unique="x:{customer}", unique_for=wrong)(lambda customer: None)
