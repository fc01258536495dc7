"""The resource side: fenced_update, fence(), idempotent() and rejections."""

from __future__ import annotations

import datetime as dt
import enum
import uuid
from decimal import Decimal
from unittest import mock

import pytest
from django.db import IntegrityError, connection, transaction

from coordination import fencing, locks
from coordination.exceptions import (
    DuplicateWrite,
    InvalidInput,
    LeaseLost,
    NoGrant,
    StaleToken,
    WrongLock,
)
from coordination.models import Fence, IdempotencyRecord, Rejection, RejectionReason
from project.demo.models import Account
from tests.support.factories import AccountFactory, FenceFactory
from tests.support.waiting import wait_until_database_time_passes

pytestmark = pytest.mark.django_db


def balance(account: Account) -> Decimal:
    return Account.objects.get(pk=account.pk).balance


def take_over(key: str, old: locks.Lease | None = None) -> locks.Lease:
    """The seed's t2..t3: the old lease expires (database clock), a new holder acquires."""
    if old is not None:
        wait_until_database_time_passes(old.expires_at)
    return locks.acquire(key, holder="B", ttl=30)


def test_seed_timeline_late_writer_is_rejected_and_newer_value_stays() -> None:
    account = AccountFactory(balance=Decimal("100.00"))
    key = f"account:{account.pk}"
    a = locks.acquire(key, holder="A", ttl=0.2)  # t0: A gets token n
    # t1..t2: A pauses longer than its lease; the lease expires.
    b = take_over(key, a)  # t3: B gets n+1 and writes
    Account.objects.filter(pk=account.pk).fenced_update(b, balance=Decimal("42.00"))

    with pytest.raises(StaleToken) as caught:  # t4: A resumes and writes with n
        Account.objects.filter(pk=account.pk).fenced_update(a, balance=Decimal("41.00"))

    assert b.token == a.token + 1
    assert caught.value.current_token == b.token
    assert balance(account) == Decimal("42.00")
    rejection = Rejection.objects.get()
    assert (rejection.reason, rejection.token, rejection.watermark_token, rejection.holder) == (
        RejectionReason.STALE, a.token, b.token, "A",
    )
    assert rejection.resource == f"demo.account:{account.pk}"


def test_first_write_is_accepted_because_the_fence_defaults_to_zero() -> None:
    account = AccountFactory()
    assert (account.fence, account.fence_step) == (0, 0)
    grant = locks.acquire(f"account:{account.pk}", holder="a", ttl=5)

    assert Account.objects.filter(pk=account.pk).fenced_update(grant, balance=1) == 1

    stored = Account.objects.get(pk=account.pk)
    assert (stored.fence, stored.fence_step, stored.balance) == (grant.token, 1, 1)


def test_fence_column_is_not_null_with_default_zero_in_the_database() -> None:
    with connection.cursor() as cursor:
        columns = {
            c.name: c for c in connection.introspection.get_table_description(
                cursor, Account._meta.db_table
            )
        }
    assert not columns["fence"].null_ok  # False; 0 from MySQLdb
    assert not columns["fence_step"].null_ok
    with pytest.raises(IntegrityError), transaction.atomic():
        Account.objects.filter(pk=AccountFactory().pk).update(fence=None)


def test_newer_token_is_accepted_and_raises_the_watermark() -> None:
    account = AccountFactory()
    key = f"account:{account.pk}"
    old = locks.acquire(key, holder="a", ttl=5)
    locks.release(old)
    new = locks.acquire(key, holder="b", ttl=5)

    Account.objects.filter(pk=account.pk).fenced_update(old, balance=1)
    Account.objects.filter(pk=account.pk).fenced_update(new, balance=2)

    assert Account.objects.get(pk=account.pk).fence == new.token
    with pytest.raises(StaleToken):
        Account.objects.filter(pk=account.pk).fenced_update(old, balance=3)
    assert balance(account) == 2


