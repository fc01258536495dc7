"""Unique jobs for the ``django.tasks`` twin: on the immediate backend (the run
happens inside ``enqueue()``: the run's own check decides) and on the dummy
backend (it queues and runs nothing: the enqueue's claim decides). Django 6.0+;
every leg, the embedded default (SQLite) included. No backend shipped with
Django runs a queued task in a worker of its own, so the worker-side check is
shown on the immediate backend only."""

from __future__ import annotations

from typing import Any

import pytest

from coordination import unique
from coordination.exceptions import InvalidInput
from coordination.models import UniqueClaim
from tests.support.waiting import wait_until_database_time_passes

try:
    import django.tasks  # noqa: F401
except ImportError:
    pytest.skip("django.tasks is Django 6.0+", allow_module_level=True)

from coordination.contrib.tasks import fenced_task
from coordination.contrib.unique_tasks import DuplicateTaskResult

pytestmark = pytest.mark.django_db(transaction=True)

DUMMY = {
    "default": {"BACKEND": "django.tasks.backends.immediate.ImmediateBackend"},
    "dummy": {"BACKEND": "django.tasks.backends.dummy.DummyBackend"},
}

ran: list[Any] = []


@fenced_task(lock="dt:{customer}", unique="dtu:{customer}", unique_for=2, ttl=5)
def for_two_seconds(customer: int, n: int = 0) -> int:
    ran.append(n)
    return n


@fenced_task(lock="dtr:{customer}:{n}", unique="dtru:{customer}", unique_for="running", ttl=5)
def while_running(customer: int, n: int = 0) -> Any:
    ran.append(n)
    if n == 0:  # enqueued again while this run holds the key: that run is the duplicate
        return while_running.enqueue(customer, 1).return_value
    return n


@fenced_task(lock="dtc:{customer}", unique="dtcu:{customer}", takes_context=True, ttl=5)
def with_context(context: Any, customer: int) -> str:
    ran.append(customer)
    return str(context.task_result.id)


@pytest.fixture(autouse=True)
def _forget_runs() -> Any:
    ran.clear()
    yield
    ran.clear()


def test_immediate_backend_a_duplicate_run_is_skipped_naming_the_holder() -> None:
    first = for_two_seconds.enqueue(7)
    second = for_two_seconds.enqueue(7, 1)

    assert first.return_value == 0
    assert second.return_value["coordination"] == "skipped"
    assert second.return_value["reason"] == "duplicate"
    assert second.return_value["existing"] == first.id
    assert ran == [0]
    claim = UniqueClaim.objects.get(key="dtu:7")
    wait_until_database_time_passes(claim.holds_until)
    assert for_two_seconds.enqueue(7, 2).return_value == 2


def test_immediate_backend_while_running_holds_only_while_a_run_runs() -> None:
    skipped = while_running.enqueue(7).return_value

    assert skipped["reason"] == "duplicate"
    assert ran == [0]
    assert unique.holder_of("dtru:7") is None
    assert while_running.enqueue(7, 2).return_value == 2


def test_a_task_taking_its_context_still_gets_it() -> None:
    result = with_context.enqueue(7)
    assert result.return_value == result.id
    assert ran == [7]


def test_a_queueing_backend_sends_a_duplicate_enqueue_nothing_and_returns_the_holders_result(
    settings: Any,
) -> None:
    settings.TASKS = DUMMY
    queued = for_two_seconds.using(backend="dummy")
    first = queued.enqueue(7)
    second = queued.enqueue(7, 1)
    other = queued.enqueue(8)

    assert isinstance(second, DuplicateTaskResult) and second.duplicate
    assert second.id == first.id
    assert not isinstance(first, DuplicateTaskResult) and not isinstance(other, DuplicateTaskResult)
    assert [result.id for result in queued.get_backend().results] == [first.id, other.id]
    assert unique.holder_of("dtu:7") == first.id  # the claim names the backend's id
    assert ran == []


def test_declaring_checks_the_unique_template() -> None:
    def settle(customer: int) -> None: ...

    with pytest.raises(InvalidInput, match="customr"):
        fenced_task(lock="x:{customer}", unique="x:{customr}")(settle)
