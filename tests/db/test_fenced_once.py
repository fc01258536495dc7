"""``once=True``: a fenced execution whose task id completed is not run again, in process.

Celery's ``task.apply(task_id=...)`` runs the body here with a message's id, as
a redelivery of that id would; the ``django.tasks`` building block
(``contrib.tasks.fenced``) is called with a context carrying a result id. The
same on real workers (killed before the ack, sent twice, a visibility timeout
shorter than the body) is in tests/processes/test_once_processes.py.
"""

from __future__ import annotations

import asyncio
import datetime as dt
from decimal import Decimal
from types import SimpleNamespace
from typing import Any

import pytest
from django.db.models import F

from coordination import locks, pruning, signals
from coordination.contrib import tasks as contrib_tasks
from coordination.contrib.celery import fenced_task
from coordination.contrib.execution import AsyncFencedExecution
from coordination.contrib.once import once_key
from coordination.exceptions import InvalidInput
from coordination.models import IdempotencyRecord, JobTally, Lock
from project.demo.models import Account
from tests.support.factories import AccountFactory
from tests.support.waiting import wait_until_database_time_passes

pytestmark = pytest.mark.django_db(transaction=True)

ran: list[str] = []


def _deposit(account_id: int, amount: str) -> dict[str, Any]:
    grant = locks.current_grant()
    assert grant is not None
    ran.append(amount)
    Account.objects.filter(pk=account_id).fenced_update(balance=F("balance") + Decimal(amount))
    if amount == "fail":
        raise ValueError("after the write")
    return {"token": grant.token, "amount": Decimal(amount)}


@fenced_task(lock="account:{account_id}", ttl=5, once=True)
def deposit_once(account_id: int, amount: str) -> dict[str, Any]:
    return _deposit(account_id, amount)


@fenced_task(lock="account:{account_id}", ttl=5)
def deposit_every_time(account_id: int, amount: str) -> dict[str, Any]:
    return _deposit(account_id, amount)


@fenced_task(lock="account:{account_id}", ttl=5, once=True)
def returns_none(account_id: int) -> None:
    ran.append("none")


@fenced_task(lock="account:{account_id}", ttl=5, once=True, bind=True, max_retries=1)
def retries_once(self: Any, account_id: int) -> str:
    Account.objects.filter(pk=account_id).fenced_update(balance=F("balance") + 1)
    if self.request.retries == 0:
        raise self.retry(countdown=0)
    return "second"


@pytest.fixture(autouse=True)
def _clean() -> None:
    ran.clear()


def balance(account: Account) -> Decimal:
    return Account.objects.get(pk=account.pk).balance


@pytest.mark.parametrize("once", [True, False], ids=["once", "negative-control"])
def test_a_second_message_of_a_completed_task_id_returns_the_stored_result_unrun(once: bool) -> None:
    task = deposit_once if once else deposit_every_time
    account = AccountFactory(balance=Decimal("10.00"))
    skipped: list[dict[str, Any]] = []

    def on_skipped(**kwargs: Any) -> None:
        skipped.append(kwargs)

    signals.task_skipped.connect(on_skipped)
    try:
        first = task.apply((account.pk, "5"), task_id="one-id").get()
        second = task.apply((account.pk, "5"), task_id="one-id").get()
    finally:
        signals.task_skipped.disconnect(on_skipped)

    assert first == {"token": 1, "amount": Decimal("5")}
    if once:
        assert ran == ["5"] and balance(account) == Decimal("15.00")
        assert second == first  # the stored result, with its types
        assert [s["reason"] for s in skipped] == ["completed"]
        assert JobTally.objects.get(task=task.name, outcome="finished").count == 1
        # No grant taken for the copy: the check comes before the acquire.
        assert Lock.objects.get(key=f"account:{account.pk}").token == 1
    else:
        assert ran == ["5", "5"] and balance(account) == Decimal("20.00")