def test_same_grant_numbered_steps_are_accepted_in_order() -> None:
    account = AccountFactory()
    grant = locks.acquire(f"account:{account.pk}", holder="a", ttl=5)
    rows = Account.objects.filter(pk=account.pk)

    rows.fenced_update(grant, balance=1)  # step 1
    rows.fenced_update(grant, balance=2)  # step 2
    rows.fenced_update(grant, step=5, balance=5)

    assert Account.objects.get(pk=account.pk).fence_step == 5


def test_same_token_same_step_is_a_duplicate_not_a_second_write() -> None:
    account = AccountFactory(balance=0)
    grant = locks.acquire(f"account:{account.pk}", holder="a", ttl=5)
    rows = Account.objects.filter(pk=account.pk)
    rows.fenced_update(grant, step=3, balance=10)

    for retried_step in (3, 2):
        with pytest.raises(DuplicateWrite) as caught:
            rows.fenced_update(grant, step=retried_step, balance=99)
        assert caught.value.code == "duplicate_write"

    assert balance(account) == 10
    assert set(Rejection.objects.values_list("reason", flat=True)) == {"duplicate_write"}


def test_missing_row_is_does_not_exist_and_no_rejection() -> None:
    grant = locks.acquire("account:999999", holder="a", ttl=5)

    with pytest.raises(Account.DoesNotExist):
        Account.objects.filter(pk=999999).fenced_update(grant, balance=1)
    assert not Rejection.objects.exists()


def test_grant_of_another_key_is_wrong_lock_and_writes_nothing() -> None:
    account = AccountFactory(balance=5)
    other_account = AccountFactory(balance=5)
    foreign = locks.acquire(f"account:{other_account.pk}", holder="a", ttl=5)
    unrelated = locks.acquire("invoice:1", holder="a", ttl=5)

    for grant in (foreign, unrelated):
        with pytest.raises(WrongLock):
            Account.objects.filter(pk=account.pk).fenced_update(grant, balance=1)

    stored = Account.objects.get(pk=account.pk)
    assert (stored.balance, stored.fence) == (5, 0)
    assert Rejection.objects.filter(reason=RejectionReason.WRONG_LOCK).count() == 2


@pytest.mark.parametrize("template", ["owner:{owner}", "owner:{owner}:{pk}", "id:{id}"])
def test_a_key_binding_other_fields_writes_only_the_rows_it_guards(template: str) -> None:
    ann, bob = AccountFactory(owner="ann", balance=1), AccountFactory(owner="bob", balance=1)
    key = template.format(owner="ann", pk=ann.pk, id=ann.pk)
    grant = locks.acquire(key, holder="a", ttl=5)

    with mock.patch.object(Account, "fence_lock", template):
        # All or nothing: a queryset holding a row of another key writes none.
        with pytest.raises(WrongLock, match=rf"rows {bob.pk} of the rows asked for"):
            Account.objects.all().fenced_update(grant, balance=9)
        assert (balance(ann), balance(bob)) == (1, 1)
        written = Account.objects.filter(owner="ann").fenced_update(grant, balance=9)
        with pytest.raises(WrongLock):
            Account.objects.filter(pk=bob.pk).fenced_update(grant, balance=9)

    assert written == 1
    assert (balance(ann), balance(bob)) == (9, 1)
    assert Account.objects.get(pk=ann.pk).fence == grant.token


@pytest.mark.parametrize("rows", ["pk__in", "all"])
def test_a_queryset_of_several_keys_rows_is_refused_whole_and_recorded(rows: str) -> None:
    mine, other = AccountFactory(balance=1), AccountFactory(balance=1)
    grant = locks.acquire(f"account:{mine.pk}", holder="a", ttl=5)
    queryset = (
        Account.objects.filter(pk__in=[mine.pk, other.pk]) if rows == "pk__in"
        else Account.objects.all()
    )

    with pytest.raises(WrongLock, match=rf"rows {other.pk} of the rows asked for"):
        queryset.fenced_update(grant, balance=9)

    assert (balance(mine), balance(other)) == (1, 1)
    assert Account.objects.get(pk=mine.pk).fence == 0
    rejection = Rejection.objects.get()
    assert (rejection.reason, rejection.lock_key) == (RejectionReason.WRONG_LOCK, grant.key)
    # The rows of the grant's key alone are written, by any filter that holds only them.
    assert Account.objects.filter(pk__in=[mine.pk]).fenced_update(grant, balance=2) == 1
    assert balance(mine) == 2


