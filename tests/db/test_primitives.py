"""Reentrancy within one execution, several keys at once, fences over several grants,
and counting semaphores whose permits are fenced per slot."""

from __future__ import annotations

import pytest
from django.db import transaction

from coordination import locks
from coordination.exceptions import (
    DuplicateWrite,
    InTransaction,
    InvalidInput,
    LockHeld,
    StaleToken,
    WrongLock,
)
from coordination.fencing import fence
from coordination.models import Fence, Grant, Lock, Rejection
from coordination.semaphores import MAX_PERMITS, acquire_permit, permit_keys, permit_slot
from tests.support.waiting import wait_until_database_time_passes

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("grant_point")]


# --- reentrancy ---------------------------------------------------------------


def test_a_reentrant_acquire_returns_the_same_lease_and_the_outermost_release_ends_it() -> None:
    outer = locks.acquire("job:1", holder="worker-a", ttl=30, reentrant=True)
    inner = locks.acquire("job:1", holder="worker-a", ttl=30, reentrant=True)

    assert inner is outer and inner.token == outer.token
    assert locks.reentrant_count(outer) == 2
    assert Grant.objects.filter(lock__key="job:1").count() == 1  # one grant, counted twice

    locks.release(inner)
    assert locks.reentrant_count(outer) == 1
    assert Lock.objects.get(key="job:1").holder == "worker-a"  # still held
    assert outer.ended_at is None

    locks.release(outer)
    assert locks.reentrant_count(outer) == 0
    assert Lock.objects.get(key="job:1").holder == ""
    assert outer.end_reason == "released"
    assert locks.acquire("job:1", holder="worker-b", ttl=30).token == outer.token + 1


def test_without_reentrant_a_second_acquire_by_the_same_holder_is_refused_as_before() -> None:
    locks.acquire("job:2", holder="worker-a", ttl=30)

    with pytest.raises(LockHeld):
        locks.acquire("job:2", holder="worker-a", ttl=30)
    # A plain grant is not reentered either: reentrancy is opt-in on every acquire.
    with pytest.raises(LockHeld):
        locks.acquire("job:2", holder="worker-a", ttl=30, reentrant=True)


def test_a_reentrant_hold_then_a_plain_acquire_is_refused() -> None:
    with locks.hold("job:3", holder="worker-a", ttl=30, reentrant=True), pytest.raises(LockHeld):
        locks.acquire("job:3", holder="worker-a", ttl=30)


def test_nested_reentrant_holds_share_the_lease_and_only_the_outer_exit_releases() -> None:
    with locks.hold("job:4", holder="worker-a", ttl=30, reentrant=True) as outer:
        with locks.hold("job:4", holder="worker-a", ttl=30, reentrant=True) as inner:
            assert inner is outer
            assert locks.current_grant() is outer
        assert Lock.objects.get(key="job:4").holder == "worker-a"
        assert locks.current_grant() is outer
    assert Lock.objects.get(key="job:4").holder == ""


def test_another_holder_in_the_same_execution_is_another_party() -> None:
    locks.acquire("job:5", holder="worker-a", ttl=30, reentrant=True)

    with pytest.raises(LockHeld):
        locks.acquire("job:5", holder="worker-b", ttl=30, reentrant=True)


def test_a_lost_lease_is_not_reentered() -> None:
    first = locks.acquire("job:6", holder="worker-a", ttl=30, reentrant=True)
    first.mark_lost()
    locks.revoke("job:6")

    again = locks.acquire("job:6", holder="worker-a", ttl=30, reentrant=True)

    assert again is not first and again.token == first.token + 1
    assert locks.reentrant_count(again) == 1


# --- several keys at once ----------------------------------------------------------


