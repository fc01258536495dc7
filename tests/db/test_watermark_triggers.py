"""Watermarks never go backwards, whatever writes the row (rule 8 of docs/rules.md).

The database refuses it with a trigger that ``migrate`` installs on every
FencedModel table (the demo's Account stands for a user's own app) and on the
app's Fence and Lock tables. ``save()`` never writes the watermark of an
existing row. Strict models refuse every UPDATE that does not raise it.
"""

from __future__ import annotations

from collections.abc import Iterator
from decimal import Decimal
from io import StringIO
from typing import Any

import pytest
from django.core.management import call_command
from django.db import IntegrityError, connection, transaction
from django.test import Client
from django.urls import reverse

import coordination.restore as restore
from coordination import fencing, locks, watermarks
from coordination.admin import WATERMARK_FIELD
from coordination.backends import dialect_of, triggers
from coordination.checks import check_watermark_triggers
from coordination.exceptions import DuplicateWrite, StaleToken, UnfencedWrite
from coordination.models import Fence, Lock, TokenFloor
from project.demo.models import Account
from tests.support.factories import AccountFactory, FenceFactory, LockFactory

pytestmark = pytest.mark.django_db

ACCOUNTS = Account._meta.db_table
# The triggers every FencedModel table has (a strict one has MUST_RISE too).
ACCOUNT_TRIGGERS = [
    "demo_account_watermark_kept", "demo_account_watermark_not_lowered",
    "demo_account_watermark_restored",
]


def stored(account: Account) -> tuple[int, int, Decimal]:
    return Account.objects.values_list("fence", "fence_step", "balance").get(pk=account.pk)


def raw_update(sql: str, *params: Any) -> None:
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(sql, params)


def two_grants_wrote(account: Account) -> tuple[locks.Grant, locks.Grant]:
    """Tokens 1 and 2 each wrote the account through fenced_update and released."""
    key = f"account:{account.pk}"
    written = []
    for amount in ("10.00", "20.00"):
        grant = locks.acquire(key, holder="worker", ttl=30)
        Account.objects.filter(pk=account.pk).fenced_update(grant, balance=Decimal(amount))
        locks.release(grant)
        written.append(grant)
    return written[0], written[1]


def migrate() -> str:
    out = StringIO()
    call_command("migrate", verbosity=1, stdout=out)
    return out.getvalue()


def triggers_on(table: str) -> list[str]:
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute(
                "SELECT tgname FROM pg_trigger WHERE tgrelid = to_regclass(%s) AND NOT tgisinternal",
                [connection.ops.quote_name(table)],
            )
        elif connection.vendor == "mysql":
            cursor.execute(
                "SELECT TRIGGER_NAME FROM information_schema.TRIGGERS"
                " WHERE TRIGGER_SCHEMA = DATABASE() AND EVENT_OBJECT_TABLE = %s", [table]
            )
        else:
            cursor.execute(
                "SELECT name FROM sqlite_master WHERE type = 'trigger' AND tbl_name = %s", [table]
            )
        return sorted(name for (name,) in cursor.fetchall())


