"""Shared (read) mode: many readers at once, writers exclusive, one token counter per
key, so a writer's token is above every reader token issued before it and the
fence refuses a reader's late write (docs/primitives.md)."""

from __future__ import annotations

import pytest
from django.db import transaction

from coordination import locks
from coordination.exceptions import InTransaction, LeaseLost, LockHeld, StaleToken
from coordination.fencing import fence
from coordination.models import Grant, GrantEnd, GrantMode, Lock, Ticket
from coordination.shared import acquire_shared
from tests.support.waiting import wait_until_database_time_passes

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("grant_point")]


def test_readers_share_a_key_each_with_the_next_token_and_the_mode_recorded() -> None:
    first = acquire_shared("doc:1", holder="reader-a", ttl=30)
    second = acquire_shared("doc:1", holder="reader-b", ttl=30)

    assert (first.mode, second.mode) == ("shared", "shared")
    assert second.token == first.token + 1
    assert list(
        Grant.objects.filter(lock__key="doc:1").order_by("token").values_list("holder", "mode")
    ) == [("reader-a", GrantMode.SHARED), ("reader-b", GrantMode.SHARED)]
    lock = Lock.objects.get(key="doc:1")
    assert (lock.token, lock.holder) == (second.token, "2 shared holders")
    assert lock.expires_at == max(first.expires_at, second.expires_at)


def test_a_writer_waits_for_every_reader_and_gets_a_token_above_theirs() -> None:
    readers = [acquire_shared("doc:2", holder=f"reader-{n}", ttl=30) for n in range(3)]

    with pytest.raises(LockHeld) as held:
        locks.acquire("doc:2", holder="writer", ttl=30)
    assert "3 shared holders" in held.value.detail
    for reader in readers[:2]:
        locks.release(reader)
    with pytest.raises(LockHeld):  # one reader left is enough to refuse a writer
        locks.acquire("doc:2", holder="writer", ttl=30)
    assert Lock.objects.get(key="doc:2").holder == "1 shared holder"

    locks.release(readers[2])
    writer = locks.acquire("doc:2", holder="writer", ttl=30)
    assert writer.mode == "exclusive"
    assert writer.token > max(reader.token for reader in readers)
    assert Grant.objects.get(lock__key="doc:2", token=writer.token).mode == GrantMode.EXCLUSIVE
    assert {r.end_reason for r in readers} == {"released"}


def test_a_reader_is_refused_while_a_writer_holds_and_granted_after_it() -> None:
    writer = locks.acquire("doc:3", holder="writer", ttl=30)
    with pytest.raises(LockHeld) as held:
        acquire_shared("doc:3", holder="reader", ttl=30)
    assert held.value.holder == "writer"

    locks.release(writer)
    reader = acquire_shared("doc:3", holder="reader", ttl=30)
    assert reader.token == writer.token + 1


def test_a_reader_paused_past_its_lease_is_refused_after_a_writer_wrote() -> None:
    reader = acquire_shared("doc:4", holder="paused reader", ttl=0.5)
    with fence("doc:4", reader):  # the reader's first, read-derived write
        pass
    wait_until_database_time_passes(reader.expires_at)

    writer = locks.acquire("doc:4", holder="writer", ttl=30)  # takes the expired group over
    assert writer.token == reader.token + 1
    with fence("doc:4", writer):
        pass

    with pytest.raises(StaleToken), fence("doc:4", reader):
        pytest.fail("the late write of the paused reader ran")
    with pytest.raises(LeaseLost):
        locks.renew(reader, ttl=30)
    assert reader.lost


def test_renewing_a_reader_extends_the_group_and_the_last_release_frees_the_lock() -> None:
    short = acquire_shared("doc:5", holder="short", ttl=30)
    long = acquire_shared("doc:5", holder="long", ttl=30)
    locks.renew(long, ttl=120)
    assert Lock.objects.get(key="doc:5").expires_at == long.expires_at
    assert Grant.objects.get(lock__key="doc:5", token=long.token).expires_at == long.expires_at

    locks.release(long)
    lock = Lock.objects.get(key="doc:5")
    assert (lock.holder, lock.expires_at) == ("1 shared holder", short.expires_at)
    locks.release(short)
    assert Lock.objects.get(key="doc:5").holder == ""
    with pytest.raises(LeaseLost):  # released: never renewed again
        locks.renew(short, ttl=30)


def test_a_shorter_renewal_of_the_last_reader_ends_the_group_earlier() -> None:
    reader = acquire_shared("doc:11", holder="reader", ttl=60)
    locks.renew(reader, ttl=0.5)
    assert Lock.objects.get(key="doc:11").expires_at == reader.expires_at
    wait_until_database_time_passes(reader.expires_at)
    writer = locks.acquire("doc:11", holder="writer", ttl=30, lock_delay=0)
    assert writer.token == reader.token + 1


def test_an_expired_reader_is_not_renewed_and_its_release_says_it_ran_past_its_lease() -> None:
    stale = acquire_shared("doc:6", holder="stale", ttl=0.5, lock_delay=0)
    live = acquire_shared("doc:6", holder="live", ttl=30)
    wait_until_database_time_passes(stale.expires_at)

    with pytest.raises(LeaseLost):
        locks.renew(stale, ttl=30)
    with pytest.raises(LeaseLost):
        locks.release(stale)
    assert Grant.objects.get(lock__key="doc:6", token=stale.token).end_reason == GrantEnd.EXPIRED
    assert Lock.objects.get(key="doc:6").holder == "1 shared holder"  # the live reader holds on
    locks.renew(live, ttl=30)


def test_readers_of_a_revoked_group_never_join_a_later_group() -> None:
    first = acquire_shared("doc:7", holder="first", ttl=30)
    newest = acquire_shared("doc:7", holder="newest", ttl=30)
    revoked = locks.revoke("doc:7")
    assert revoked is not None and (revoked.token, revoked.mode) == (newest.token, GrantMode.SHARED)
    assert set(
        Grant.objects.filter(lock__key="doc:7").values_list("end_reason", flat=True)
    ) == {GrantEnd.REVOKED}  # every reader of the group, not only the newest
    with pytest.raises(LeaseLost):
        locks.renew(first, ttl=30)

    later = acquire_shared("doc:7", holder="later", ttl=30)
    assert later.token == newest.token + 1
    with pytest.raises(LeaseLost):  # a new group: the revoked readers are not in it
        locks.renew(first, ttl=30)
    assert Grant.objects.get(lock__key="doc:7", token=first.token).end_reason == GrantEnd.REVOKED


def test_a_fairly_queued_writer_is_not_overtaken_by_new_readers() -> None:
    reader = acquire_shared("doc:8", holder="reader", ttl=30)
    Ticket.objects.create(
        lock_key="doc:8", holder="fair writer", expires_at=locks.database_now().replace(year=2100)
    )
    with pytest.raises(LockHeld) as held:
        acquire_shared("doc:8", holder="another reader", ttl=30)
    assert "fair waiter" in held.value.detail
    Ticket.objects.filter(lock_key="doc:8").delete()
    acquire_shared("doc:8", holder="another reader", ttl=30)
    locks.release(reader)


def test_a_shared_grant_is_refused_inside_the_callers_transaction() -> None:
    with transaction.atomic(), pytest.raises(InTransaction):
        acquire_shared("doc:9", holder="reader", ttl=30)


def test_grant_from_proof_carries_the_mode() -> None:
    reader = acquire_shared("doc:10", holder="reader", ttl=30)
    proved = locks.grant_from_proof("doc:10", reader.token, reader.lease_id)
    assert (proved.mode, proved.token) == ("shared", reader.token)
