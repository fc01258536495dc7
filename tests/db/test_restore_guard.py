"""coordination_restore_guard: no token is issued twice, no fenced-out token writes again."""

from __future__ import annotations

from decimal import Decimal
from io import StringIO

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connection, transaction

from coordination import locks, restore
from coordination.exceptions import DuplicateWrite, LeaseLost, StaleToken
from coordination.fencing import fence
from coordination.models import MAX_TOKEN, Fence, Grant, GrantEnd, Lock, TokenFloor
from project.demo.models import Account
from tests.support.factories import AccountFactory, FenceFactory, LockFactory

pytestmark = pytest.mark.django_db


def guard(*args: str) -> tuple[str, str]:
    out, err = StringIO(), StringIO()
    call_command("coordination_restore_guard", *args, stdout=out, stderr=err)
    return out.getvalue(), err.getvalue()


def restore_lock_database_to(key: str, token: int) -> None:
    """What restoring a backup taken at ``token`` does to the lock rows of ``key``.

    A restore loads the backup's rows as they were; it does not UPDATE the
    current ones (an UPDATE that lowers the counter is refused by the database).
    So the lock row is replaced, under the same id its grants point to.
    """
    lock = Lock.objects.get(key=key)
    Grant.objects.filter(lock=lock, token__gt=token).delete()
    # The grants' foreign key is checked at commit (PostgreSQL, SQLite), or not
    # during the load (MariaDB: as a dump sets FOREIGN_KEY_CHECKS=0).
    with transaction.atomic(), connection.constraint_checks_disabled():
        with connection.cursor() as cursor:
            cursor.execute(f"DELETE FROM {Lock._meta.db_table} WHERE id = %s", [lock.pk])
        lock.token, lock.holder, lock.lease_hash, lock.expires_at = token, "", "", None
        lock.save(force_insert=True)


def cycle(key: str, times: int = 1) -> int:
    token = 0
    for _ in range(times):
        grant = locks.acquire(key, holder="w", ttl=30)
        locks.release(grant)
        token = grant.token
    return token


# --- --bump: the lock database was restored --------------------------------------------


def test_bump_after_restore_never_reissues_a_token() -> None:
    cycle("invoice:1", 3)  # the backup is taken here, at token 3
    issued = cycle("invoice:1", 4)  # tokens 4..7 are issued and used after it
    restore_lock_database_to("invoice:1", 3)

    guard("--bump", "1000", "--apply")

    after = locks.acquire("invoice:1", holder="w", ttl=30)
    assert after.token == 1004 > issued


def forget_key(key: str) -> None:
    """What restoring a backup taken before ``key``'s first grant does: no row, no grants."""
    Grant.objects.filter(lock__key=key).delete()
    Lock.objects.filter(key=key).delete()


def test_bump_raises_the_floor_over_a_key_first_granted_after_the_backup() -> None:
    issued = cycle("report:9", 3)  # the backup had no row for this key
    forget_key("report:9")

    out, _ = guard("--bump", "1000", "--apply")

    assert TokenFloor.objects.value() == 1000
    after = locks.acquire("report:9", holder="w", ttl=30)
    assert after.token == 1001 > issued
    assert "raised the token floor from 0 to 1000; bumped 0 lock counter(s) by 1000" in out


def test_without_the_floor_a_key_first_granted_after_the_backup_reissues_its_tokens() -> None:
    # The negative control: the counters alone (the guard before the floor).
    issued = cycle("report:9", 3)
    forget_key("report:9")

    restore._bump_counters(
        1000, apply=True, alias="default", batch_size=10, report=restore.RestoreReport(applied=True),
        say=restore._quiet, progress=restore._quiet,
    )

    assert locks.acquire("report:9", holder="w", ttl=30).token == 1 <= issued


def test_bump_is_a_dry_run_without_apply() -> None:
    LockFactory(key="a", token=5)

    out, _ = guard("--bump", "100", "-v", "2")

    assert Lock.objects.get(key="a").token == 5
    assert TokenFloor.objects.value() == 0
    assert "token floor: 0 -> 100" in out
    assert "lock 'a': token counter 5 -> 105" in out
    assert "would raise the token floor from 0 to 100; would bump 1 lock counter(s) by 100" in out
    assert "Dry run: nothing was changed" in out


def test_each_bump_raises_the_floor_again() -> None:
    guard("--bump", "100", "--apply")
    report = restore.bump_tokens(100, apply=True)

    assert (report.floor_before, report.floor_after) == (100, 200)
    assert locks.acquire("never-seen", holder="w", ttl=30).token == 201


def test_bump_refuses_to_take_the_floor_past_the_largest_token_and_changes_nothing() -> None:
    LockFactory(key="small", token=1)
    restore.raise_floor_to(MAX_TOKEN - 10)

    with pytest.raises(CommandError, match=r"token floor .* would pass the largest 64-bit token"):
        guard("--bump", "11", "--apply")

    assert TokenFloor.objects.value() == MAX_TOKEN - 10
    assert Lock.objects.get(key="small").token == 1