def test_another_task_id_runs_and_a_call_without_an_id_always_runs() -> None:
    account = AccountFactory(balance=Decimal("10.00"))
    deposit_once.apply((account.pk, "1"), task_id="a").get()
    deposit_once.apply((account.pk, "1"), task_id="b").get()
    deposit_once(account.pk, "1")
    deposit_once(account.pk, "1")
    assert ran == ["1"] * 4
    assert IdempotencyRecord.objects.filter(key__startswith="task-once:").count() == 2


def test_an_attempt_that_raised_stored_nothing_and_its_writes_rolled_back() -> None:
    account = AccountFactory(balance=Decimal("10.00"))
    with pytest.raises(Exception):  # noqa: B017 - the body's own error, whatever its wrapping
        deposit_once.apply((account.pk, "fail"), task_id="failing", throw=True).get()
    assert balance(account) == Decimal("10.00")
    assert not IdempotencyRecord.objects.filter(key=once_key(deposit_once.name, "failing")).exists()
    deposit_once.apply((account.pk, "2"), task_id="failing").get()
    assert ran == ["fail", "2"] and balance(account) == Decimal("12.00")


def test_a_stored_none_is_a_result_too() -> None:
    account = AccountFactory()
    assert returns_none.apply((account.pk,), task_id="none").get() is None
    assert returns_none.apply((account.pk,), task_id="none").get() is None
    assert ran == ["none"]


def test_a_retry_from_the_body_rolls_back_its_write_and_releases_the_lease() -> None:
    account = AccountFactory(balance=Decimal("10.00"))
    assert retries_once.apply((account.pk,), task_id="retried").get() == "second"
    assert balance(account) == Decimal("11.00")  # the first attempt's write rolled back
    assert Lock.objects.get(key=f"account:{account.pk}").holder == ""


def test_the_key_keeps_to_the_records_column() -> None:
    assert once_key("t", "id") == "task-once:t:id"
    assert len(once_key("t" * 300, "id")) <= 255
    assert once_key("t" * 300, "id") != once_key("t" * 300, "other")


def test_the_django_tasks_wrapper_runs_a_result_id_once() -> None:
    account = AccountFactory(balance=Decimal("10.00"))

    @contrib_tasks.fenced(lock="account:{account_id}", ttl=5, takes_context=True, once=True)
    def settle(context: Any, account_id: int, amount: str) -> dict[str, Any]:
        return _deposit(account_id, amount)

    context = SimpleNamespace(task_result=SimpleNamespace(id="result-1"), attempt=1)
    first = settle(context, account.pk, "3")
    assert settle(context, account.pk, "3") == first
    assert ran == ["3"] and balance(account) == Decimal("13.00")


def test_once_is_refused_where_it_cannot_hold() -> None:
    with pytest.raises(InvalidInput, match="takes_context"):
        contrib_tasks.fenced(lock="account:{account_id}", once=True)(lambda account_id: None)

    async def body(context: Any, account_id: int) -> None:
        return None

    with pytest.raises(InvalidInput, match="synchronous"):
        contrib_tasks.fenced(lock="account:{account_id}", takes_context=True, once=True)(body)
    execution = AsyncFencedExecution("k", holder="h", name="t", task_id="i", once=True)
    with pytest.raises(InvalidInput, match="synchronous"):
        asyncio.run(execution.run(lambda: asyncio.sleep(0)))


def test_the_records_are_pruned_with_the_history_and_a_pruned_task_id_runs_again() -> None:
    account = AccountFactory(balance=Decimal("10.00"))
    deposit_once.apply((account.pk, "1"), task_id="pruned").get()
    key = once_key(deposit_once.name, "pruned")
    created = IdempotencyRecord.objects.get(key=key).created_at
    wait_until_database_time_passes(created)

    counts = pruning.prune(dt.timedelta(0))

    assert counts["idempotency records"] >= 1
    assert not IdempotencyRecord.objects.filter(key=key).exists()
    deposit_once.apply((account.pk, "1"), task_id="pruned").get()
    assert ran == ["1", "1"]