def test_acquire_many_grants_every_key_in_sorted_order_each_with_its_own_token() -> None:
    locks.release(locks.acquire("acct:b", holder="earlier", ttl=30))

    grants = locks.acquire_many(["acct:c", "acct:b", "acct:a", "acct:b"], holder="mover", ttl=30)

    assert list(grants) == ["acct:a", "acct:b", "acct:c"]
    assert {key: lease.token for key, lease in grants.items()} == {
        "acct:a": 1, "acct:b": 2, "acct:c": 1,
    }
    for key, lease in grants.items():
        assert (lease.key, lease.holder) == (key, "mover")
        assert Lock.objects.get(key=key).holder == "mover"

    assert locks.release_many(grants) == list(grants.values())
    assert set(Lock.objects.filter(key__startswith="acct:").values_list("holder", flat=True)) == {""}


def test_acquire_many_grants_none_when_one_key_is_held() -> None:
    held = locks.acquire("acct:m", holder="other", ttl=30)

    with pytest.raises(LockHeld) as refused:
        locks.acquire_many(["acct:l", "acct:m", "acct:n"], holder="mover", ttl=30)

    assert refused.value.key == "acct:m"
    # acct:l was granted inside the transaction before acct:m refused: rolled back.
    assert not Grant.objects.filter(lock__key__in=["acct:l", "acct:n"]).exists()
    assert not Lock.objects.filter(key__in=["acct:l", "acct:n"]).exclude(holder="").exists()
    locks.release(held)
    later = locks.acquire_many(["acct:l", "acct:m", "acct:n"], holder="mover", ttl=30)
    assert later["acct:m"].token == held.token + 1
    # The rolled-back grant's token was never seen: the key issues it now.
    assert later["acct:l"].token == 1


def test_acquire_many_refuses_bad_input_and_the_callers_transaction() -> None:
    with pytest.raises(InvalidInput):
        locks.acquire_many("acct:x", holder="mover")  # one string, not a collection
    with pytest.raises(InvalidInput):
        locks.acquire_many([], holder="mover")
    with pytest.raises(InvalidInput):
        locks.acquire_many(
            [f"k{n}" for n in range(locks.MAX_KEYS_AT_ONCE + 1)], holder="mover"
        )
    with pytest.raises(InvalidInput):
        locks.acquire_many(["ok", ""], holder="mover")
    with transaction.atomic(), pytest.raises(InTransaction):
        locks.acquire_many(["acct:y", "acct:z"], holder="mover")


# --- fences over several grants -----------------------------------------------------


def test_fence_takes_the_grants_of_acquire_many_for_rows_guarded_by_different_keys() -> None:
    grants = locks.acquire_many(["acct:1", "acct:2"], holder="mover", ttl=30)

    with fence(["acct:1", "acct:2"], grants) as rows:
        assert [(row.resource, row.lock_key) for row in rows] == [
            ("acct:1", "acct:1"), ("acct:2", "acct:2"),
        ]

    watermarks = dict(Fence.objects.values_list("resource", "token"))
    assert watermarks == {"acct:1": grants["acct:1"].token, "acct:2": grants["acct:2"].token}
    locks.release_many(grants)

    # A newer grant of acct:2 writes; the old pair is then refused as a whole.
    newer = locks.acquire("acct:2", holder="next", ttl=30)
    with fence("acct:2", newer):
        pass
    before = dict(Fence.objects.values_list("resource", "step"))
    with pytest.raises(StaleToken), fence(["acct:1", "acct:2"], grants):
        pytest.fail("the block of a refused fence ran")
    assert dict(Fence.objects.values_list("resource", "step")) == before
    assert Rejection.objects.filter(resource="acct:2", token=grants["acct:2"].token).exists()