def test_bump_revokes_a_lease_recorded_in_the_restored_rows() -> None:
    held = locks.acquire("job:1", holder="paused-worker", ttl=60)

    out, err = guard("--bump", "50", "--apply")

    grant = Grant.objects.get(lock__key="job:1", token=held.token)
    assert grant.end_reason == GrantEnd.REVOKED
    lock = Lock.objects.get(key="job:1")
    assert (lock.token, lock.holder) == (held.token + 50, "")
    with pytest.raises(LeaseLost):
        locks.renew(held)
    assert locks.acquire("job:1", holder="w", ttl=30).token == held.token + 51
    assert "bumped 1 lock counter(s) by 50" in out
    assert "revoked 1 lease(s)" in out
    assert "1 lease(s) are live by the database clock: are all clients stopped?" in err


def test_bump_refuses_to_pass_the_largest_token_and_changes_nothing() -> None:
    LockFactory(key="small", token=1)
    LockFactory(key="worn", token=MAX_TOKEN - 10)

    with pytest.raises(CommandError, match=r"'worn'.*past the largest 64-bit token"):
        guard("--bump", "11", "--apply")

    assert dict(Lock.objects.values_list("key", "token")) == {"small": 1, "worn": MAX_TOKEN - 10}
    guard("--bump", "10", "--apply")
    assert Lock.objects.get(key="worn").token == MAX_TOKEN


def test_bump_goes_in_batches_with_progress() -> None:
    for number in range(5):
        LockFactory(key=f"k{number}", token=number)

    out, _ = guard("--bump", "7", "--apply", "--batch-size", "2")

    assert sorted(Lock.objects.values_list("token", flat=True)) == [7, 8, 9, 10, 11]
    assert [line for line in out.splitlines() if line.startswith("locks:")] == [
        "locks: 2/5 bumped", "locks: 4/5 bumped", "locks: 5/5 bumped",
    ]


@pytest.mark.parametrize("bad", ["0", "-3", "ten"])
def test_bump_needs_a_positive_whole_number(bad: str) -> None:
    with pytest.raises(CommandError):
        guard("--bump", bad)


def test_guard_needs_to_be_told_what_was_restored() -> None:
    with pytest.raises(CommandError, match=r"--bump N .* --raise-fences"):
        guard("--apply")


# --- --raise-fences: a resource store was restored ---------------------------------------


def test_raised_fence_refuses_every_token_issued_before_the_guard() -> None:
    FenceFactory(resource="mailbox-1", lock_key="mailer:1")  # restored watermark: 0
    early = locks.acquire("mailer:1", holder="A", ttl=30)
    locks.release(early)
    last = locks.acquire("mailer:1", holder="B", ttl=30)  # still live at the restore

    guard("--raise-fences", "--apply")

    row = Fence.objects.get(resource="mailbox-1")
    assert (row.token, row.step) == (last.token, restore.CLOSED_STEP)
    with pytest.raises(StaleToken), fence("mailbox-1", early):
        pass
    with pytest.raises(DuplicateWrite), fence("mailbox-1", last):
        pass
    assert Grant.objects.get(token=last.token).end_reason == GrantEnd.REVOKED
    fresh = locks.acquire("mailer:1", holder="C", ttl=30)
    with fence("mailbox-1", fresh) as accepted:
        assert accepted.token == fresh.token


def test_raise_fences_raises_fenced_model_rows_from_their_fence_lock() -> None:
    guarded, unlocked = AccountFactory(), AccountFactory()
    key = f"account:{guarded.pk}"
    stale = locks.acquire(key, holder="A", ttl=30)
    locks.release(stale)
    cycle(key, 2)

    out, _ = guard("--raise-fences", "--apply", "-v", "2")

    row = Account.objects.get(pk=guarded.pk)
    assert (row.fence, row.fence_step) == (stale.token + 2, restore.CLOSED_STEP)
    assert Account.objects.get(pk=unlocked.pk).fence == 0  # no lock: nothing issued
    with pytest.raises(StaleToken):
        Account.objects.filter(pk=guarded.pk).fenced_update(stale, balance=Decimal("1"))
    assert f"demo.account:{guarded.pk}: fence 0 -> {stale.token + 2} (closed)" in out
    assert "1 demo.account row(s)" in out


def test_raise_fences_is_idempotent() -> None:
    FenceFactory(resource="mailbox-1", lock_key="mailer:1")
    cycle("mailer:1", 2)
    guard("--raise-fences", "--apply")
    before = list(Fence.objects.values_list("resource", "token", "step", "updated_at"))

    out, _ = guard("--raise-fences", "--apply")

    assert list(Fence.objects.values_list("resource", "token", "step", "updated_at")) == before
    assert "Nothing to change: already guarded." in out


