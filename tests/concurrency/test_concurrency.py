"""Whole concurrent histories: threads with their own connections hammer the grant
point and the fences, then the rules of docs/rules.md are checked over
everything that happened, not one happy path."""

from __future__ import annotations

import itertools
import random
import threading
import time
from collections import defaultdict
from typing import Any

import pytest
from django.db import OperationalError, connection, connections, transaction

from coordination import locks
from coordination.exceptions import LockHeld, StaleToken
from coordination.models import Grant, Lock, Rejection
from project.demo.models import Account
from tests.support.factories import AccountFactory
from tests.support.waiting import run_in_threads, wait_for, wait_until_blocked_on_a_row_lock

pytestmark = pytest.mark.django_db(transaction=True)

THREADS = 16


def assert_grant_history_is_sound(key: str, expected_grants: int) -> None:
    """Rule 3 over the whole history of ``key``: tokens unique, increasing in grant
    order, and no two leases live at the same database time."""
    grants = list(Grant.objects.filter(lock__key=key).order_by("acquired_at", "token"))
    tokens = [g.token for g in grants]
    assert len(grants) == expected_grants
    assert len(set(tokens)) == len(tokens), "a token was issued twice"
    assert tokens == sorted(tokens), "tokens are not increasing in grant order"
    assert Lock.objects.get(key=key).token == max(tokens)
    for earlier, later in itertools.pairwise(grants):
        end = earlier.ended_at or earlier.expires_at
        assert later.acquired_at >= end, f"grants {earlier.token} and {later.token} overlap"


@pytest.mark.usefixtures("grant_point")
@pytest.mark.legs(
    "pg", "sqlite",
    reason="half a minute of threads on one row lock; the LTS leg runs the many-keys test below",
)
def test_sixteen_threads_on_one_key_get_unique_increasing_tokens_and_never_overlap() -> None:
    key = "hot"
    rounds = 5
    inside = 0
    most_inside = 0
    guard = threading.Lock()

    def worker(index: int) -> list[int]:
        nonlocal inside, most_inside
        tokens = []
        for _ in range(rounds):
            grant = locks.acquire(key, holder=f"t{index}", ttl=30, wait=60)
            with guard:
                inside += 1
                most_inside = max(most_inside, inside)
            time.sleep(0.001)
            with guard:
                inside -= 1
            tokens.append(grant.token)
            locks.release(grant)
        return tokens

    per_thread = run_in_threads(THREADS, worker)

    issued = [t for tokens in per_thread for t in tokens]
    assert sorted(issued) == list(range(1, THREADS * rounds + 1))
    assert all(tokens == sorted(tokens) for tokens in per_thread)
    assert most_inside == 1, "two threads held the lock at once"
    assert_grant_history_is_sound(key, THREADS * rounds)


@pytest.mark.usefixtures("grant_point")
def test_sixteen_threads_on_many_keys_keep_per_key_counters_exact() -> None:
    keys = [f"k{n}" for n in range(6)]
    rounds = 8
    busy = defaultdict(int)

    def worker(index: int) -> list[tuple[str, int]]:
        rng = random.Random(index)
        taken = []
        for _ in range(rounds):
            key = rng.choice(keys)
            try:
                grant = locks.acquire(key, holder=f"t{index}", ttl=30)
            except LockHeld:
                busy[index] += 1
                continue
            taken.append((key, grant.token))
            locks.release(grant)
        return taken

    results = run_in_threads(THREADS, worker)

    by_key: dict[str, list[int]] = defaultdict(list)
    for taken in results:
        for key, token in taken:
            by_key[key].append(token)
    assert sum(len(t) for t in by_key.values()) + sum(busy.values()) == THREADS * rounds
    for key, tokens in by_key.items():
        assert sorted(tokens) == list(range(1, len(tokens) + 1)), key
        assert_grant_history_is_sound(key, len(tokens))


@pytest.mark.usefixtures("grant_point")
def test_racing_first_acquires_of_a_new_key_create_one_row_and_one_grant() -> None:
    def worker(index: int) -> int | None:
        try:
            return locks.acquire("brand-new", holder=f"t{index}", ttl=30).token
        except LockHeld:
            return None

    tokens = run_in_threads(THREADS, worker)

    assert [t for t in tokens if t is not None] == [1]
    assert Lock.objects.filter(key="brand-new").count() == 1
    assert Grant.objects.count() == 1