def test_a_pair_holder_paused_past_its_leases_is_refused_after_the_next_pair_wrote() -> None:
    paused = locks.acquire_many(["acct:5", "acct:6"], holder="paused", ttl=0.5)
    with fence(["acct:5", "acct:6"], paused):
        pass
    wait_until_database_time_passes(max(lease.expires_at for lease in paused.values()))

    # Both leases expired: the next acquire_many takes both keys over.
    successor = locks.acquire_many(["acct:5", "acct:6"], holder="next", ttl=30)
    assert {key: lease.token for key, lease in successor.items()} == {"acct:5": 2, "acct:6": 2}
    with fence("acct:6", successor["acct:6"]):
        pass

    # The paused holder resumes: one of its two rows has a newer watermark, so
    # the whole write is refused, the row nobody newer wrote included.
    with pytest.raises(StaleToken), fence(["acct:5", "acct:6"], paused):
        pytest.fail("the late write of the paused pair holder ran")
    assert Fence.objects.get(resource="acct:5").token == paused["acct:5"].token


def test_fence_with_several_grants_refuses_a_row_none_of_them_guards() -> None:
    Fence.objects.create(resource="ledger", lock_key="ledger-lock")
    grants = locks.acquire_many(["acct:3", "acct:4"], holder="mover", ttl=30)

    with pytest.raises(WrongLock), fence(["acct:3", "ledger"], grants):
        pytest.fail("the block of a refused fence ran")
    # A new fence row needs a grant named like it when there are several.
    with pytest.raises(InvalidInput), fence(["acct:3", "journal"], grants):
        pytest.fail("the block ran")
    # The same grants twice for the same step are a duplicate, per lease.
    with fence(["acct:3", "acct:4"], grants, step=5):
        pass
    with pytest.raises(DuplicateWrite), fence(["acct:3", "acct:4"], grants, step=5):
        pytest.fail("the block ran")


# --- counting semaphores ---------------------------------------------------------------


def test_permits_are_slots_each_with_its_own_token_and_at_most_limit_are_granted() -> None:
    permits = [
        acquire_permit("export", limit=3, holder=f"worker-{n}", ttl=30) for n in range(3)
    ]

    assert sorted(permit_slot(permit) for permit in permits) == [1, 2, 3]
    assert {permit.key for permit in permits} == {"export@1", "export@2", "export@3"}
    assert [permit.token for permit in permits] == [1, 1, 1]
    with pytest.raises(LockHeld) as refused:
        acquire_permit("export", limit=3, holder="worker-4", ttl=30)
    assert refused.value.holder == "all 3 permits of 'export'"
    assert refused.value.retry_after > 0

    locks.release(permits[1])  # a permit is a lease: the lock API releases it
    fourth = acquire_permit("export", limit=3, holder="worker-4", ttl=30)
    assert (fourth.key, fourth.token) == (permits[1].key, 2)


def test_permit_names_and_limits_are_checked() -> None:
    assert permit_keys("export", 2) == ["export@1", "export@2"]
    for limit in (0, -1, True, 1.5, MAX_PERMITS + 1):
        with pytest.raises(InvalidInput):
            acquire_permit("export", limit=limit, holder="worker-a")  # type: ignore[arg-type]
    with pytest.raises(InvalidInput):
        acquire_permit("bad key", limit=2, holder="worker-a")
    with transaction.atomic(), pytest.raises(InTransaction):
        acquire_permit("export", limit=2, holder="worker-a")


def test_a_paused_permit_holder_is_refused_by_its_slots_fence_and_the_other_slot_runs_on() -> None:
    # The other slot is taken first: taken after, it could find the paused
    # holder's short permit already run out and take that slot instead.
    running = acquire_permit("report", limit=2, holder="running", ttl=30)
    paused = acquire_permit("report", limit=2, holder="paused", ttl=0.5)
    assert paused.key != running.key
    with fence(paused.key, paused):
        pass
    wait_until_database_time_passes(paused.expires_at)

    # The only grantable slot is the paused holder's: its next token goes to "next".
    successor = acquire_permit("report", limit=2, holder="next", ttl=30)
    assert (successor.key, successor.token) == (paused.key, paused.token + 1)
    with fence(successor.key, successor):
        pass

    with pytest.raises(StaleToken), fence(paused.key, paused):
        pytest.fail("the late write of the paused permit holder ran")
    with fence(running.key, running):  # the other slot is not disturbed
        pass