def test_raise_fences_dry_run_changes_nothing() -> None:
    FenceFactory(resource="mailbox-1", lock_key="mailer:1")
    held = locks.acquire("mailer:1", holder="A", ttl=30)

    out, _ = guard("--raise-fences", "-v", "2")

    assert Fence.objects.get(resource="mailbox-1").token == 0
    assert Lock.objects.get(key="mailer:1").holder == "A"
    assert f"fence 'mailbox-1': watermark 0 -> {held.token} (closed)" in out
    assert "lock 'mailer:1': revoking the lease of A" in out
    assert "would raise 1 fence(s)" in out


def test_raise_fences_never_lowers_a_watermark_ahead_of_its_lock() -> None:
    FenceFactory(resource="mailbox-1", lock_key="mailer:1", token=90, step=2)
    LockFactory(key="mailer:1", token=7)  # the lock database is the one behind

    _, err = guard("--raise-fences", "--apply")

    assert Fence.objects.values_list("token", "step").get() == (90, 2)
    assert "above lock 'mailer:1'" in err
    assert "Run --bump N as well" in err


def test_raise_fences_closes_the_tokens_of_a_key_the_restored_lock_rows_never_saw() -> None:
    FenceFactory(resource="report-9", lock_key="report:9")  # the backup had the fence at 0
    early = locks.acquire("report:9", holder="paused", ttl=30)  # granted after the backup
    forget_key("report:9")

    guard("--bump", "50", "--raise-fences", "--apply")

    assert Fence.objects.values_list("token", "step").get() == (50, restore.CLOSED_STEP)
    with pytest.raises(StaleToken), fence("report-9", early):
        pass
    fresh = locks.acquire("report:9", holder="w", ttl=30)
    assert fresh.token == 51
    with fence("report-9", fresh) as accepted:
        assert accepted.token == 51


def test_raise_fences_closes_a_fenced_model_row_of_a_key_the_restored_lock_rows_never_saw() -> None:
    account = AccountFactory()  # restored with its fence at 0
    key = f"account:{account.pk}"
    early = locks.acquire(key, holder="paused", ttl=30)  # granted after the backup
    forget_key(key)

    guard("--bump", "50", "--raise-fences", "--apply")

    assert Account.objects.values_list("fence", "fence_step").get(pk=account.pk) == (
        50, restore.CLOSED_STEP
    )
    with pytest.raises(StaleToken):
        Account.objects.filter(pk=account.pk).fenced_update(early, balance=Decimal("1"))
    fresh = locks.acquire(key, holder="w", ttl=30)
    assert Account.objects.filter(pk=account.pk).fenced_update(fresh, balance=Decimal("2")) == 1


def test_a_watermark_under_the_floor_is_not_ahead_of_its_lock() -> None:
    # A resource store that was not restored, beside a restored and guarded lock database.
    FenceFactory(resource="report-9", lock_key="report:9", token=3, step=1)
    restore.raise_floor_to(1000)

    out, err = guard("--raise-fences", "--apply")

    assert "above lock" not in err
    assert Fence.objects.values_list("token", "step").get() == (1000, restore.CLOSED_STEP)
    assert "raised 1 fence(s)" in out


def test_bump_and_raise_together_for_one_restored_database() -> None:
    FenceFactory(resource="mailbox-1", lock_key="mailer:1")
    cycle("mailer:1", 2)

    dry, _ = guard("--bump", "100", "--raise-fences", "-v", "2")
    assert "fence 'mailbox-1': watermark 0 -> 102 (closed)" in dry
    guard("--bump", "100", "--raise-fences", "--apply")

    assert Fence.objects.values_list("token", "step").get() == (102, restore.CLOSED_STEP)
    assert locks.acquire("mailer:1", holder="w", ttl=30).token == 103


def test_row_key_refuses_values_no_grant_can_match() -> None:
    assert restore._row_key(Account, "account:{pk}", {"pk": 7}) == "account:7"
    assert restore._row_key(Account, "account:{pk}", {"pk": "a:b"}) is None


def test_a_lock_acquired_after_the_listing_is_still_revoked_and_bumped() -> None:
    LockFactory(key="job:1", token=5)
    raced: list[locks.Lease] = []

    def acquire_meanwhile(line: str) -> None:
        if not raced and line.startswith("lock "):  # between the listing and the row locks
            raced.append(locks.acquire("job:1", holder="late", ttl=30))

    report = restore.bump_tokens(10, apply=True, say=acquire_meanwhile)

    assert Grant.objects.get(token=raced[0].token).end_reason == GrantEnd.REVOKED
    assert Lock.objects.values_list("token", "holder").get() == (raced[0].token + 10, "")
    assert (report.locks_bumped, report.leases_revoked) == (1, 1)
