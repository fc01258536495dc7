"""Reentrancy across threads, pairwise transfers with ``acquire_many`` under contention,
and permits of a counting semaphore under contention.

The transfer run lasts ``COORDINATION_TRANSFER_SECONDS`` (default 3 s, for the
suite); docs/primitives.md gives the figures of a 30-second run.
"""

from __future__ import annotations

import itertools
import os
import random
import threading
import time
from collections import Counter
from decimal import Decimal
from typing import Any

import pytest
from django.db import transaction
from django.db.models import F

from coordination import locks
from coordination.exceptions import LockHeld
from coordination.models import Grant, GrantEnd
from coordination.semaphores import acquire_permit
from coordination.waiting import Waiter
from project.demo.models import Account
from tests.support.factories import AccountFactory
from tests.support.waiting import run_in_threads

pytestmark = pytest.mark.django_db(transaction=True)

TRANSFER_SECONDS = float(os.environ.get("COORDINATION_TRANSFER_SECONDS", "3"))
THREADS = 8
ACCOUNTS = 6


@pytest.mark.usefixtures("grant_point")
def test_a_reentrant_lease_is_not_shared_with_another_thread() -> None:
    outer = locks.acquire("job:t", holder="worker-a", ttl=30, reentrant=True)
    assert locks.acquire("job:t", holder="worker-a", ttl=30, reentrant=True) is outer

    def other_thread(_: int) -> str:
        try:
            locks.acquire("job:t", holder="worker-a", ttl=30, reentrant=True)
        except LockHeld as held:
            return held.holder
        return "granted"

    assert run_in_threads(1, other_thread) == ["worker-a"]
    locks.release(outer)
    locks.release(outer)
    assert run_in_threads(1, other_thread) == ["granted"]


@pytest.mark.usefixtures("grant_point")
def test_acquire_many_with_wait_is_granted_once_the_held_key_is_released(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    held = locks.acquire("pair:b", holder="other", ttl=30)
    # The key is released only once the waiter has been refused and waits (its
    # sleep between two attempts runs), so the grant can only come by way of
    # the wait path, never from a first try that found the key already free.
    waiting = threading.Event()
    sleep = Waiter.sleep

    def observed_sleep(waiter: Any, pause: float) -> None:
        waiting.set()
        sleep(waiter, pause)

    monkeypatch.setattr(Waiter, "sleep", observed_sleep)

    def waiter(_: int) -> dict[str, int]:
        grants = locks.acquire_many(["pair:a", "pair:b"], holder="mover", ttl=30, wait=30)
        return {key: lease.token for key, lease in grants.items()}

    def releaser() -> None:
        if waiting.wait(30):
            locks.release(held)

    thread = threading.Thread(target=releaser)
    thread.start()
    try:
        (tokens,) = run_in_threads(1, waiter)
    finally:
        waiting.set()  # the releaser never waits past a failure
        thread.join(30)
    assert tokens == {"pair:a": 1, "pair:b": held.token + 1}
    assert Grant.objects.get(lock__key="pair:b", token=held.token).end_reason == GrantEnd.RELEASED


@pytest.mark.postgres
@pytest.mark.usefixtures("grant_point")
def test_threads_moving_money_between_random_pairs_never_deadlock_or_lose_a_cent() -> None:
    accounts = [AccountFactory(owner=f"o{n}", balance=Decimal("1000.00")) for n in range(ACCOUNTS)]
    ids = [account.pk for account in accounts]
    total = sum(account.balance for account in accounts)
    holding: Counter[int] = Counter()
    guard = threading.Lock()
    overlaps: list[tuple[int, int]] = []

    def mover(index: int) -> dict[str, Any]:
        rng = random.Random(index)
        figures: Counter[str] = Counter()
        seen: dict[str, list[int]] = {}
        deadline = time.monotonic() + TRANSFER_SECONDS
        while time.monotonic() < deadline:
            source, target = rng.sample(ids, 2)
            keys = [f"account:{source}", f"account:{target}"]
            try:
                grants = locks.acquire_many(keys, holder=f"mover-{index}", ttl=30)
            except LockHeld:
                figures["refusals"] += 1
                try:
                    grants = locks.acquire_many(keys, holder=f"mover-{index}", ttl=30, wait=20)
                except LockHeld:
                    figures["timeouts"] += 1
                    continue
                figures["waits"] += 1
            with guard:
                for pk in (source, target):
                    holding[pk] += 1
                    if holding[pk] > 1:
                        overlaps.append((pk, index))
            for key, lease in grants.items():
                seen.setdefault(key, []).append(lease.token)
            amount = Decimal(rng.randint(1, 5000)) / 100
            with transaction.atomic():
                # Each row with the lease of the key that guards it.
                Account.objects.filter(pk=source).fenced_update(
                    grants[f"account:{source}"], balance=F("balance") - amount
                )
                Account.objects.filter(pk=target).fenced_update(
                    grants[f"account:{target}"], balance=F("balance") + amount
                )
            with guard:
                for pk in (source, target):
                    holding[pk] -= 1
            locks.release_many(grants)
            figures["transfers"] += 1
        return {"figures": figures, "seen": seen}

    results = run_in_threads(THREADS, mover, timeout=TRANSFER_SECONDS + 120)

    figures: Counter[str] = sum((result["figures"] for result in results), Counter())
    print(f"\ntransfers over {TRANSFER_SECONDS:g} s, {THREADS} threads: {dict(figures)}")
    assert figures["transfers"] > 0
    # A wait that ran out (figures["timeouts"]) is starvation, not a deadlock: sets
    # are not queued fairly (docs/primitives.md); every thread finished, so none hung.
    assert not overlaps, "two threads held the same account at once"
    assert sum(Account.objects.values_list("balance", flat=True)) == total
    for result in results:  # each thread saw each key's tokens rise
        for tokens in result["seen"].values():
            assert tokens == sorted(set(tokens))
    for pk in ids:
        key = f"account:{pk}"
        grants = list(Grant.objects.filter(lock__key=key).order_by("acquired_at", "token"))
        tokens = [grant.token for grant in grants]
        assert tokens == sorted(set(tokens)), f"tokens of {key} not strictly increasing"
        for earlier, later in itertools.pairwise(grants):
            assert later.acquired_at >= (earlier.ended_at or earlier.expires_at)
        if grants:
            assert Account.objects.get(pk=pk).fence == tokens[-1]


@pytest.mark.usefixtures("grant_point")
def test_waiting_threads_never_hold_more_permits_than_the_limit() -> None:
    limit, threads, rounds = 2, 6, 4
    inside: Counter[str] = Counter()
    most = 0
    guard = threading.Lock()

    def worker(index: int) -> list[tuple[str, int]]:
        nonlocal most
        taken = []
        for _ in range(rounds):
            permit = acquire_permit("batch", limit=limit, holder=f"w{index}", ttl=30, wait=60)
            with guard:
                inside["all"] += 1
                inside[permit.key] += 1
                most = max(most, inside["all"])
                assert inside[permit.key] == 1, "two holders of one slot"
            time.sleep(0.005)
            with guard:
                inside["all"] -= 1
                inside[permit.key] -= 1
            locks.release(permit)
            taken.append((permit.key, permit.token))
        return taken

    granted = [pair for taken in run_in_threads(threads, worker) for pair in taken]

    assert len(granted) == threads * rounds
    assert most <= limit
    assert {key for key, _ in granted} <= {"batch@1", "batch@2"}
    for key in {key for key, _ in granted}:
        tokens = sorted(token for slot, token in granted if slot == key)
        assert tokens == list(range(1, len(tokens) + 1)), f"tokens of {key} repeat or skip"
