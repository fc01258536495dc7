"""fenced_update's compiled statement: the SQL put together once per shape (model,
database, fields, lock-key binding) and reused, refused exactly like update()."""

from __future__ import annotations

from collections.abc import Iterator
from decimal import Decimal
from types import SimpleNamespace
from typing import Any
from unittest import mock

import pytest
from django.core.exceptions import ValidationError
from django.db import connection, connections, transaction
from django.db.models import F
from django.test.utils import CaptureQueriesContext

from coordination import fencing, locks
from coordination.exceptions import DuplicateWrite, StaleToken, WrongLock
from coordination.leases import Lease
from coordination.models import Rejection, RejectionReason
from project.demo.models import Account
from tests.support.factories import AccountFactory

pytestmark = pytest.mark.django_db


@pytest.fixture
def compiled() -> Iterator[list[int | str | None]]:
    """What each fenced write's compiled statement did: rows written, None where
    it left the write to update(), or "raised"."""
    outcomes: list[int | str | None] = []
    execute = fencing._FencedStatement.execute

    def spy(self: fencing._FencedStatement, *args: Any, **kwargs: Any) -> int | None:
        try:
            written = execute(self, *args, **kwargs)
        except BaseException:
            outcomes.append("raised")
            raise
        outcomes.append(written)
        return written

    with mock.patch.object(fencing._FencedStatement, "execute", spy):
        yield outcomes


def updates(queries: CaptureQueriesContext) -> list[str]:
    return [q["sql"] for q in queries.captured_queries if q["sql"].startswith("UPDATE")]


def row(account: Account) -> tuple[int, int, Decimal, str]:
    stored = Account.objects.get(pk=account.pk)
    return stored.fence, stored.fence_step, stored.balance, stored.owner


def superseded_account() -> tuple[Account, Lease, Lease]:
    """An account whose lock was granted twice: the released first grant and the live one."""
    account = AccountFactory(balance=1)
    key = f"account:{account.pk}"
    old = locks.acquire(key, holder="old", ttl=30)
    locks.release(old)
    return account, old, locks.acquire(key, holder="new", ttl=30)


def test_a_write_filtered_by_its_own_key_is_one_update_with_the_watermark_condition(
    compiled: list[int | str | None],
) -> None:
    account = AccountFactory(balance=1)
    grant = locks.acquire(f"account:{account.pk}", holder="a", ttl=30)

    with CaptureQueriesContext(connection) as queries:
        written = Account.objects.filter(pk=account.pk).fenced_update(grant, balance=2)

    assert (written, compiled) == (1, [1])
    (sql,) = updates(queries)
    # The caller's filter repeats the binding's term: sent once, not twice.
    assert sql.count('"id" = ') == 1
    assert '"fence_step") < (' in sql
    assert row(account)[:3] == (grant.token, 1, 2)


def test_stale_token_and_duplicate_step_are_refused_through_the_compiled_statement(
    compiled: list[int | str | None],
) -> None:
    account, old, new = superseded_account()
    Account.objects.filter(pk=account.pk).fenced_update(new, step=5, balance=5)

    with pytest.raises(StaleToken):
        Account.objects.filter(pk=account.pk).fenced_update(old, step=9, balance=9)
    # Rules 4-5 of docs/rules.md: the same token writes only a later step; the
    # same step again is a duplicate (a comparison relaxed to <= would accept it).
    with pytest.raises(DuplicateWrite):
        Account.objects.filter(pk=account.pk).fenced_update(new, step=5, balance=6)
    with pytest.raises(DuplicateWrite):
        Account.objects.filter(pk=account.pk).fenced_update(new, step=4, balance=4)

    assert compiled == [1, 0, 0, 0]
    assert row(account)[:3] == (new.token, 5, 5)
    assert list(Rejection.objects.order_by("pk").values_list("reason", "token", "step")) == [
        (RejectionReason.STALE, old.token, 9),
        (RejectionReason.DUPLICATE, new.token, 5),
        (RejectionReason.DUPLICATE, new.token, 4),
    ]


def test_other_fields_and_their_order_write_the_columns_named(
    compiled: list[int | str | None],
) -> None:
    account = AccountFactory(owner="ann", balance=1)
    grant = locks.acquire(f"account:{account.pk}", holder="a", ttl=30)
    rows = Account.objects.filter(pk=account.pk)

    rows.fenced_update(grant, balance=2)
    assert row(account) == (grant.token, 1, 2, "ann")
    rows.fenced_update(grant, owner="bob")
    assert row(account) == (grant.token, 2, 2, "bob")
    rows.fenced_update(grant, owner="cid", balance=3)
    assert row(account) == (grant.token, 3, 3, "cid")
    rows.fenced_update(grant, balance=4, owner="dan")
    assert row(account) == (grant.token, 4, 4, "dan")
    assert compiled == [1, 1, 1, 1]


