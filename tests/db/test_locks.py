"""The grant point: acquire, renew, release, revoke, hold."""

from __future__ import annotations

import dataclasses
import datetime as dt
import math
import pickle

import pytest
from django.db import IntegrityError, transaction

from coordination import locks
from coordination.exceptions import (
    CoordinationError,
    InTransaction,
    InvalidInput,
    LeaseLost,
    LockHeld,
    TokenExhausted,
)
from coordination.locks import Lease
from coordination.models import MAX_TOKEN, Grant, GrantEnd, Lock, LockState, hash_lease_id
from tests.support.factories import LockFactory
from tests.support.waiting import wait_until_database_time_passes

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("grant_point")]


def test_first_acquire_creates_the_lock_and_issues_token_one() -> None:
    grant = locks.acquire("account:7", holder="worker-a", ttl=10)

    assert (grant.key, grant.token, grant.holder) == ("account:7", 1, "worker-a")
    lock = Lock.objects.get(key="account:7")
    assert (lock.token, lock.holder, lock.expires_at) == (1, "worker-a", grant.expires_at)
    assert grant.expires_at - grant.acquired_at == dt.timedelta(seconds=10)


def test_the_returned_lease_is_a_handle_matching_its_grant_row() -> None:
    lease = locks.acquire("account:8", holder="worker-a", ttl=10)

    assert isinstance(lease, Lease)
    stored = Grant.objects.of(lease).select_related("lock").get()
    assert (stored.key, stored.token, stored.holder, stored.acquired_at, stored.expires_at) == (
        lease.key, lease.token, lease.holder, lease.acquired_at, lease.expires_at,
    )
    assert (stored.ended_at, stored.end_reason) == (None, "")
    assert (lease.ended_at, lease.end_reason, lease.lost) == (None, "", False)
    assert not hasattr(stored, "lease_id")  # the row keeps only the hash


def test_lease_times_are_aware_utc_as_the_orm_loads_them() -> None:
    """The grant point reads its results with a cursor of its own: its times are
    the same aware UTC datetimes, with the same tzinfo, as the ORM's."""
    lease = locks.acquire("account:9", holder="worker-a", ttl=10)
    ended = locks.release(lease)
    stored = Grant.objects.of(lease).get()

    for value, orm in ((lease.acquired_at, stored.acquired_at), (ended.ended_at, stored.ended_at)):
        assert value is not None and orm is not None
        assert (value, value.tzinfo) == (orm, orm.tzinfo)
        assert value.utcoffset() == dt.timedelta(0)


def test_a_lease_pickles_and_its_repr_never_shows_the_secret() -> None:
    lease = locks.acquire("account:9", holder="worker-a", ttl=10)
    lease.next_step()

    assert lease.lease_id not in repr(lease) and "lease_id" not in repr(lease)
    copy = pickle.loads(pickle.dumps(lease))
    assert (copy.key, copy.token, copy.lease_id, copy.holder, copy.expires_at, copy.steps) == (
        lease.key, lease.token, lease.lease_id, lease.holder, lease.expires_at, 1,
    )
    locks.release(copy)  # the copy proves the grant as well as the original
    assert Grant.objects.of(lease).get().end_reason == GrantEnd.RELEASED


def test_tokens_strictly_increase_across_grants_of_a_key() -> None:
    tokens = []
    for n in range(5):
        grant = locks.acquire("report", holder=f"w{n}", ttl=5)
        tokens.append(grant.token)
        locks.release(grant)

    assert tokens == [1, 2, 3, 4, 5]


def test_tokens_are_counted_per_key() -> None:
    a = locks.acquire("a", holder="x", ttl=5)
    b = locks.acquire("b", holder="x", ttl=5)

    assert (a.token, b.token) == (1, 1)


def test_busy_lock_raises_lock_held_naming_holder_and_wait() -> None:
    first = locks.acquire("invoice:7", holder="worker-3", ttl=20)

    with pytest.raises(LockHeld) as caught:
        locks.acquire("invoice:7", holder="worker-4", ttl=5)

    held = caught.value
    assert held.holder == "worker-3"
    assert held.expires_at == first.expires_at
    assert 15 < held.retry_after <= 20
    assert "held by worker-3" in str(held) and "retry after" in str(held)
    assert held.as_dict()["code"] == "lock_held"
    assert Lock.objects.get(key="invoice:7").token == 1  # a refusal issues no token


def test_lease_id_is_a_secret_only_its_hash_is_stored() -> None:
    grant = locks.acquire("k", holder="a", ttl=5)

    assert len(grant.lease_id) >= 32
    stored = Grant.objects.of(grant).get()
    assert stored.lease_hash == hash_lease_id(grant.lease_id) != grant.lease_id
    assert Lock.objects.get(key="k").lease_hash == stored.lease_hash


