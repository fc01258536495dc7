"""Safe by default where the write lands (rule 8 of docs/rules.md).

A ``save()`` of a FencedModel instance loaded before the row's watermark rose is
refused, with the row left as it was; ``coordination.unfenced()`` lets it
through for an operator, audited, and still never lowers a watermark. A
deleted row's watermark is kept, so a row inserted again with its primary key
refuses every token up to the deleted row's, whatever deleted it.
"""

from __future__ import annotations

import logging
from decimal import Decimal
from typing import Any

import pytest
from django.db import IntegrityError, connection, transaction
from django.test import Client
from django.urls import reverse

import coordination
from coordination import locks, watermarks
from coordination.admin import WATERMARK_FIELD
from coordination.exceptions import (
    CoordinationError,
    DuplicateWrite,
    InvalidInput,
    StaleInstance,
    StaleToken,
    UnfencedWrite,
)
from coordination.fencing import unfenced
from coordination.models import Tombstone, UnfencedSave
from project.demo.models import Account
from tests.support.factories import AccountFactory

pytestmark = pytest.mark.django_db

ACCOUNTS = Account._meta.db_table
HIGHEST = watermarks.HIGHEST_STEP


def stored(account: Account) -> tuple[int, int, str, Decimal]:
    return Account.objects.values_list("fence", "fence_step", "owner", "balance").get(pk=account.pk)


def fenced_write(account: Account, balance: str) -> locks.Grant:
    """A grant of the account's lock writes ``balance`` with fenced_update, then releases."""
    grant = locks.acquire(f"account:{account.pk}", holder="worker", ttl=30)
    Account.objects.filter(pk=account.pk).fenced_update(grant, balance=Decimal(balance))
    locks.release(grant)
    return grant


def tombstones(pk: int) -> Any:
    # By row: on SQLite, a flush between transactional tests deletes rows (firing
    # the trigger) rather than truncating, so other tests' tombstones may be left.
    return Tombstone.objects.filter(table_name=ACCOUNTS, row_pk=str(pk))


def raw(sql: str, *params: Any) -> None:
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(sql, params)


# --- a stale instance's save() --------------------------------------------------------


def test_a_stale_save_is_refused_and_leaves_the_row_as_the_newer_write_left_it() -> None:
    account = AccountFactory(owner="ann", balance=Decimal("0.00"))
    loaded_earlier = Account.objects.get(pk=account.pk)
    fenced_write(account, "10.00")
    newer = fenced_write(account, "20.00")

    loaded_earlier.owner, loaded_earlier.balance = "stale", Decimal("-1.00")
    # (Like any error in save(), it marks an enclosing transaction for rollback.)
    with pytest.raises(StaleInstance) as refused, transaction.atomic():
        loaded_earlier.save()

    assert stored(account) == (newer.token, 1, "ann", Decimal("20.00"))
    error = refused.value
    assert isinstance(error, CoordinationError) and error.code == "stale_instance"
    assert (error.resource, error.token, error.step) == (f"demo.account:{account.pk}", 0, 0)
    assert (error.current_token, error.current_step) == (newer.token, 1)
    assert "refresh_from_db()" in error.detail and "nothing was saved" in error.detail


def test_a_stale_save_with_update_fields_is_refused() -> None:
    account = AccountFactory(owner="ann")
    loaded_earlier = Account.objects.get(pk=account.pk)
    newer = fenced_write(account, "20.00")

    loaded_earlier.owner = "stale"
    with pytest.raises(StaleInstance), transaction.atomic():
        loaded_earlier.save(update_fields=["owner"])

    assert stored(account) == (newer.token, 1, "ann", Decimal("20.00"))


def test_a_refused_save_inside_a_transaction_rolls_it_back() -> None:
    account = AccountFactory(owner="ann")
    loaded_earlier = Account.objects.get(pk=account.pk)
    fenced_write(account, "20.00")
    other = AccountFactory(owner="bob")

    with pytest.raises(StaleInstance), transaction.atomic():
        Account.objects.filter(pk=other.pk).update(owner="changed in the same transaction")
        loaded_earlier.save()

    assert stored(other)[2] == "bob"