@pytest.fixture
def strict_accounts(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Account as a fence_strict model, switched on as a user would: set it, migrate."""
    monkeypatch.setattr(Account, "fence_strict", True, raising=False)
    migrate()
    yield
    monkeypatch.undo()
    migrate()


# --- the user's story: a stale instance's save() -----------------------------------


def test_a_stale_instance_saved_unfenced_keeps_the_watermark_and_the_released_token_stays_refused() -> None:
    account = AccountFactory(balance=Decimal("0.00"))
    loaded_earlier = Account.objects.get(pk=account.pk)
    first, second = two_grants_wrote(account)

    loaded_earlier.owner = "renamed"
    with fencing.unfenced(reason="test: an operator overwrites"):
        loaded_earlier.save()

    # A stale save let through writes what the instance holds (an unfenced write:
    # strict mode refuses it), but never the watermark it was loaded with.
    assert stored(account) == (second.token, 1, Decimal("0.00"))
    assert Account.objects.get(pk=account.pk).owner == "renamed"
    with pytest.raises(StaleToken) as refused:
        Account.objects.filter(pk=account.pk).fenced_update(first, balance=Decimal("-1"))
    assert refused.value.current_token == second.token
    assert stored(account) == (second.token, 1, Decimal("0.00"))


def test_save_naming_the_watermark_in_update_fields_does_not_write_it() -> None:
    account = AccountFactory()
    _, second = two_grants_wrote(account)
    account.refresh_from_db()
    # Set above the row's: not stale, and still not written (a plain save never
    # raises a watermark either: that takes a grant).
    account.fence, account.fence_step, account.balance = second.token + 5, 0, Decimal("5.00")

    account.save(update_fields=["fence", "fence_step", "balance"])

    assert stored(account) == (second.token, 1, Decimal("5.00"))


def test_save_of_an_instance_whose_row_was_deleted_inserts_it_with_its_values() -> None:
    account = AccountFactory(balance=Decimal("3.00"))
    Account.objects.filter(pk=account.pk).fenced_update(
        locks.acquire(f"account:{account.pk}", holder="w", ttl=30), balance=Decimal("4.00")
    )
    account.refresh_from_db()
    Account.objects.filter(pk=account.pk).delete()

    token = account.fence
    account.save()

    # Inserted again, it starts at its deleted row's token, every step taken.
    assert stored(account) == (token, watermarks.HIGHEST_STEP, Decimal("4.00"))
    assert account.carried_watermark() == (token, watermarks.HIGHEST_STEP)


def test_a_new_instance_saved_writes_its_watermark() -> None:
    account = Account(owner="new", fence=7, fence_step=2)
    account.save()
    assert stored(account)[:2] == (7, 2)


def test_fenced_save_writes_fields_with_the_token_and_raises_the_watermark() -> None:
    account = AccountFactory()
    grant = locks.acquire(f"account:{account.pk}", holder="w", ttl=30)
    account.balance = Decimal("9.00")

    account.fenced_save(grant, fields=["balance"], step=3)

    assert stored(account) == (grant.token, 3, Decimal("9.00"))
    assert (account.fence, account.fence_step) == (grant.token, 3)


# --- every other write path ------------------------------------------------------------


def test_update_lowering_the_fence_is_refused_as_a_stale_token_and_changes_no_row() -> None:
    kept, lowered = AccountFactory(), AccountFactory()
    Account.objects.filter(pk=lowered.pk).update(fence=2, fence_step=1)

    with pytest.raises(StaleToken) as refused, transaction.atomic():
        Account.objects.filter(pk__in=[kept.pk, lowered.pk]).update(fence=0, balance=Decimal("1"))

    assert refused.value.resource == f"demo.account:{lowered.pk}"
    assert (refused.value.token, refused.value.current_token, refused.value.current_step) == (0, 2, 1)
    assert stored(lowered) == (2, 1, Decimal("100.00"))
    assert stored(kept) == (0, 0, Decimal("100.00"))  # the whole statement was undone


def test_lowering_the_step_within_the_same_token_is_refused() -> None:
    account = AccountFactory()
    Account.objects.filter(pk=account.pk).update(fence=2, fence_step=3)

    with pytest.raises(DuplicateWrite) as refused, transaction.atomic():
        Account.objects.filter(pk=account.pk).update(fence_step=2)

    assert (refused.value.token, refused.value.step, refused.value.current_step) == (2, 2, 3)
    with pytest.raises(IntegrityError, match=watermarks.NOT_LOWERED):
        raw_update(f"UPDATE {ACCOUNTS} SET fence_step = 2 WHERE id = %s", account.pk)
    assert stored(account)[:2] == (2, 3)


def test_bulk_update_lowering_a_fence_is_refused_and_writes_nothing() -> None:
    first, second = AccountFactory(), AccountFactory()
    Account.objects.filter(pk=second.pk).update(fence=5, fence_step=1)
    first.balance = second.balance = Decimal("7.00")
    second.fence = 4

    with pytest.raises(StaleToken) as refused, transaction.atomic():
        Account.objects.bulk_update([first, second], ["balance", "fence"])

    assert refused.value.resource == f"demo.account:{second.pk}"
    assert (refused.value.token, refused.value.current_token) == (4, 5)
    assert stored(first) == (0, 0, Decimal("100.00"))
    assert stored(second) == (5, 1, Decimal("100.00"))


def test_raw_sql_lowering_a_fence_gets_the_database_error() -> None:
    account = AccountFactory()
    Account.objects.filter(pk=account.pk).update(fence=2, fence_step=1)

    with pytest.raises(IntegrityError) as refused:
        raw_update(f"UPDATE {ACCOUNTS} SET fence = 0, fence_step = 0 WHERE id = %s", account.pk)

    # The driver's message (MySQLdb's error is (errno, message)).
    message = str(refused.value.args[-1])
    assert message.startswith(f"{watermarks.NOT_LOWERED}: UPDATE of {ACCOUNTS}")
    assert stored(account)[:2] == (2, 1)
    if connection.vendor == "postgresql":
        diag = refused.value.__cause__.diag  # type: ignore[union-attr]
        assert (diag.sqlstate, diag.constraint_name, diag.table_name) == (
            "23514", watermarks.NOT_LOWERED, ACCOUNTS,
        )
        assert f"pk {account.pk} would lower the watermark (fence, fence_step) from (2, 1) to (0, 0)" in (
            diag.message_primary
        )


def test_refusal_reads_the_constraint_table_and_values() -> None:
    account = AccountFactory()
    Account.objects.filter(pk=account.pk).update(fence=3, fence_step=2)
    with pytest.raises(IntegrityError) as refused:
        raw_update(f"UPDATE {ACCOUNTS} SET fence = 1 WHERE id = %s", account.pk)

    found = dialect_of(connection).watermark_refusal(refused.value)

    assert found is not None
    assert (found.constraint, found.table, found.strict) == (watermarks.NOT_LOWERED, ACCOUNTS, False)
    if connection.vendor == "postgresql":
        assert (found.pk, found.old, found.new) == (account.pk, (3, 2), (1, 2))
    not_a_refusal = IntegrityError("NOT NULL constraint failed: demo_account.fence")
    assert dialect_of(connection).watermark_refusal(not_a_refusal) is None


def test_raising_the_watermark_or_leaving_it_alone_is_allowed_on_every_path() -> None:
    account = AccountFactory()

    Account.objects.filter(pk=account.pk).update(fence=2, fence_step=1)
    Account.objects.filter(pk=account.pk).update(fence_step=4)
    raw_update(f"UPDATE {ACCOUNTS} SET fence = 3, fence_step = 0 WHERE id = %s", account.pk)
    Account.objects.filter(pk=account.pk).update(balance=Decimal("8.00"))  # not strict
    raw_update(f"UPDATE {ACCOUNTS} SET fence = 3, owner = 'x' WHERE id = %s", account.pk)

    assert stored(account) == (3, 0, Decimal("8.00"))


def test_deleting_a_fenced_row_is_not_refused() -> None:
    account = AccountFactory()
    Account.objects.filter(pk=account.pk).update(fence=2)
    Account.objects.filter(pk=account.pk).delete()
    assert not Account.objects.filter(pk=account.pk).exists()


# --- the app's own counters and watermarks ------------------------------------------


def test_a_lock_token_counter_is_never_lowered() -> None:
    lock = LockFactory(token=5)

    with pytest.raises(IntegrityError, match=watermarks.NOT_LOWERED):
        raw_update("UPDATE coordination_lock SET token = 4 WHERE id = %s", lock.pk)
    with pytest.raises(IntegrityError, match=watermarks.NOT_LOWERED), transaction.atomic():
        Lock.objects.filter(pk=lock.pk).update(token=0)

    assert Lock.objects.get(pk=lock.pk).token == 5
    grant = locks.acquire(lock.key, holder="w", ttl=30)  # the grant point raises it
    locks.release(grant)  # and a release keeps it
    assert grant.token == 6 == Lock.objects.get(pk=lock.pk).token


def test_the_token_floor_is_never_lowered() -> None:
    assert restore.raise_floor_to(40) == 40

    with pytest.raises(IntegrityError, match=watermarks.NOT_LOWERED):
        raw_update("UPDATE coordination_tokenfloor SET token = 39 WHERE id = 1")
    with pytest.raises(IntegrityError, match=watermarks.NOT_LOWERED), transaction.atomic():
        TokenFloor.objects.update(token=0)
    assert restore.raise_floor_to(10) == 40  # raising to less is no change

    assert TokenFloor.objects.value() == 40
    assert triggers.missing(connection, watermarks.watermarks_of([TokenFloor])) == []
    assert locks.acquire("never-seen", holder="w", ttl=30).token == 41


def test_a_fence_watermark_is_never_lowered() -> None:
    row = FenceFactory(lock_key="mailer:1")
    grant = locks.acquire("mailer:1", holder="w", ttl=30)
    with fencing.fence(row.resource, grant, step=2):
        pass

    with pytest.raises(IntegrityError, match=watermarks.NOT_LOWERED):
        raw_update("UPDATE coordination_fence SET step = 1 WHERE id = %s", row.pk)
    with pytest.raises(IntegrityError, match=watermarks.NOT_LOWERED), transaction.atomic():
        Fence.objects.filter(pk=row.pk).update(token=0, step=0)

    assert Fence.objects.values_list("token", "step").get(pk=row.pk) == (grant.token, 2)
    locks.release(grant)
    later = locks.acquire("mailer:1", holder="w", ttl=30)
    assert fencing.raise_fence_to_lock(row.resource).after == (later.token, 0)


# --- strict mode --------------------------------------------------------------------


@pytest.mark.usefixtures("strict_accounts")
def test_strict_model_refuses_a_plain_save_and_update() -> None:
    account = AccountFactory()  # an insert is not an UPDATE
    Account.objects.filter(pk=account.pk).fenced_update(
        locks.acquire(f"account:{account.pk}", holder="w", ttl=30), balance=Decimal("1.00")
    )
    token = stored(account)[0]
    account.refresh_from_db()
    account.balance = Decimal("2.00")

    with pytest.raises(UnfencedWrite) as refused, transaction.atomic():
        account.save()
    assert refused.value.code == "unfenced_write"
    assert (refused.value.resource, refused.value.current_token, refused.value.current_step) == (
        f"demo.account:{account.pk}", token, 1,
    )
    with pytest.raises(UnfencedWrite), transaction.atomic():
        Account.objects.filter(pk=account.pk).update(balance=Decimal("3.00"))
    with pytest.raises(IntegrityError, match=watermarks.MUST_RISE):
        raw_update(f"UPDATE {ACCOUNTS} SET balance = 4 WHERE id = %s", account.pk)
    with pytest.raises(StaleToken), transaction.atomic():  # lowering stays a stale write, strict or not
        Account.objects.filter(pk=account.pk).update(fence=0)
    assert stored(account) == (token, 1, Decimal("1.00"))


@pytest.mark.usefixtures("strict_accounts")
def test_strict_model_accepts_fenced_writes() -> None:
    account = AccountFactory()
    grant = locks.acquire(f"account:{account.pk}", holder="w", ttl=30)

    Account.objects.filter(pk=account.pk).fenced_update(grant, step=1, balance=Decimal("1.00"))
    account.balance = Decimal("2.00")
    account.fenced_save(grant, fields=["balance"], step=2)

    assert stored(account) == (grant.token, 2, Decimal("2.00"))
    Account.objects.filter(pk=account.pk).delete()  # deletes are not refused


def test_switching_to_strict_and_back_takes_effect_at_the_next_migrate(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    account = AccountFactory()
    monkeypatch.setattr(Account, "fence_strict", True, raising=False)
    account.save()  # not migrated yet: the trigger is still the lenient one

    assert "demo_account_watermark_must_rise" in migrate()
    with pytest.raises(UnfencedWrite), transaction.atomic():
        account.save()

    monkeypatch.setattr(Account, "fence_strict", False)
    assert "demo_account_watermark_must_rise" in migrate()
    account.save()
    assert triggers_on(ACCOUNTS) == ACCOUNT_TRIGGERS


# --- installation ---------------------------------------------------------------------


def test_migrate_installs_the_trigger_of_a_model_in_another_app() -> None:
    assert triggers_on(ACCOUNTS) == ACCOUNT_TRIGGERS
    assert triggers_on("coordination_lock") == ["coordination_lock_watermark_not_lowered"]
    assert triggers_on("coordination_fence") == ["coordination_fence_watermark_not_lowered"]
    assert triggers.missing(connection, watermarks.watermarks_of([Account, Lock, Fence])) == []


def test_migrate_twice_changes_nothing_the_second_time() -> None:
    migrate()
    assert "Watermark triggers" not in migrate()
    assert triggers_on(ACCOUNTS) == ACCOUNT_TRIGGERS


def test_migrate_reinstalls_a_trigger_lost_with_its_table_rebuild() -> None:
    # SQLite's schema editor rebuilds a table for most AlterFields, without its triggers.
    with connection.cursor() as cursor:
        cursor.execute(
            "DROP TRIGGER demo_account_watermark_not_lowered"
            + (f" ON {ACCOUNTS}" if connection.vendor == "postgresql" else "")
        )
    assert triggers_on(ACCOUNTS) == [
        name for name in ACCOUNT_TRIGGERS if name != "demo_account_watermark_not_lowered"
    ]
    [warning] = check_watermark_triggers(databases=["default"])
    assert warning.id == "coordination.W005" and ACCOUNTS in warning.msg

    assert "demo_account_watermark_not_lowered" in migrate()

    assert triggers_on(ACCOUNTS) == ACCOUNT_TRIGGERS
    assert check_watermark_triggers(databases=["default"]) == []


# --- the admin ----------------------------------------------------------------------


@pytest.fixture
def fast_password_hashing(settings: Any) -> None:
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


def change_account(client: Client, account: Account, balance: str) -> Any:
    """Open the change form, then save it with ``balance``."""
    url = reverse("admin:demo_account_change", args=[account.pk])
    shown = client.get(url).context["adminform"].form[WATERMARK_FIELD].value()
    return client.post(
        url,
        {"owner": account.owner, "balance": balance, WATERMARK_FIELD: shown, "_save": "Save"},
        follow=True,
    )


@pytest.mark.usefixtures("fast_password_hashing")
def test_admin_edit_keeps_the_watermark_a_newer_token_wrote(admin_client: Client) -> None:
    account = AccountFactory()
    _, second = two_grants_wrote(account)

    response = change_account(admin_client, account, "55.00")

    assert response.status_code == 200
    assert stored(account) == (second.token, 1, Decimal("55.00"))


@pytest.mark.usefixtures("fast_password_hashing", "strict_accounts")
def test_admin_edit_of_a_strict_model_is_refused_with_a_message(admin_client: Client) -> None:
    account = AccountFactory()

    response = change_account(admin_client, account, "55.00")

    assert response.status_code == 200
    assert response.redirect_chain == [(reverse("admin:demo_account_change", args=[account.pk]), 302)]
    [message] = [str(message) for message in response.context["messages"]]
    assert message.startswith(f"Not saved: demo.account:{account.pk} is fenced strictly")
    assert stored(account) == (0, 0, Decimal("100.00"))