def test_expired_lease_frees_the_lock_and_records_the_old_grant_as_expired() -> None:
    a = locks.acquire("account:1", holder="A", ttl=0.2)
    wait_until_database_time_passes(a.expires_at)

    b = locks.acquire("account:1", holder="B", ttl=5)

    assert b.token == a.token + 1
    old = Grant.objects.of(a).get()
    assert (old.end_reason, old.ended_at) == (GrantEnd.EXPIRED, a.expires_at)
    assert b.acquired_at >= a.expires_at


def test_lock_state_is_computed_with_the_database_clock() -> None:
    held = locks.acquire("s:held", holder="A", ttl=30)
    expired = locks.acquire("s:expired", holder="A", ttl=0.1)
    released = locks.acquire("s:free", holder="A", ttl=30)
    locks.release(released)
    wait_until_database_time_passes(expired.expires_at)

    states = dict(Lock.objects.with_state().values_list("key", "state"))

    assert states == {"s:held": "held", "s:expired": "expired", "s:free": "free"}
    assert set(Lock.objects.held().values_list("key", flat=True)) == {held.key}
    assert set(Lock.objects.expired().values_list("key", flat=True)) == {expired.key}
    now = locks.database_now()
    assert Lock.objects.get(key="s:held").state_at(now) is LockState.HELD


def test_renew_extends_the_lease_from_database_now() -> None:
    grant = locks.acquire("r", holder="a", ttl=10)
    before = grant.expires_at

    locks.renew(grant, ttl=60)

    assert grant.expires_at > before + dt.timedelta(seconds=49)
    assert Lock.objects.get(key="r").expires_at == grant.expires_at
    assert Grant.objects.of(grant).get().expires_at == grant.expires_at


def test_renew_by_a_non_holder_is_lease_lost() -> None:
    grant = locks.acquire("r", holder="a", ttl=30)
    forged = dataclasses.replace(grant, lease_id="not-the-secret")

    with pytest.raises(LeaseLost, match="lease_id does not match"):
        locks.renew(forged, ttl=30)
    with pytest.raises(LeaseLost):
        locks.release(forged)

    assert forged.lost
    assert Lock.objects.get(key="r").holder == "a"  # a wrong proof changed nothing


def test_renew_after_expiry_is_lease_lost_and_marks_the_grant_lost() -> None:
    grant = locks.acquire("r", holder="a", ttl=0.1)
    wait_until_database_time_passes(grant.expires_at)

    with pytest.raises(LeaseLost, match="expired"):
        locks.renew(grant, ttl=5)
    assert grant.lost


def test_renew_after_takeover_is_lease_lost() -> None:
    a = locks.acquire("r", holder="a", ttl=0.1)
    wait_until_database_time_passes(a.expires_at)
    b = locks.acquire("r", holder="b", ttl=30)

    with pytest.raises(LeaseLost, match="taken over"):
        locks.renew(a, ttl=5)
    # Releasing the old grant must never release the newer holder's lease.
    with pytest.raises(LeaseLost):
        locks.release(a)
    assert Lock.objects.get(key="r").holder == "b"
    locks.renew(b, ttl=5)


def test_release_frees_the_lock_and_ends_the_grant() -> None:
    grant = locks.acquire("rel", holder="a", ttl=30)

    ended = locks.release(grant)

    assert ended.end_reason == GrantEnd.RELEASED
    lock = Lock.objects.get(key="rel")
    assert (lock.holder, lock.lease_hash, lock.expires_at, lock.token) == ("", "", None, 1)
    assert Grant.objects.of(grant).get().end_reason == GrantEnd.RELEASED
    assert locks.acquire("rel", holder="b", ttl=5).token == 2


def test_release_twice_is_lease_lost() -> None:
    grant = locks.acquire("rel", holder="a", ttl=30)
    locks.release(grant)

    with pytest.raises(LeaseLost, match="free"):
        locks.release(grant)


def test_release_after_expiry_frees_the_lock_but_reports_lease_lost() -> None:
    grant = locks.acquire("rel", holder="a", ttl=0.1)
    wait_until_database_time_passes(grant.expires_at)

    with pytest.raises(LeaseLost, match="expired"):
        locks.release(grant)

    assert Lock.objects.get(key="rel").holder == ""
    assert Grant.objects.of(grant).get().end_reason == GrantEnd.EXPIRED


def test_revoke_ends_the_lease_and_the_next_grant_gets_a_higher_token() -> None:
    grant = locks.acquire("job", holder="stuck-worker", ttl=300)

    revoked = locks.revoke("job")

    assert revoked is not None and revoked.token == grant.token
    assert revoked.end_reason == GrantEnd.REVOKED
    with pytest.raises(LeaseLost):
        locks.renew(grant, ttl=5)
    assert locks.acquire("job", holder="operator", ttl=5).token == grant.token + 1
    assert locks.revoke("never-used") is None