def test_a_key_whose_value_does_not_fit_the_field_writes_nothing() -> None:
    account = AccountFactory(balance=5)
    grant = locks.acquire("account:not-a-number", holder="a", ttl=5)

    with pytest.raises(WrongLock):
        Account.objects.filter(pk=account.pk).fenced_update(grant, balance=1)
    assert balance(account) == 5


def test_token_of_another_key_is_never_compared() -> None:
    # Rule 7: a huge token of another key must not fence this row out.
    account = AccountFactory()
    for _ in range(3):
        locks.release(locks.acquire("busy-key:1", holder="x", ttl=5))
    big = locks.acquire("busy-key:1", holder="x", ttl=5)
    mine = locks.acquire(f"account:{account.pk}", holder="a", ttl=5)

    with pytest.raises(WrongLock):
        Account.objects.filter(pk=account.pk).fenced_update(big, balance=7)
    Account.objects.filter(pk=account.pk).fenced_update(mine, balance=8)

    assert (big.token, mine.token) == (4, 1)
    assert balance(account) == 8


def test_lost_grant_cannot_write() -> None:
    account = AccountFactory(balance=3)
    grant = locks.acquire(f"account:{account.pk}", holder="a", ttl=5)
    grant.mark_lost()

    with pytest.raises(LeaseLost):
        Account.objects.filter(pk=account.pk).fenced_update(grant, balance=4)
    assert balance(account) == 3


def test_current_grant_is_used_when_none_is_passed() -> None:
    account = AccountFactory()
    with pytest.raises(NoGrant):
        Account.objects.filter(pk=account.pk).fenced_update(balance=1)

    with locks.hold(f"account:{account.pk}", holder="a", ttl=5) as grant:
        Account.objects.filter(pk=account.pk).fenced_update(balance=1)
        Account.objects.filter(pk=account.pk).fenced_update(balance=2)

    stored = Account.objects.get(pk=account.pk)
    assert (stored.balance, stored.fence, stored.fence_step) == (2, grant.token, 2)


def test_fenced_save_writes_named_fields_through_the_fence() -> None:
    account = AccountFactory(balance=1)
    grant = locks.acquire(f"account:{account.pk}", holder="a", ttl=5)
    account.balance = Decimal("9.50")

    account.fenced_save(grant, fields=["balance"])

    assert (account.fence, balance(account)) == (grant.token, Decimal("9.50"))


def test_fenced_save_refuses_fields_the_model_lacks_before_writing() -> None:
    account = AccountFactory(balance=1)
    grant = locks.acquire(f"account:{account.pk}", holder="a", ttl=5)
    account.balance = Decimal("9.50")

    with pytest.raises(InvalidInput, match="no concrete field named 'balanse'"):
        account.fenced_save(grant, fields=["balance", "balanse"])
    with pytest.raises(InvalidInput, match=r"not a string: fields=\['balance'\]"):
        account.fenced_save(grant, fields="balance")

    assert (Account.objects.get(pk=account.pk).fence, balance(account)) == (0, Decimal("1"))
    account.fenced_save(grant, fields=["balance"])  # the grant's first write is still step 1
    assert Account.objects.get(pk=account.pk).fence_step == 1


def test_bad_steps_are_refused() -> None:
    account = AccountFactory()
    grant = locks.acquire(f"account:{account.pk}", holder="a", ttl=5)
    for step in (0, -1, 2**63, True, "2"):
        with pytest.raises(InvalidInput):
            Account.objects.filter(pk=account.pk).fenced_update(grant, step=step, balance=1)  # type: ignore[arg-type]


# --- fence(): named resources for side effects that are not one row update ----


