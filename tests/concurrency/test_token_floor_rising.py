"""The token floor rising while threads acquire (rule 8 of docs/rules.md): no grant
is issued a token at or below the floor committed before its acquire began, for a
key never seen or a key whose counter the floor overtakes, and each key's tokens
still only rise. Each thread has its own connection; the floor rises in another."""

from __future__ import annotations

import random
import threading
import time
from collections import defaultdict

import pytest

from coordination import locks, restore
from coordination.models import Grant, TokenFloor
from tests.support.waiting import run_in_threads

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.postgres,
    pytest.mark.usefixtures("grant_point"),
]

ACQUIRERS = 4
CYCLES = 60  # per acquirer


def test_no_grant_is_at_or_below_a_floor_committed_before_it_began() -> None:
    done = threading.Event()
    finished = [0]
    raises: list[int] = []
    # (thread, key, floor read before the acquire, token issued)
    history: list[tuple[int, str, int, int]] = []
    lock = threading.Lock()

    def raise_floor() -> None:
        deadline = time.monotonic() + 120
        while not done.is_set():
            assert time.monotonic() < deadline, "the acquirers never finished"
            target = TokenFloor.objects.value() + random.randint(1, 40)
            raises.append(restore.raise_floor_to(target))

    def interleaved() -> bool:
        """The floor rose often enough under the acquires (not only before or after)."""
        with lock:
            floors = {floor for _t, _k, floor, _token in history}
        return len(raises) >= 10 and len(floors) >= 10

    def acquire(thread: int) -> None:
        mine = []
        deadline = time.monotonic() + 120
        number = 0
        # CYCLES at least, then on (giving the raiser turns) until the floor has
        # risen under the acquires: a loaded machine may not interleave them at first.
        while number < CYCLES or not interleaved():
            assert time.monotonic() < deadline, "the floor never rose under the acquires"
            if number >= CYCLES:
                time.sleep(0.02)
            # A key never seen, or the thread's own key that the floor overtakes.
            key = f"new-{thread}-{number}" if number % 2 else f"own-{thread}"
            floor = TokenFloor.objects.value()  # committed: read in autocommit
            lease = locks.acquire(key, holder=f"t{thread}", ttl=30)
            locks.release(lease)
            mine.append((thread, key, floor, lease.token))
            number += 1
            if number >= CYCLES:
                with lock:
                    history.extend(mine)
                mine = []
        with lock:
            history.extend(mine)
            finished[0] += 1
            if finished[0] == ACQUIRERS:
                done.set()

    def work(index: int) -> None:
        if index == ACQUIRERS:
            raise_floor()
        else:
            acquire(index)

    run_in_threads(ACQUIRERS + 1, work)

    assert len(history) >= ACQUIRERS * CYCLES
    below = [(key, floor, token) for _t, key, floor, token in history if token <= floor]
    assert not below, f"tokens at or below a floor committed before their acquire: {below[:5]}"
    # The floor did rise under the acquires, many times, and overtook the own keys.
    assert len(raises) >= 10 and raises == sorted(raises)
    assert len({floor for _t, _k, floor, _token in history}) >= 10
    # Each key's tokens rise in grant order, as recorded by the grant point.
    tokens: dict[str, list[int]] = defaultdict(list)
    for _thread, key, _floor, token in history:  # each key has one thread: its order
        tokens[key].append(token)
    for key, issued in tokens.items():
        assert issued == sorted(set(issued)), key
        assert list(
            Grant.objects.filter(lock__key=key).order_by("acquired_at").values_list("token", flat=True)
        ) == issued
