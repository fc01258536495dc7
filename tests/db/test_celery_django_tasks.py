"""The fenced_task twin for Django's ``django.tasks``, on the immediate backend.

Django 5.2 (the LTS leg) has no ``django.tasks``: there these tests are skipped
and the module only has to import and refuse clearly.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from decimal import Decimal
from typing import Any

import pytest
from django.core.exceptions import ImproperlyConfigured

from coordination import aio, locks, signals
from coordination.contrib import tasks as contrib_tasks
from coordination.exceptions import InvalidInput
from coordination.models import Grant, GrantEnd, Lock
from project.demo.models import Account
from tests.support.factories import AccountFactory

try:
    import django.tasks  # noqa: F401
except ImportError:
    HAS_DJANGO_TASKS = False
else:
    HAS_DJANGO_TASKS = True

needs_django_tasks = pytest.mark.skipif(not HAS_DJANGO_TASKS, reason="django.tasks is Django 6.0+")

pytestmark = pytest.mark.django_db(transaction=True)

#: The kept-alive tasks' lease: the shortest one the docs call safe with the
#: keep-alive, so a stall of a loaded machine never decides these tests.
TTL = 5.0
#: A body that outlives its lease as first granted, by more than scheduling slack.
HOLD = TTL + 1.5


def test_without_django_tasks_the_decorator_refuses_clearly() -> None:
    if HAS_DJANGO_TASKS:
        pytest.skip("this Django has django.tasks")
    with pytest.raises(ImproperlyConfigured, match=r"django\.tasks"):
        contrib_tasks.fenced_task(lock="account:{account_id}")


if HAS_DJANGO_TASKS:
    from django.tasks import TaskResultStatus

    @contrib_tasks.fenced_task(lock="account:{account_id}", ttl=TTL)
    def settle(account_id: int, amount: str, hold: float = 0.0) -> dict[str, Any]:
        grant = locks.current_grant()
        assert grant is not None
        account = Account.objects.get(pk=account_id)
        time.sleep(hold)  # longer than the lease: the keep-alive renews it
        Account.objects.filter(pk=account_id).fenced_update(balance=account.balance + Decimal(amount))
        return {"token": grant.token, "key": grant.key}

    @contrib_tasks.fenced_task(lock="account:{account_id}", ttl=TTL)
    async def settle_async(account_id: int, amount: str, hold: float = 0.0) -> dict[str, Any]:
        grant = locks.current_grant()
        assert grant is not None
        account = await Account.objects.aget(pk=account_id)
        await asyncio.sleep(hold)  # longer than the lease: the async keep-alive renews it
        await Account.objects.filter(pk=account_id).afenced_update(
            balance=account.balance + Decimal(amount)
        )
        return {"token": grant.token, "key": grant.key}

    @contrib_tasks.fenced_task(lock="account:{account_id}", ttl=5, on_busy="skip")
    def settle_or_skip(account_id: int) -> str:
        return "ran"

    @contrib_tasks.fenced_task(lock="account:{account_id}", ttl=5)
    def settle_or_fail(account_id: int) -> str:
        return "ran"

    @contrib_tasks.fenced_task(lock="account:{account_id}", ttl=5, takes_context=True)
    def settle_with_context(context: Any, account_id: int) -> dict[str, Any]:
        grant = locks.current_grant()
        assert grant is not None
        return {"holder": grant.holder, "attempt": context.attempt}


@needs_django_tasks
def test_each_run_takes_a_new_grant_that_fenced_writes_use_and_releases_it() -> None:
    account = AccountFactory(balance=Decimal("10.00"))

    first = settle.enqueue(account.pk, "5.00")
    second = settle.enqueue(account.pk, "1.00", hold=HOLD)

    assert first.status == TaskResultStatus.SUCCESSFUL, first.errors
    assert second.status == TaskResultStatus.SUCCESSFUL, second.errors
    assert first.return_value == {"token": 1, "key": f"account:{account.pk}"}
    assert second.return_value["token"] == 2
    grants = list(Grant.objects.filter(lock__key=f"account:{account.pk}").order_by("token"))
    assert [g.end_reason for g in grants] == [GrantEnd.RELEASED, GrantEnd.RELEASED]
    # The run outlived its lease only because the keep-alive renewed it.
    assert (grants[1].ended_at - grants[1].acquired_at).total_seconds() >= HOLD
    refreshed = Account.objects.get(pk=account.pk)
    assert (refreshed.balance, refreshed.fence) == (Decimal("16.00"), 2)
    assert locks.current_grant() is None


@needs_django_tasks
def test_busy_lock_skips_with_a_result_that_says_so_or_fails_with_lock_held() -> None:
    account = AccountFactory()
    skipped: list[str] = []

    def on_skipped(sender: Any, reason: str, **kwargs: Any) -> None:
        skipped.append(reason)

    signals.task_skipped.connect(on_skipped)
    holder = locks.acquire(f"account:{account.pk}", holder="someone", ttl=30)
    try:
        skipped_run = settle_or_skip.enqueue(account.pk)
        failed_run = settle_or_fail.enqueue(account.pk)
    finally:
        signals.task_skipped.disconnect(on_skipped)
        locks.release(holder)

    assert skipped_run.status == TaskResultStatus.SUCCESSFUL
    assert skipped_run.return_value["coordination"] == "skipped"
    assert skipped_run.return_value["reason"] == "lock_held"
    assert skipped == ["lock_held"]
    assert failed_run.status == TaskResultStatus.FAILED
    assert failed_run.errors[0].exception_class_path == "coordination.exceptions.LockHeld"
    assert Lock.objects.get(key=f"account:{account.pk}").holder == ""


@needs_django_tasks
def test_context_argument_is_not_part_of_the_key_and_names_the_holder() -> None:
    account = AccountFactory()
    result = settle_with_context.enqueue(account.pk)

    assert result.status == TaskResultStatus.SUCCESSFUL, result.errors
    assert result.id in result.return_value["holder"]
    assert result.return_value["attempt"] == 1


@needs_django_tasks
def test_an_async_task_body_holds_its_grant_while_awaited_and_releases_it() -> None:
    account = AccountFactory(balance=Decimal("10.00"))
    try:
        result = settle_async.enqueue(account.pk, "2.50", hold=HOLD)
    finally:
        aio.close_threads()

    assert result.status == TaskResultStatus.SUCCESSFUL, result.errors
    assert result.return_value == {"token": 1, "key": f"account:{account.pk}"}
    grant = Grant.objects.get(lock__key=f"account:{account.pk}")
    assert grant.end_reason == GrantEnd.RELEASED
    # The body outlived its lease only because the async keep-alive renewed it.
    assert (grant.ended_at - grant.acquired_at).total_seconds() >= HOLD
    refreshed = Account.objects.get(pk=account.pk)
    assert (refreshed.balance, refreshed.fence) == (Decimal("12.50"), 1)


def test_an_async_task_function_stays_a_coroutine_function() -> None:
    async def fetch(account_id: int) -> None: ...

    wrapped = contrib_tasks.fenced(lock="account:{account_id}")(fetch)
    assert inspect.iscoroutinefunction(wrapped)
    with pytest.raises(InvalidInput):
        contrib_tasks.fenced(lock=7)(fetch)  # type: ignore[arg-type]