def test_fence_block_runs_and_raises_the_watermark() -> None:
    grant = locks.acquire("mailer:7", holder="a", ttl=5)

    with fencing.fence("mailbox-7", grant) as row:
        assert (row.token, row.step) == (grant.token, 1)

    stored = Fence.objects.get(resource="mailbox-7")
    assert (stored.lock_key, stored.token, stored.step) == ("mailer:7", grant.token, 1)


def test_fence_refuses_a_stale_token_before_the_block_runs() -> None:
    old = locks.acquire("mailer:7", holder="a", ttl=5)
    locks.release(old)
    new = locks.acquire("mailer:7", holder="b", ttl=5)
    with fencing.fence("mailbox-7", new):
        pass
    ran = []

    with pytest.raises(StaleToken), fencing.fence("mailbox-7", old):
        ran.append(True)

    assert ran == []
    assert Fence.objects.get(resource="mailbox-7").token == new.token


def test_fence_guarded_by_another_key_is_wrong_lock() -> None:
    FenceFactory(resource="ledger", lock_key="ledger:main")
    grant = locks.acquire("ledger:other", holder="a", ttl=5)

    with pytest.raises(WrongLock), fencing.fence("ledger", grant):
        pass


def test_failed_block_does_not_advance_the_watermark() -> None:
    grant = locks.acquire("mailer:7", holder="a", ttl=5)

    with pytest.raises(RuntimeError), fencing.fence("mailbox-7", grant, step=1):
        raise RuntimeError("side effect failed")

    with fencing.fence("mailbox-7", grant, step=1) as row:  # the retry is not a duplicate
        assert row.step == 1


def test_several_fences_lock_and_advance_together() -> None:
    grant = locks.acquire("transfer:1", holder="a", ttl=5)

    with fencing.fence(["b-side", "a-side"], grant) as rows:
        assert [row.resource for row in rows] == ["a-side", "b-side"]

    assert set(Fence.objects.values_list("resource", "token")) == {
        ("a-side", grant.token), ("b-side", grant.token),
    }


def test_fence_needs_valid_resource_names() -> None:
    grant = locks.acquire("k", holder="a", ttl=5)
    for bad in ("", "with space", []):
        with pytest.raises(InvalidInput), fencing.fence(bad, grant):  # type: ignore[call-overload]
            pass


# --- idempotent retries -------------------------------------------------------


def test_idempotent_retry_returns_the_stored_result_without_running_again() -> None:
    account = AccountFactory(balance=0)
    grant = locks.acquire(f"account:{account.pk}", holder="a", ttl=5)
    runs = []

    def settle() -> dict[str, int]:
        runs.append(1)
        Account.objects.filter(pk=account.pk).fenced_update(grant, step=1, balance=50)
        return {"balance": 50}

    first = fencing.idempotent(f"settle:{account.pk}:{grant.token}", settle)
    retry = fencing.idempotent(f"settle:{account.pk}:{grant.token}", settle)

    assert first == retry == {"balance": 50}
    assert runs == [1]
    assert IdempotencyRecord.objects.get().completed


def test_idempotent_operation_that_fails_stores_nothing() -> None:
    def boom() -> None:
        raise ValueError("no")

    with pytest.raises(ValueError):
        fencing.idempotent("k", boom)
    assert not IdempotencyRecord.objects.exists()
    assert fencing.idempotent("k", lambda: 3) == 3


SETTLED_AT = dt.datetime(2026, 3, 1, 12, 30, 0, 250, tzinfo=dt.UTC)
RECEIPT = uuid.UUID("12345678-1234-5678-1234-567812345678")


@pytest.mark.parametrize(
    "result",
    [
        Decimal("12.50"),
        SETTLED_AT,
        dt.datetime(2026, 3, 1, 12, 30),  # naive stays naive
        dt.date(2026, 3, 1),
        dt.time(12, 30, 5, 7),
        dt.timedelta(days=-1, seconds=5, microseconds=3),
        RECEIPT,
        (1, "two", Decimal("3")),
        {"balance": Decimal("12.50"), "at": SETTLED_AT, "receipt": RECEIPT, "legs": (1, 2)},
        [{"on": dt.date(2026, 3, 1), "amounts": [Decimal("0.10"), Decimal("-0")]}],
        {"__type__": "decimal", "__value__": "1"},  # data shaped like a tag stays data
        {"nested": {"__type__": "mine", "other": [None, True, 1.5]}},
    ],
    ids=lambda result: type(result).__name__,
)
def test_idempotent_retry_returns_the_same_types_as_the_first_call(result: object) -> None:
    first = fencing.idempotent("settle:1", lambda: result)
    retry = fencing.idempotent("settle:1", lambda: pytest.fail("a retry must not run again"))

    assert first is result
    assert retry == result
    assert shape(retry) == shape(result)