def issue_tokens(key: str, count: int) -> list[locks.Lease]:
    grants = []
    for n in range(count):
        grant = locks.acquire(key, holder=f"w{n}", ttl=30)
        locks.release(grant)
        grants.append(grant)
    return grants


def test_concurrent_stale_and_newer_fenced_updates_only_apply_in_token_order() -> None:
    account = AccountFactory(balance=0)
    grants = issue_tokens(f"account:{account.pk}", THREADS)
    order = list(range(THREADS))
    random.Random(7).shuffle(order)
    accepted: list[tuple[int, float]] = []
    record = threading.Lock()

    def worker(index: int) -> str:
        grant = grants[order[index]]
        try:
            with transaction.atomic():
                Account.objects.filter(pk=account.pk).fenced_update(grant, balance=grant.token)
                with record:
                    accepted.append((grant.token, time.monotonic()))
        except StaleToken:
            return "stale"
        return "ok"

    outcomes = run_in_threads(THREADS, worker)

    stored = Account.objects.get(pk=account.pk)
    top = grants[-1].token
    assert (stored.fence, stored.balance) == (top, top)  # the newest token's value stands
    accepted_tokens = [token for token, _ in sorted(accepted, key=lambda pair: pair[1])]
    assert accepted_tokens == sorted(accepted_tokens), "an older token wrote after a newer one"
    assert outcomes.count("ok") == len(accepted_tokens)
    for rejection in Rejection.objects.all():
        assert rejection.watermark_token is not None
        assert rejection.token < rejection.watermark_token  # every refusal was justified


def interleave_on_row_lock(isolation: str | None) -> tuple[Any, Account]:
    """T_new writes token n+1 and holds the row lock; T_old's fenced_update with n
    starts and blocks on it; T_new commits. Returns what T_old got."""
    account = AccountFactory(balance=0)
    old, new = issue_tokens(f"account:{account.pk}", 2)
    new_wrote = threading.Event()
    old_pid: list[int] = []
    release_new = threading.Event()
    outcome: list[Any] = []

    def newer() -> None:
        try:
            with transaction.atomic():
                Account.objects.filter(pk=account.pk).fenced_update(new, balance=2)
                new_wrote.set()
                release_new.wait(30)
        finally:
            connections.close_all()

    def older() -> None:
        try:
            new_wrote.wait(30)
            with transaction.atomic():
                with connection.cursor() as cursor:
                    if isolation:
                        cursor.execute(f"SET TRANSACTION ISOLATION LEVEL {isolation}")
                    cursor.execute("SELECT pg_backend_pid()")
                    old_pid.append(cursor.fetchone()[0])
                    Account.objects.filter(pk=account.pk).exists()  # takes the snapshot
                Account.objects.filter(pk=account.pk).fenced_update(old, balance=1)
            outcome.append("applied")
        except Exception as error:
            outcome.append(error)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=newer), threading.Thread(target=older)]
    for thread in threads:
        thread.start()
    wait_for(lambda: old_pid, what="the stale writer's backend pid")
    wait_until_blocked_on_a_row_lock(old_pid[0])
    release_new.set()
    for thread in threads:
        thread.join(30)
    return outcome[0], Account.objects.get(pk=account.pk)


@pytest.mark.postgres
def test_read_committed_rechecks_the_fence_after_waiting_for_the_row_lock() -> None:
    outcome, stored = interleave_on_row_lock(isolation=None)

    assert isinstance(outcome, StaleToken)
    assert (stored.balance, stored.fence) == (2, 2)


@pytest.mark.postgres
def test_repeatable_read_refuses_with_a_serialization_failure_never_a_stale_write() -> None:
    # Under REPEATABLE READ PostgreSQL does not re-check the WHERE against the new
    # row version: the UPDATE fails with "could not serialize access" and the
    # caller must retry. The stale value is never written either way.
    outcome, stored = interleave_on_row_lock(isolation="REPEATABLE READ")

    assert isinstance(outcome, OperationalError)
    assert "could not serialize" in str(outcome)
    assert (stored.balance, stored.fence) == (2, 2)