def test_an_instance_that_never_saw_the_row_is_stale() -> None:
    account = AccountFactory(owner="ann")
    fenced_write(account, "20.00")

    with pytest.raises(StaleInstance), transaction.atomic():
        Account(pk=account.pk, owner="blind", balance=Decimal("1.00")).save()
    assert stored(account)[2] == "ann"


def test_an_instance_loaded_without_its_watermark_carries_zero() -> None:
    account = AccountFactory(owner="ann")
    fenced_write(account, "20.00")
    partial = Account.objects.only("owner").get(pk=account.pk)
    partial.owner = "partial"

    with pytest.raises(StaleInstance), transaction.atomic():
        partial.save()
    assert stored(account)[2] == "ann"

    untouched = AccountFactory(owner="never fenced")
    loaded = Account.objects.only("owner").get(pk=untouched.pk)
    loaded.owner = "renamed"
    loaded.save()  # a row at (0, 0) is not above what it carries
    assert stored(untouched)[2] == "renamed"


def test_a_fresh_instance_saves_and_keeps_the_watermark() -> None:
    account = AccountFactory(owner="ann")
    newer = fenced_write(account, "20.00")
    fresh = Account.objects.get(pk=account.pk)

    fresh.owner = "fresh"
    fresh.save()
    fresh.owner = "again"
    fresh.save(update_fields=["owner"])  # its own save did not make it stale

    assert stored(account) == (newer.token, 1, "again", Decimal("20.00"))


def test_refresh_from_db_makes_a_stale_instance_fresh() -> None:
    account = AccountFactory(owner="ann")
    loaded_earlier = Account.objects.get(pk=account.pk)
    fenced_write(account, "20.00")

    loaded_earlier.refresh_from_db()
    loaded_earlier.owner = "reloaded"
    loaded_earlier.save()

    assert stored(account)[2:] == ("reloaded", Decimal("20.00"))


def test_an_instance_saves_after_its_own_fenced_save() -> None:
    account = AccountFactory(owner="ann")
    grant = locks.acquire(f"account:{account.pk}", holder="worker", ttl=30)
    account.balance = Decimal("7.00")
    account.fenced_save(grant, fields=["balance"])

    account.owner = "after"
    account.save()

    assert stored(account) == (grant.token, 1, "after", Decimal("7.00"))
    assert account.carried_watermark() == (grant.token, 1)


def test_an_insert_is_not_checked() -> None:
    account = Account(owner="new", balance=Decimal("1.00"))
    account.save()
    created = Account.objects.create(owner="created")
    assert stored(account)[:3] == (0, 0, "new")
    assert stored(created)[:3] == (0, 0, "created")


def test_a_strict_model_still_refuses_a_fresh_save(monkeypatch: pytest.MonkeyPatch) -> None:
    from django.core.management import call_command

    account = AccountFactory(owner="ann")
    monkeypatch.setattr(Account, "fence_strict", True, raising=False)
    call_command("migrate", verbosity=0)
    try:
        with pytest.raises(UnfencedWrite), transaction.atomic():
            account.save()
        with pytest.raises(UnfencedWrite), transaction.atomic(), unfenced(reason="no use"):
            account.save()  # the escape hatch does not lift strict fencing
    finally:
        monkeypatch.undo()
        call_command("migrate", verbosity=0)
    assert stored(account)[2] == "ann"


# --- the escape hatch -----------------------------------------------------------------