def shape(value: object) -> object:
    """The types of ``value`` at every depth, to compare beyond ``==`` (1 == Decimal(1))."""
    if isinstance(value, dict):
        return {key: shape(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return (type(value), [shape(item) for item in value])
    return (type(value), str(value))


class Status(enum.StrEnum):
    PAID = "paid"


@pytest.mark.parametrize(
    ("result", "named"),
    [
        (Status.PAID, "Status, which would not come back as itself"),
        ({"legs": {1: "one"}}, r"\['legs'\] has the key 1"),
        ({"ok": [1, frozenset()]}, r"\['ok'\]\[1\] is a builtins.frozenset"),
    ],
)
def test_idempotent_refuses_at_the_first_call_a_result_a_retry_would_get_as_another_type(
    result: object, named: str
) -> None:
    with pytest.raises(InvalidInput, match=named):
        fencing.idempotent("settle:1", lambda: result)
    assert not IdempotencyRecord.objects.exists()


@pytest.mark.parametrize(
    ("result", "named"),
    [
        (object(), "would not come back as itself"),
        ({"ratio": float("nan")}, "no NaN"),
        ("a\x00b", "NUL"),
    ],
)
@pytest.mark.django_db(transaction=True)
def test_idempotent_result_it_cannot_store_is_invalid_input_and_nothing_is_stored(
    result: object, named: str
) -> None:
    account = AccountFactory(balance=0)
    grant = locks.acquire(f"account:{account.pk}", holder="a", ttl=5)

    def settle() -> object:
        Account.objects.filter(pk=account.pk).fenced_update(grant, step=1, balance=50)
        return result

    with pytest.raises(InvalidInput, match=named):
        fencing.idempotent("settle:1", settle)

    assert not IdempotencyRecord.objects.exists()
    account.refresh_from_db()
    assert (account.balance, account.fence) == (0, 0)  # the operation's write rolled back too


def test_idempotent_keeps_a_literal_backslash_u0000_text() -> None:
    assert fencing.idempotent("k", lambda: "C:\\u0000") == "C:\\u0000"
    assert fencing.idempotent("k", lambda: None) == "C:\\u0000"


# --- rejections outlive the refused transaction ---------------------------------


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_rejection_survives_the_rollback_of_the_refused_transaction() -> None:
    account = AccountFactory()
    key = f"account:{account.pk}"
    old = locks.acquire(key, holder="A", ttl=5)
    locks.release(old)
    new = locks.acquire(key, holder="B", ttl=5)
    Account.objects.filter(pk=account.pk).fenced_update(new, balance=1)

    with pytest.raises(StaleToken), transaction.atomic():
        Account.objects.filter(pk=account.pk).update(owner="changed in the refused transaction")
        Account.objects.filter(pk=account.pk).fenced_update(old, balance=2)

    assert Account.objects.get(pk=account.pk).owner != "changed in the refused transaction"
    assert Rejection.objects.filter(token=old.token, reason="stale_token").count() == 1


@pytest.mark.django_db(transaction=True)
def test_rejection_outside_a_transaction_is_committed_at_once() -> None:
    grant = locks.acquire("mailer:1", holder="a", ttl=5)
    with fencing.fence("box", grant, step=2):
        pass

    with pytest.raises(DuplicateWrite), fencing.fence("box", grant, step=2):
        pass

    rejection = Rejection.objects.get()
    assert (rejection.resource, rejection.watermark_token, rejection.watermark_step) == (
        "box", grant.token, 2,
    )
