"""coordination_prune running while threads take and release leases."""

from __future__ import annotations

import datetime as dt
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from django.db import connection, connections

from coordination import locks, pruning
from coordination.models import Grant, Lock, TokenFloor
from tests.support.waiting import wait_for, wait_until_blocked_on_a_row_lock


@pytest.mark.django_db(transaction=True)
def test_pruning_while_the_grant_point_is_busy_keeps_counters_and_latest_grants(
    in_threads: Callable[..., list[Any]],
) -> None:
    keys = [f"busy:{number}" for number in range(3)]
    rounds = 15
    done = threading.Event()

    def work(index: int) -> int:
        if index == len(keys):  # the pruner, deleting as fast as it can meanwhile
            pruned = 0
            while True:
                finished = done.is_set()
                pruned += sum(pruning.prune(dt.timedelta(0), batch_size=2).values())
                if finished:
                    return pruned
        try:
            for _ in range(rounds):
                with locks.hold(keys[index], holder=f"w{index}", ttl=30, wait=30):
                    pass
        finally:
            if index == 0:
                done.set()
        return rounds

    results = in_threads(len(keys) + 1, work)

    pruning.prune(dt.timedelta(0))
    for key in keys:
        assert Lock.objects.get(key=key).token == rounds
        assert list(Grant.objects.filter(lock__key=key).values_list("token", flat=True)) == [rounds]
    assert results[-1] > 0


# --- lock rows pruned while acquires race them (rule 3 of docs/rules.md) ---------------


def make_unused(key: str, tokens: int) -> int:
    """Grant ``key`` ``tokens`` times, then make its row and grants look 40 days old."""
    for _ in range(tokens):
        locks.release(locks.acquire(key, holder="before", ttl=30))
    then = locks.database_now() - dt.timedelta(days=40)
    Lock.objects.filter(key=key).update(created_at=then)
    Grant.objects.filter(lock__key=key).update(ended_at=then, expires_at=then)
    return Lock.objects.get(key=key).token


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("grant_point")
def test_an_acquire_that_waited_for_the_prune_of_its_key_gets_a_token_above_the_pruned_one() -> None:
    """The interleaving that would reuse tokens: the acquire reads the floor, the prune
    locks the key's row, the acquire waits for that row, the prune raises the floor,
    deletes the row and commits, the acquire goes on and creates the row again."""
    last = make_unused("raced", 5)
    TokenFloor.objects.get_or_create(pk=TokenFloor.ROW)  # a flush of an earlier test removes it
    floor_holder = connections.create_connection("default")
    result: dict[str, Any] = {}
    errors: list[BaseException] = []

    def prune_it() -> None:
        result["prune pid"] = connection.connection.info.backend_pid
        result["pruned"] = pruning.prune_locks(locks.database_now() - dt.timedelta(days=30))

    def acquire_it() -> None:
        result["acquire pid"] = connection.connection.info.backend_pid
        result["lease"] = locks.acquire("raced", holder="racer", ttl=30)

    try:
        # Hold the floor's row so the prune stops after locking the key's row,
        # before it raises the floor.
        floor_holder.set_autocommit(False)
        with floor_holder.cursor() as cursor:
            cursor.execute(f"SELECT token FROM {TokenFloor._meta.db_table} WHERE id = 1 FOR UPDATE")
        pruner = threading.Thread(target=in_own_connection(prune_it, errors))
        pruner.start()
        wait_for(lambda: "prune pid" in result, what="the pruner started")
        wait_until_blocked_on_a_row_lock(result["prune pid"])  # on the floor's row
        assert not errors, errors
        acquirer = threading.Thread(target=in_own_connection(acquire_it, errors))
        acquirer.start()
        wait_for(lambda: "acquire pid" in result, what="the acquirer started")
        wait_until_blocked_on_a_row_lock(result["acquire pid"])  # on the key's row
        floor_holder.commit()
        pruner.join(60)
        acquirer.join(60)
    finally:
        floor_holder.close()

    assert not errors, errors
    assert result["pruned"] == 1
    assert result["lease"].token > last
    assert TokenFloor.objects.value() >= last
    assert Lock.objects.get(key="raced").token == result["lease"].token


def in_own_connection(work: Callable[[], None], errors: list[BaseException]) -> Callable[[], None]:
    def run() -> None:
        try:
            connection.ensure_connection()
            work()
        except BaseException as error:
            errors.append(error)
        finally:
            connections.close_all()

    return run


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("grant_point")
def test_tokens_of_each_key_rise_across_prunes_of_its_row(
    in_threads: Callable[..., list[Any]], settings: Any
) -> None:
    """Threads take and release a few keys while a pruner deletes every free row as
    fast as it can: each key's tokens, in grant order, never repeat or go back.

    The workers go on until the pruner has deleted a row and each has taken two
    keys since: a loaded machine (SQLite's writers take turns) may otherwise let
    the workers finish before the pruner ever wins a turn."""
    settings.COORDINATION = {**settings.COORDINATION, "PRUNE_LOCKS_AFTER": 0}
    keys = ["pruned:a", "pruned:b"]
    workers, rounds = 3, 20
    issued: dict[str, list[int]] = {key: [] for key in keys}
    done = threading.Event()
    finished = [0]
    pruned = [0]
    guard = threading.Lock()

    def work(index: int) -> int:
        deadline = time.monotonic() + 120
        if index == workers:  # the pruner
            while not done.is_set():
                assert time.monotonic() < deadline, "the workers never finished"
                pruned[0] += pruning.prune_locks(locks.database_now(), batch_size=1)
            return pruned[0]
        try:
            number = after_a_prune = 0
            while number < rounds or after_a_prune < 2:
                assert time.monotonic() < deadline, "the pruner never deleted a row"
                key = keys[(index + number) % len(keys)]
                with locks.hold(key, holder=f"w{index}", ttl=30, wait=60) as lease:
                    # Leases of a key never overlap: the list is in grant order.
                    issued[key].append(lease.token)
                number += 1
                if pruned[0]:
                    after_a_prune += 1
                elif number >= rounds:
                    time.sleep(0.05)  # leave the pruner a turn
        finally:
            with guard:
                finished[0] += 1
                if finished[0] == workers:
                    done.set()
        return rounds

    results = in_threads(workers + 1, work)

    assert results[-1] > 0, "the pruner never deleted a row: the race was not exercised"
    for key, tokens in issued.items():
        assert tokens == sorted(set(tokens)), f"{key}: tokens repeated or went back: {tokens}"