def test_unfenced_lets_a_stale_save_through_and_audits_it(caplog: pytest.LogCaptureFixture) -> None:
    account = AccountFactory(owner="ann")
    loaded_earlier = Account.objects.get(pk=account.pk)
    newer = fenced_write(account, "20.00")
    loaded_earlier.owner = "operator fix"

    with (
        caplog.at_level(logging.WARNING, logger="coordination.fencing"),
        coordination.unfenced(reason="restore the owner from the ticket", by="ops-alice"),
    ):
        loaded_earlier.save()

    # The data is the instance's (the balance too: a save writes every field);
    # the watermark is the row's, and the instance now carries it.
    assert stored(account) == (newer.token, 1, "operator fix", Decimal("100.00"))
    assert loaded_earlier.carried_watermark() == (newer.token, 1)
    [audit] = UnfencedSave.objects.filter(resource=f"demo.account:{account.pk}")
    assert (audit.resource, audit.lock_key, audit.by, audit.reason) == (
        f"demo.account:{account.pk}", f"account:{account.pk}", "ops-alice",
        "restore the owner from the ticket",
    )
    assert (audit.token, audit.step, audit.watermark_token, audit.watermark_step) == (
        0, 0, newer.token, 1,
    )
    records = [record for record in caplog.records if record.name == "coordination.fencing"]
    events = [record.coordination["event"] for record in records]  # type: ignore[attr-defined]
    assert events == ["unfenced", "unfenced_save"]
    assert all(record.levelno == logging.WARNING for record in records)
    assert "by=ops-alice" in records[1].getMessage()
    assert "reason=" in records[1].getMessage()

    # Outside the block the default is back.
    stale_again = Account.objects.get(pk=account.pk)
    fenced_write(account, "30.00")
    with pytest.raises(StaleInstance), transaction.atomic():
        stale_again.save()


def test_unfenced_never_lowers_a_watermark() -> None:
    account = AccountFactory(owner="ann")
    loaded_earlier = Account.objects.get(pk=account.pk)
    older = fenced_write(account, "10.00")
    newer = fenced_write(account, "20.00")

    with unfenced(reason="test"):
        loaded_earlier.fence, loaded_earlier.fence_step = 0, 0
        loaded_earlier.owner = "lowered?"
        loaded_earlier.save(update_fields=["owner", "fence", "fence_step"])
        with pytest.raises(StaleToken), transaction.atomic():
            Account.objects.filter(pk=account.pk).update(fence=0)
        with pytest.raises(IntegrityError, match=watermarks.NOT_LOWERED):
            raw(f"UPDATE {ACCOUNTS} SET fence = 0 WHERE id = %s", account.pk)

    assert stored(account)[:3] == (newer.token, 1, "lowered?")
    with pytest.raises(StaleToken):  # the older token is still refused
        Account.objects.filter(pk=account.pk).fenced_update(older, balance=Decimal("0.00"))


def test_unfenced_needs_a_reason() -> None:
    with pytest.raises(InvalidInput), unfenced(reason="  "):
        pass


def test_a_fresh_save_inside_unfenced_is_not_audited() -> None:
    account = AccountFactory(owner="ann")
    with unfenced(reason="test"):
        account.owner = "fresh"
        account.save()
    assert stored(account)[2] == "fresh"
    assert not UnfencedSave.objects.filter(resource=f"demo.account:{account.pk}").exists()


# --- the admin's change form ----------------------------------------------------------


@pytest.fixture
def fast_password_hashing(settings: Any) -> None:
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


@pytest.mark.usefixtures("fast_password_hashing")
def test_a_stale_admin_form_is_refused_with_a_message(admin_client: Client) -> None:
    account = AccountFactory(owner="ann")
    url = reverse("admin:demo_account_change", args=[account.pk])
    page = admin_client.get(url)
    shown = page.context["adminform"].form[WATERMARK_FIELD].value()
    assert shown == "0,0"
    assert f'name="{WATERMARK_FIELD}"' in page.content.decode()
    newer = fenced_write(account, "20.00")  # while the page is open

    response = admin_client.post(
        url, {"owner": "from the old page", "balance": "55.00", WATERMARK_FIELD: shown,
              "_save": "Save"},
        follow=True,
    )

    assert response.status_code == 200
    assert response.redirect_chain == [(url, 302)]
    [message] = [str(message) for message in response.context["messages"]]
    assert message.startswith(
        f"Not saved: demo.account:{account.pk} was changed by a newer write since this page "
        "was loaded"
    )
    assert stored(account) == (newer.token, 1, "ann", Decimal("20.00"))
    # The page shown again carries the row as it is now: saving it works.
    current = response.context["adminform"].form[WATERMARK_FIELD].value()
    assert current == f"{newer.token},1"
    admin_client.post(url, {"owner": "fixed", "balance": "21.00", WATERMARK_FIELD: current,
                            "_save": "Save"})
    assert stored(account) == (newer.token, 1, "fixed", Decimal("21.00"))