def test_another_filter_is_kept_beside_the_binding(compiled: list[int | str | None]) -> None:
    ann, bob = AccountFactory(owner="ann", balance=1), AccountFactory(owner="bob", balance=1)
    grant = locks.acquire(f"account:{ann.pk}", holder="a", ttl=30)

    # Ann is guarded by the grant but not asked for: nothing is written.
    with pytest.raises(WrongLock):
        Account.objects.filter(owner="bob").fenced_update(grant, balance=7)
    with pytest.raises(Account.DoesNotExist):
        Account.objects.filter(owner="nobody").fenced_update(grant, balance=7)
    with pytest.raises(Account.DoesNotExist):
        Account.objects.filter(pk__in=[]).fenced_update(grant, balance=7)
    assert Account.objects.filter(owner="ann").fenced_update(grant, balance=8) == 1
    assert Account.objects.all().fenced_update(grant, balance=9) == 1

    assert compiled == [0, 0, 0, 1, 1]
    assert (row(ann)[2], row(bob)[2]) == (9, 1)


@pytest.mark.parametrize("template", ["owner:{owner}", "owner:{owner}:{pk}", "account:{pk}"])
def test_each_lock_key_binding_has_its_own_statement(
    template: str, compiled: list[int | str | None]
) -> None:
    ann, bob = AccountFactory(owner="ann", balance=1), AccountFactory(owner="bob", balance=1)
    grant = locks.acquire(template.format(owner="ann", pk=ann.pk), holder="a", ttl=30)

    with mock.patch.object(Account, "fence_lock", template):
        Account.objects.filter(pk=ann.pk).fenced_update(grant, balance=5)
        with pytest.raises(WrongLock):
            Account.objects.filter(pk=bob.pk).fenced_update(grant, balance=5)

    assert compiled == [1, 0]
    assert (row(ann)[2], row(bob)[2]) == (5, 1)


def test_expressions_and_nulls_go_through_update_and_stay_fenced(
    compiled: list[int | str | None],
) -> None:
    account, old, grant = superseded_account()

    Account.objects.filter(pk=account.pk).fenced_update(grant, balance=F("balance") + 10)
    with pytest.raises(StaleToken):
        Account.objects.filter(pk=account.pk).fenced_update(old, balance=F("balance") + 10)

    assert compiled == [None, None]
    assert row(account)[:3] == (grant.token, 1, 11)


def test_an_error_while_writing_marks_the_atomic_block_for_rollback_as_update_does(
    compiled: list[int | str | None],
) -> None:
    account = AccountFactory(balance=1)
    grant = locks.acquire(f"account:{account.pk}", holder="a", ttl=30)

    for write in (
        lambda rows: rows.update(balance="not a number"),
        lambda rows: rows.fenced_update(grant, balance="not a number"),
    ):
        with transaction.atomic():
            with pytest.raises(ValidationError):
                write(Account.objects.filter(pk=account.pk))
            assert connection.needs_rollback
    assert compiled == ["raised"]
    assert row(account)[:3] == (0, 0, 1)


def test_each_database_alias_gets_the_sql_of_its_own_connection() -> None:
    backticks = SimpleNamespace(ops=SimpleNamespace(quote_name=lambda name: f"`{name}`"))
    aliases = {"default": connections["default"], "other": backticks}
    fencing._fenced_statement.cache_clear()
    try:
        with mock.patch.object(fencing, "connections", aliases):
            here = fencing._fenced_statement(
                Account, "default", connection.vendor, ("balance",), ("pk",)
            )
            there = fencing._fenced_statement(Account, "other", "mysql", ("balance",), ("pk",))
    finally:
        fencing._fenced_statement.cache_clear()

    assert here is not None and there is not None
    quote = connection.ops.quote_name
    assert here.head == (
        f"UPDATE {quote('demo_account')} SET {quote('fence')} = %s, "
        f"{quote('fence_step')} = %s, {quote('balance')} = %s WHERE "
    )
    assert there.head == (
        "UPDATE `demo_account` SET `fence` = %s, `fence_step` = %s, `balance` = %s WHERE "
    )
    assert there.admits == (
        "(`demo_account`.`fence`, `demo_account`.`fence_step`) < (%s, %s) "
        "AND `demo_account`.`id` = %s"
    )
