"""coordination.testing used as a user would use it: opt in, race a task, assert.

Only the plugin's public API is used here (``pytest_plugins`` and the
``fencing_race`` fixture), on tasks written with the app's public API. The
same task body fails the check with a plain ``update()`` and passes it with
``fenced_update()``, on Celery, on ``django.tasks`` and under ``locks.hold``
with a ``fence()`` block.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import pytest

from coordination import locks
from coordination.contrib.celery import fenced_task
from coordination.fencing import fence
from project.demo.models import Account

pytest_plugins = ["coordination.testing"]

try:
    import django.tasks  # noqa: F401
except ImportError:
    HAS_DJANGO_TASKS = False
else:
    HAS_DJANGO_TASKS = True


@fenced_task(lock="account:{account_id}", ttl=30)
def deposit_unfenced(account_id: int, amount: str) -> None:
    account = Account.objects.get(pk=account_id)
    Account.objects.filter(pk=account_id).update(balance=account.balance + Decimal(amount))


@fenced_task(lock="account:{account_id}", ttl=30)
def deposit_fenced(account_id: int, amount: str) -> None:
    account = Account.objects.get(pk=account_id)
    Account.objects.filter(pk=account_id).fenced_update(balance=account.balance + Decimal(amount))


@fenced_task(lock="account:{account_id}", ttl=1, keepalive=False)
def deposit_on_a_short_lease(account_id: int, amount: str) -> None:
    account = Account.objects.get(pk=account_id)
    Account.objects.filter(pk=account_id).fenced_update(balance=account.balance + Decimal(amount))


if HAS_DJANGO_TASKS:
    from coordination.contrib.tasks import fenced_task as django_fenced_task

    @django_fenced_task(lock="account:{account_id}", ttl=30)
    def task_deposit_unfenced(account_id: int, amount: str) -> None:
        account = Account.objects.get(pk=account_id)
        Account.objects.filter(pk=account_id).update(balance=account.balance + Decimal(amount))

    @django_fenced_task(lock="account:{account_id}", ttl=30)
    def task_deposit_fenced(account_id: int, amount: str) -> None:
        account = Account.objects.get(pk=account_id)
        Account.objects.filter(pk=account_id).fenced_update(
            balance=account.balance + Decimal(amount)
        )


def deposit_in_a_fence(account_id: int, amount: str) -> None:
    with locks.hold(f"ledger:{account_id}", holder="ledger", ttl=30):
        account = Account.objects.get(pk=account_id)
        with fence(f"ledger-{account_id}"):
            Account.objects.filter(pk=account_id).update(balance=account.balance + Decimal(amount))


def balance(account: Account) -> Decimal:
    account.refresh_from_db()
    return account.balance


def test_a_celery_task_writing_with_fenced_update_passes(fencing_race: Any) -> None:
    account = Account.objects.create(owner="a", balance=Decimal("10.00"))

    race = fencing_race(deposit_fenced, args=(account.pk, "5.00"))

    race.assert_fenced()
    assert race.b.token == race.a.token + 1
    assert [write.rows for write in race.a.writes] == [0]   # A's late UPDATE changed nothing
    assert type(race.a.error).__name__ in {"StaleToken", "LeaseLost"}
    assert balance(account) == Decimal("15.00")             # B's deposit, once


def test_the_same_task_writing_with_a_plain_update_fails(fencing_race: Any) -> None:
    account = Account.objects.create(owner="a", balance=Decimal("10.00"))

    race = fencing_race(deposit_unfenced, args=(account.pk, "5.00"))

    with pytest.raises(AssertionError, match="not fenced"):
        race.assert_fenced()
    assert [write.accepted for write in race.a.writes] == [True]
    assert balance(account) == Decimal("15.00")             # A overwrote B's deposit: lost update
    assert race.b.accepted and race.a.error is None


def test_a_lease_left_to_expire_by_the_database_clock_is_raced_the_same_way(fencing_race: Any) -> None:
    account = Account.objects.create(owner="a", balance=Decimal("10.00"))

    race = fencing_race(deposit_on_a_short_lease, args=(account.pk, "5.00"), end_lease="expire")

    race.assert_fenced()
    assert type(race.a.error).__name__ == "StaleToken"     # no keep-alive to notice first
    assert balance(account) == Decimal("15.00")


def test_a_fence_block_under_hold_passes(fencing_race: Any) -> None:
    account = Account.objects.create(owner="a", balance=Decimal("10.00"))

    race = fencing_race(deposit_in_a_fence, args=(account.pk, "5.00"))

    race.assert_fenced()
    assert race.a.writes == []   # refused at the fence, before the block's write
    assert balance(account) == Decimal("15.00")


@pytest.mark.skipif(not HAS_DJANGO_TASKS, reason="django.tasks is Django 6.0+")
def test_a_django_task_is_raced_the_same_way(fencing_race: Any) -> None:
    account = Account.objects.create(owner="a", balance=Decimal("10.00"))

    with pytest.raises(AssertionError, match="not fenced"):
        fencing_race(task_deposit_unfenced, args=(account.pk, "1.00")).assert_fenced()
    race = fencing_race(task_deposit_fenced, args=(account.pk, "1.00"))
    race.assert_fenced()
    assert (race.a.token, race.b.token) == (3, 4)
    assert balance(account) == Decimal("12.00")   # 10 + B's 1 (A's lost-update run), + B's 1