@pytest.mark.usefixtures("fast_password_hashing")
def test_an_admin_post_without_the_watermark_is_not_saved(admin_client: Client) -> None:
    account = AccountFactory(owner="ann")
    url = reverse("admin:demo_account_change", args=[account.pk])

    response = admin_client.post(url, {"owner": "forged", "balance": "1.00", "_save": "Save"})

    assert response.status_code == 200
    assert "which version of the row it edits" in response.content.decode()
    assert stored(account)[2] == "ann"
    assert admin_client.get(reverse("admin:demo_account_add")).status_code == 200


# --- delete, then insert again --------------------------------------------------------


def test_a_row_deleted_and_created_again_refuses_the_old_tokens() -> None:
    account = AccountFactory(owner="ann")
    older = fenced_write(account, "10.00")
    last = fenced_write(account, "20.00")
    pk = account.pk

    Account.objects.filter(pk=pk).delete()
    again = Account.objects.create(pk=pk, owner="again")

    assert stored(again)[:2] == (last.token, HIGHEST)
    assert again.carried_watermark() == (last.token, HIGHEST)
    with pytest.raises(StaleToken):
        Account.objects.filter(pk=pk).fenced_update(older, balance=Decimal("-1"))
    with pytest.raises(DuplicateWrite) as refused:  # every step of the deleted row's token
        Account.objects.filter(pk=pk).fenced_update(last, step=2, balance=Decimal("-1"))
    assert "deleted and created again" in str(refused.value)  # not "use an idempotency key"
    assert stored(again)[3] == Decimal("0.00")

    again.owner = "saved after the insert"
    again.save()  # not stale: it carries what the database started the row at
    newer = fenced_write(again, "30.00")  # a newer grant writes
    assert stored(again) == (newer.token, 1, "saved after the insert", Decimal("30.00"))
    assert tombstones(pk).values_list("fence", "fence_step").get() == (last.token, 1)


def test_a_raw_sql_delete_and_insert_keep_the_watermark_too() -> None:
    account = AccountFactory(owner="ann")
    last = fenced_write(account, "20.00")
    pk = account.pk

    raw(f"DELETE FROM {ACCOUNTS} WHERE id = %s", pk)
    raw(
        f"INSERT INTO {ACCOUNTS} (id, owner, balance, fence, fence_step) VALUES (%s, 'raw', 0, 0, 0)",
        pk,
    )

    assert stored(account)[:2] == (last.token, HIGHEST)
    with pytest.raises(DuplicateWrite):
        Account.objects.filter(pk=pk).fenced_update(last, step=5, balance=Decimal("-1"))


def test_an_instance_deleted_and_saved_again_carries_the_kept_watermark() -> None:
    account = AccountFactory(owner="ann")
    last = fenced_write(account, "20.00")
    account.refresh_from_db()

    Account.objects.filter(pk=account.pk).delete()  # behind the instance's back
    account.save()  # Django inserts it again, with its pk

    assert stored(account)[:2] == (last.token, HIGHEST)
    assert account.carried_watermark() == (last.token, HIGHEST)