def test_hold_releases_on_success_and_on_error_and_sets_the_current_grant() -> None:
    with locks.hold("h", holder="a", ttl=5) as grant:
        assert locks.current_grant() is grant
    assert locks.current_grant() is None
    assert Lock.objects.get(key="h").holder == ""

    with pytest.raises(ZeroDivisionError), locks.hold("h", holder="a", ttl=5):
        1 / 0  # noqa: B018
    assert Lock.objects.get(key="h").holder == ""
    assert list(Grant.objects.values_list("end_reason", flat=True)) == ["released"] * 2


def test_wait_acquires_when_the_current_lease_ends() -> None:
    first = locks.acquire("w", holder="a", ttl=0.3)

    second = locks.acquire("w", holder="b", ttl=5, wait=10)

    assert second.token == first.token + 1
    assert second.acquired_at >= first.expires_at


def test_wait_gives_up_with_lock_held_after_its_budget() -> None:
    locks.acquire("w", holder="a", ttl=30)

    with pytest.raises(LockHeld):
        locks.acquire("w", holder="b", ttl=5, wait=0.2)


def test_grant_point_refuses_to_run_inside_a_caller_transaction() -> None:
    with transaction.atomic(), pytest.raises(InTransaction):
        locks.acquire("t", holder="a", ttl=5)
    assert not Lock.objects.filter(key="t").exists()


@pytest.mark.parametrize(
    "key",
    ["", "x" * 201, "has space", "slash/inside", "émoji", "-leading", "new\nline", None, 7],
)
def test_bad_keys_are_refused_with_a_clear_error(key: object) -> None:
    with pytest.raises(InvalidInput) as caught:
        locks.acquire(key, holder="a", ttl=5)  # type: ignore[arg-type]
    assert caught.value.code == "invalid"
    assert not Lock.objects.exists()


@pytest.mark.parametrize("key", ["a", "account:7", "tenant.acme:invoice_2026-11@eu", "x" * 200])
def test_good_keys_are_accepted(key: str) -> None:
    assert locks.acquire(key, holder="a", ttl=5).key == key


@pytest.mark.parametrize("ttl", [0, -1, 0.001, 10**9, math.nan, math.inf, True, "10", [5]])
def test_bad_ttls_are_refused(ttl: object) -> None:
    with pytest.raises(InvalidInput):
        locks.acquire("k", holder="a", ttl=ttl)  # type: ignore[arg-type]
    assert not Lock.objects.exists()


@pytest.mark.parametrize("holder", ["", "   ", "x" * 201, "tab\there", 5])
def test_bad_holders_are_refused(holder: object) -> None:
    with pytest.raises(InvalidInput):
        locks.acquire("k", holder=holder, ttl=5)  # type: ignore[arg-type]


def test_bad_wait_is_refused() -> None:
    for wait in (-1, math.nan, "1"):
        with pytest.raises(InvalidInput):
            locks.acquire("k", holder="a", ttl=5, wait=wait)  # type: ignore[arg-type]


def test_token_exhaustion_raises_instead_of_wrapping() -> None:
    LockFactory(key="old", token=MAX_TOKEN - 1)

    last = locks.acquire("old", holder="a", ttl=5)
    locks.release(last)

    assert last.token == MAX_TOKEN
    with pytest.raises(TokenExhausted):
        locks.acquire("old", holder="a", ttl=5)
    assert Lock.objects.get(key="old").token == MAX_TOKEN


def test_database_refuses_negative_counters_and_repeated_grant_tokens() -> None:
    with pytest.raises(IntegrityError), transaction.atomic():
        LockFactory(key="neg", token=-1)
    grant = locks.acquire("dup", holder="a", ttl=5)
    with pytest.raises(IntegrityError), transaction.atomic():
        Grant.objects.create(
            lock=Lock.objects.get(key="dup"), token=grant.token, holder="b", lease_hash="x",
            acquired_at=grant.acquired_at, expires_at=grant.expires_at,
        )


def test_errors_share_one_base_with_stable_codes() -> None:
    codes = {
        cls.code
        for cls in (InvalidInput, LockHeld, LeaseLost, TokenExhausted, InTransaction)
    }
    assert codes == {"invalid", "lock_held", "lease_lost", "token_exhausted", "in_transaction"}
    assert all(issubclass(cls, CoordinationError) for cls in (LockHeld, LeaseLost))


def test_grant_from_proof_needs_the_lease_id_of_that_token() -> None:
    grant = locks.acquire("p", holder="a", ttl=5)

    rebuilt = locks.grant_from_proof("p", grant.token, grant.lease_id)
    assert (rebuilt.key, rebuilt.token, rebuilt.holder) == ("p", grant.token, "a")

    with pytest.raises(LeaseLost):
        locks.grant_from_proof("p", grant.token, "forged")
    with pytest.raises(LeaseLost):
        locks.grant_from_proof("p", grant.token + 1, grant.lease_id)
    locks.revoke("p")
    with pytest.raises(LeaseLost, match="revoked"):
        locks.grant_from_proof("p", grant.token, grant.lease_id)
