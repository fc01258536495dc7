"""The token floor (rule 8 of docs/rules.md): no key is issued a token at or below it,
keys the database has never seen included, on every grant point of this database."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest

from coordination import locks, restore, signals
from coordination.exceptions import InvalidInput, LeaseLost, TokenExhausted
from coordination.models import MAX_TOKEN, Grant, GrantEnd, Lock, TokenFloor
from tests.support.factories import LockFactory

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("grant_point")]


def cycle(key: str) -> int:
    lease = locks.acquire(key, holder="w", ttl=30)
    locks.release(lease)
    return lease.token


def test_a_key_never_granted_starts_above_the_floor() -> None:
    assert restore.raise_floor_to(1000) == 1000

    assert cycle("never-seen") == 1001
    assert cycle("never-seen") == 1002


def test_a_counter_below_the_floor_jumps_over_it_and_one_above_counts_on() -> None:
    LockFactory(key="behind", token=5)
    LockFactory(key="level", token=1000)
    LockFactory(key="ahead", token=5000)

    restore.raise_floor_to(1000)

    assert [cycle("behind"), cycle("behind")] == [1001, 1002]
    assert cycle("level") == 1001
    assert cycle("ahead") == 5001
    assert list(Grant.objects.filter(lock__key="behind").order_by("token").values_list(
        "token", "end_reason"
    )) == [(1001, GrantEnd.RELEASED), (1002, GrantEnd.RELEASED)]


def test_a_floor_jump_closes_the_expired_lease_it_takes_over() -> None:
    paused = locks.acquire("job", holder="paused", ttl=30)
    ran_out = locks.database_now() - dt.timedelta(seconds=60)
    Lock.objects.filter(key="job").update(expires_at=ran_out)
    Grant.objects.filter(lock__key="job", token=paused.token).update(expires_at=ran_out)
    restore.raise_floor_to(100)
    taken_over: list[dict[str, Any]] = []

    def record(**kwargs: Any) -> None:
        taken_over.append(kwargs)

    signals.lock_expired.connect(record, weak=False)
    try:
        later = locks.acquire("job", holder="later", ttl=30)
    finally:
        signals.lock_expired.disconnect(record)

    assert (paused.token, later.token) == (1, 101)
    old = Grant.objects.get(lock__key="job", token=1)
    assert (old.end_reason, old.ended_at) == (GrantEnd.EXPIRED, ran_out)
    assert [(event["key"], event["token"], event["holder"]) for event in taken_over] == [
        ("job", 1, "paused")
    ]
    with pytest.raises(LeaseLost):
        locks.renew(paused)
    assert Grant.objects.filter(lock__key="job", ended_at=None).get().token == 101


def test_a_floor_jump_after_a_release_takes_nothing_over() -> None:
    assert cycle("job") == 1
    restore.raise_floor_to(100)
    taken_over: list[dict[str, Any]] = []

    def record(**kwargs: Any) -> None:
        taken_over.append(kwargs)

    signals.lock_expired.connect(record, weak=False)
    try:
        assert cycle("job") == 101
    finally:
        signals.lock_expired.disconnect(record)

    assert taken_over == []
    assert Grant.objects.get(lock__key="job", token=1).end_reason == GrantEnd.RELEASED


def test_a_missing_floor_row_counts_as_zero_and_a_raise_makes_it_again() -> None:
    # A flushed test database, or a schema made without migrations.
    TokenFloor.objects.all().delete()

    assert TokenFloor.objects.value() == 0
    assert cycle("a") == 1
    assert restore.raise_floor_to(7) == 7
    assert cycle("b") == 8


def test_a_floor_at_the_largest_token_refuses_every_key_and_issues_nothing() -> None:
    LockFactory(key="old", token=3)
    restore.raise_floor_to(MAX_TOKEN)

    for key in ("old", "never-seen"):
        with pytest.raises(TokenExhausted, match="token floor"):
            locks.acquire(key, holder="w", ttl=30)

    assert Lock.objects.get(key="old").token == 3
    assert not Lock.objects.filter(key="never-seen").exists()
    assert not Grant.objects.exists()


@pytest.mark.parametrize("value", [-1, MAX_TOKEN + 1, True, 1.5, "10"])
def test_the_floor_is_a_64_bit_token(value: Any) -> None:
    with pytest.raises(InvalidInput):
        restore.raise_floor_to(value)
    assert TokenFloor.objects.value() == 0
