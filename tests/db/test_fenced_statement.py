"""fenced_update's one statement: Django's update() of the rows asked for, narrowed
by the watermark condition (a lookup compiled by Django's compiler), refused
exactly like update(), on each Django this app supports."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from decimal import Decimal
from functools import partial
from typing import Any
from unittest import mock

import pytest
from django.core.exceptions import ValidationError
from django.db import IntegrityError, connection, transaction
from django.db.models import F, Q
from django.db.models.sql import UpdateQuery
from django.test.utils import CaptureQueriesContext

from coordination import locks
from coordination.exceptions import CoordinationError, DuplicateWrite, StaleToken, WrongLock
from coordination.fenced.conditions import Admits, NotAbove
from coordination.fenced.keys import lock_binding
from coordination.fenced.statement import fenced_sql
from coordination.leases import Lease
from coordination.models import Rejection, RejectionReason
from project.demo.models import Account
from tests.support.factories import AccountFactory

pytestmark = pytest.mark.django_db


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


def test_a_write_is_one_update_with_the_watermark_condition_and_the_binding() -> None:
    account = AccountFactory(balance=1)
    grant = locks.acquire(f"account:{account.pk}", holder="a", ttl=30)

    with CaptureQueriesContext(connection) as queries:
        written = Account.objects.filter(pk=account.pk).fenced_update(grant, balance=2)

    assert written == 1
    (sql,) = updates(queries)
    # filter(pk=X) needs no query of its rows.
    assert not [q for q in queries.captured_queries if q["sql"].startswith("SELECT")]
    quote = connection.ops.quote_name
    assert f"({quote('demo_account')}.{quote('fence')}, " in sql
    assert f"{quote('fence_step')}) < ({grant.token}, 1)" in sql
    assert sql.count(f"{quote('demo_account')}.{quote('id')} = {account.pk}") == 2  # asked, bound
    assert row(account)[:3] == (grant.token, 1, 2)


def test_a_filter_not_pinned_to_the_key_asks_once_for_unguarded_rows() -> None:
    account = AccountFactory(balance=1)
    grant = locks.acquire(f"account:{account.pk}", holder="a", ttl=5)

    with CaptureQueriesContext(connection) as queries:
        Account.objects.filter(pk__in=[account.pk]).fenced_update(grant, balance=2)

    selects = [q["sql"] for q in queries.captured_queries if q["sql"].startswith("SELECT")]
    assert len(selects) == 1 and len(updates(queries)) == 1


def test_stale_token_and_duplicate_step_are_refused_by_the_statement() -> None:
    account, old, new = superseded_account()
    Account.objects.filter(pk=account.pk).fenced_update(new, step=5, balance=5)

    with CaptureQueriesContext(connection) as queries, pytest.raises(StaleToken):
        Account.objects.filter(pk=account.pk).fenced_update(old, step=9, balance=9)
    assert len(updates(queries)) == 1  # the refused UPDATE, nothing written before it
    # Rules 4-5 of docs/rules.md: the same token writes only a later step; the
    # same step again is a duplicate (a comparison relaxed to <= would accept it).
    with pytest.raises(DuplicateWrite):
        Account.objects.filter(pk=account.pk).fenced_update(new, step=5, balance=6)
    with pytest.raises(DuplicateWrite):
        Account.objects.filter(pk=account.pk).fenced_update(new, step=4, balance=4)

    assert row(account)[:3] == (new.token, 5, 5)
    assert list(Rejection.objects.order_by("pk").values_list("reason", "token", "step")) == [
        (RejectionReason.STALE, old.token, 9),
        (RejectionReason.DUPLICATE, new.token, 5),
        (RejectionReason.DUPLICATE, new.token, 4),
    ]


def test_other_fields_and_their_order_write_the_columns_named() -> None:
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


def test_another_filter_is_kept_beside_the_binding() -> None:
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
    # All or nothing: bob's row in the queryset refuses the whole write.
    with pytest.raises(WrongLock):
        Account.objects.all().fenced_update(grant, balance=9)

    assert (row(ann)[2], row(bob)[2]) == (8, 1)


@pytest.mark.parametrize("template", ["owner:{owner}", "owner:{owner}:{pk}", "account:{pk}"])
def test_each_lock_key_binding_narrows_the_statement(template: str) -> None:
    ann, bob = AccountFactory(owner="ann", balance=1), AccountFactory(owner="bob", balance=1)
    grant = locks.acquire(template.format(owner="ann", pk=ann.pk), holder="a", ttl=30)

    with mock.patch.object(Account, "fence_lock", template):
        Account.objects.filter(pk=ann.pk).fenced_update(grant, balance=5)
        with pytest.raises(WrongLock):
            Account.objects.filter(pk=bob.pk).fenced_update(grant, balance=5)

    assert (row(ann)[2], row(bob)[2]) == (5, 1)


def test_expressions_as_values_are_written_by_the_same_fenced_statement() -> None:
    account, old, grant = superseded_account()

    with CaptureQueriesContext(connection) as queries:
        Account.objects.filter(pk=account.pk).fenced_update(grant, balance=F("balance") + 10)
    with pytest.raises(StaleToken):
        Account.objects.filter(pk=account.pk).fenced_update(old, balance=F("balance") + 10)

    (sql,) = updates(queries)
    assert f"{connection.ops.quote_name('fence_step')}) < (" in sql
    assert row(account)[:3] == (grant.token, 1, 11)


def test_an_error_while_writing_marks_the_atomic_block_for_rollback_as_update_does() -> None:
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
    assert row(account)[:3] == (0, 0, 1)


def test_the_watermark_conditions_compile_through_django_as_row_comparisons() -> None:
    quote = connection.ops.quote_name
    watermark = f"({quote('demo_account')}.{quote('fence')}, {quote('demo_account')}.{quote('fence_step')})"

    for condition, operator in ((Admits(7, 3), "<"), (NotAbove(7, 3), "<=")):
        sql, params = Account.objects.filter(condition).order_by().query.sql_with_params()
        # Not wrapped in "= true" / "= 1": the lookup is the WHERE term itself.
        assert sql.endswith(f"WHERE {watermark} {operator} (%s, %s)")
        assert params == (7, 3)


def test_the_watermark_rule_is_strictly_below_for_writes_and_not_above_for_saves() -> None:
    account = AccountFactory(balance=1)
    Account.objects.filter(pk=account.pk).update(fence=7, fence_step=3)
    rows = Account.objects.filter(pk=account.pk)

    admitted = [
        (token, step)
        for token, step in ((6, 9), (7, 2), (7, 3), (7, 4), (8, 0))
        if rows.filter(Admits(token, step)).exists()
    ]
    not_above = [
        (token, step)
        for token, step in ((6, 9), (7, 2), (7, 3), (7, 4), (8, 0))
        if rows.filter(NotAbove(token, step)).exists()
    ]

    assert admitted == [(7, 4), (8, 0)]
    assert not_above == [(7, 3), (7, 4), (8, 0)]


def test_the_condition_follows_its_table_into_a_subquery() -> None:
    ann = AccountFactory(owner="ann", balance=1)
    grant = locks.acquire(f"account:{ann.pk}", holder="a", ttl=30)
    inner = Account.objects.filter(Admits(grant.token, 1)).values("pk")

    # Relabelled as an inner query: its columns are the subquery's table's.
    written = Account.objects.filter(pk__in=inner).fenced_update(grant, balance=3)

    assert written == 1
    assert row(ann)[:3] == (grant.token, 1, 3)


# The shapes of fenced_update() the compiled statement (coordination.fenced.statement)
# is checked against Django's own update() of the public path: (id, the fence_lock
# template, the rows asked for, the values, whether the statement covers it: None
# if that depends on the database).
def _shapes(ann: Account) -> list[tuple[str, str, Any, dict[str, Any], bool | None]]:
    rows = Account.objects
    return [
        ("plain filter", "account:{pk}", rows.filter(owner=ann.owner), {"balance": 5}, True),
        ("pk equal to the binding", "account:{pk}", rows.filter(pk=ann.pk), {"balance": 5}, True),
        ("every row", "account:{pk}", rows.all(), {"balance": 5, "owner": "ann"}, True),
        ("or and exclude", "account:{pk}",
         rows.filter(Q(owner=ann.owner) | Q(balance__gt=3)).exclude(owner="bob"), {"balance": 5}, True),
        ("no filter, several key fields", "owner:{owner}:{pk}", rows.all(), {"balance": 5}, True),
        ("a char binding", "owner:{owner}", rows.filter(pk__in=[ann.pk]), {"balance": 5}, True),
        # Covered where the lookup compiles as "column operator placeholder" (SQLite's LIKE).
        ("a binding through a lookup", "owner:{owner__iexact}", rows.filter(pk=ann.pk),
         {"balance": 5}, None),
        ("F() as a value", "account:{pk}", rows.filter(pk=ann.pk),
         {"balance": F("balance") + 1}, False),
        ("None as a value", "account:{pk}", rows.filter(pk=ann.pk), {"balance": None}, False),
        ("a subquery", "account:{pk}",
         rows.filter(pk__in=rows.filter(owner=ann.owner).values("pk")), {"balance": 5}, True),
        ("ordered", "account:{pk}", rows.filter(pk=ann.pk).order_by("owner"), {"balance": 5},
         False),
        ("annotated", "account:{pk}", rows.annotate(twice=F("balance") * 2).filter(twice__gt=0),
         {"balance": 5}, False),
        ("sliced", "account:{pk}", rows.filter(pk=ann.pk)[:1], {"balance": 5}, False),
        ("nothing asked for", "account:{pk}", rows.none(), {"balance": 5}, False),
    ]


def _compare_with_the_public_path(atomic: bool) -> None:
    # A row of its own for each shape, so that each fenced_update() is accepted:
    # a refusal's record would outlive the test's transaction. Alone in the table:
    # a queryset holding a row of another key is refused whole.
    for number in range(len(_shapes(AccountFactory.build(pk=0)))):
        Account.objects.all().delete()
        ann = AccountFactory(owner=f"ann-{number}", balance=1)
        _compare_shape(atomic, ann, _shapes(ann)[number])
    assert not Rejection.objects.exists()


def _compare_shape(
    atomic: bool, ann: Account, case: tuple[str, str, Any, dict[str, Any], bool | None]
) -> None:
    step = 1
    shape, template, rows, values, covered = case
    key = template.replace("__iexact", "").format(owner=ann.owner, pk=ann.pk)
    grant = locks.acquire(key, holder="a", ttl=30)
    with mock.patch.object(Account, "fence_lock", template):
        binding = lock_binding(Account, key)
        assert binding is not None
        compiled = fenced_sql(rows, "default", grant.token, step, binding, values)
        assert covered is None or (compiled is not None) == covered, shape
        if compiled is not None:
            # The very SQL and parameters Django's update() compiles for the public path.
            query = rows.filter(Admits(grant.token, step), **binding).query.chain(UpdateQuery)
            query.add_update_values({"fence": grant.token, "fence_step": step, **values})
            sql, params = query.get_compiler("default").as_sql()
            assert compiled == (sql, list(params)), shape
        sent = [
            _sent(atomic, partial(rows.fenced_update, grant, step=step, **values)),
            _sent(atomic, partial(_public_path, rows, grant.token, step, binding, values)),
        ]
        # Sent by fenced_update() as by the public path (which writes nothing
        # after it: the same step again is not admitted).
        assert sent[0] == sent[1], shape
        # MySQLdb logs a statement the server refused (NULL into NOT NULL) as "None".
        unlogged = {"None as a value"} if connection.vendor == "mysql" else set()
        assert (sent[0] == []) == (shape in {"sliced", "nothing asked for", *unlogged}), shape
    locks.release(grant)


def _public_path(
    rows: Any, token: int, step: int, binding: dict[str, str], values: dict[str, Any]
) -> int:
    """The one write path of a fenced write, as coordination.fenced.queryset spells it."""
    written: int = rows.filter(Admits(token, step), **binding).update(
        fence=token, fence_step=step, **values
    )
    return written


def _sent(atomic: bool, write: Callable[[], object]) -> list[str]:
    """The first UPDATE ``write`` sends, whether it writes, is refused or raises."""
    with CaptureQueriesContext(connection) as queries:
        try:
            with transaction.atomic() if atomic else contextlib.nullcontext():
                write()
        except (TypeError, IntegrityError, CoordinationError, Account.DoesNotExist):
            pass
    return updates(queries)[:1]


def test_the_compiled_statement_is_the_public_paths_sql_in_a_transaction() -> None:
    _compare_with_the_public_path(atomic=True)


@pytest.mark.django_db(transaction=True)
def test_the_compiled_statement_is_the_public_paths_sql_in_autocommit() -> None:
    _compare_with_the_public_path(atomic=False)