def test_deleting_again_keeps_the_higher_watermark_and_a_higher_insert_keeps_its_own() -> None:
    account = AccountFactory(owner="ann")
    first = fenced_write(account, "20.00")
    pk = account.pk
    Account.objects.filter(pk=pk).delete()
    Account.objects.create(pk=pk, owner="again")
    second = fenced_write(Account(pk=pk), "30.00")
    assert second.token > first.token

    Account.objects.filter(pk=pk).delete()
    assert tombstones(pk).values_list("fence", "fence_step").get() == (second.token, 1)
    higher = Account.objects.create(pk=pk, owner="higher", fence=second.token + 10, fence_step=2)

    assert stored(higher)[:2] == (second.token + 10, 2)


def test_a_row_never_fenced_leaves_no_tombstone() -> None:
    account = AccountFactory(owner="ann")
    pk = account.pk
    account.delete()
    Account.objects.create(pk=pk, owner="again")
    assert not tombstones(pk).exists()
    assert stored(Account(pk=pk))[:2] == (0, 0)


def test_the_watermark_field_joins_an_admin_with_its_own_fields(rf: Any, admin_user: Any) -> None:
    from django.contrib import admin
    from django.contrib.admin.utils import flatten_fieldsets

    from coordination.admin import FencedModelAdmin

    class OwnerOnly(FencedModelAdmin):
        fields = ["owner"]

    account = AccountFactory(owner="ann")
    fenced_write(account, "20.00")
    account.refresh_from_db()
    model_admin = OwnerOnly(Account, admin.site)
    request = rf.get("/")
    request.user = admin_user

    fieldsets = model_admin.get_fieldsets(request, account)
    form = model_admin.get_form(request, account, fields=flatten_fieldsets(fieldsets))(
        instance=account
    )

    assert flatten_fieldsets(fieldsets) == ["owner", WATERMARK_FIELD]
    assert list(form.fields) == ["owner", WATERMARK_FIELD]
    assert form[WATERMARK_FIELD].value() == f"{account.fence},1"
    assert WATERMARK_FIELD not in model_admin.get_form(request, None)().fields


def test_a_plain_fenced_model_admin_shows_the_watermark_read_only(rf: Any, admin_user: Any) -> None:
    from django.contrib import admin
    from django.contrib.admin.utils import flatten_fieldsets

    from coordination.admin import FencedModelAdmin

    class Plain(FencedModelAdmin):  # as a user's site registers it: nothing declared
        pass

    account = AccountFactory(owner="ann")
    fenced_write(account, "20.00")
    account.refresh_from_db()
    model_admin = Plain(Account, admin.site)
    request = rf.get("/")
    request.user = admin_user

    shown = flatten_fieldsets(model_admin.get_fieldsets(request, account))
    assert {"fence", "fence_step"} <= set(shown)
    assert {"fence", "fence_step"} <= set(model_admin.get_readonly_fields(request, account))
    form = model_admin.get_form(request, account, fields=shown)(instance=account)
    assert "fence" not in form.fields and "fence_step" not in form.fields


# --- refresh_from_db(fields=...) ---------------------------------------------------------


def test_refreshing_some_fields_reloads_the_watermark_and_forgets_the_stale_rest() -> None:
    account = AccountFactory(owner="ann", balance=Decimal("0.00"))
    loaded_earlier = Account.objects.get(pk=account.pk)
    newer = fenced_write(account, "20.00")

    loaded_earlier.refresh_from_db(fields=["owner"])
    assert loaded_earlier.carried_watermark() == (newer.token, 1)
    assert "balance" not in loaded_earlier.__dict__  # forgotten: it was stale
    loaded_earlier.owner = "bob"
    loaded_earlier.save()  # not StaleInstance: checked against the row as it is now

    assert stored(account) == (newer.token, 1, "bob", Decimal("20.00"))
    assert loaded_earlier.balance == Decimal("20.00")  # loaded afresh on first use


def test_refreshing_some_fields_of_an_unchanged_row_keeps_the_others() -> None:
    account = AccountFactory(owner="ann", balance=Decimal("5.00"))
    loaded = Account.objects.get(pk=account.pk)
    loaded.balance = Decimal("6.00")  # a change in progress
    loaded.refresh_from_db(fields=["owner"])
    assert loaded.__dict__["balance"] == Decimal("6.00")
