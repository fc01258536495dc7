"""The restore guard's bump and ``acquire_many`` lock the same rows in the same order.

``acquire_many`` locks its keys in sorted order (codepoint order, as Python
sorts them). The bump locks a batch of lock rows at once; in any other order
(the rows' insertion order, or the database collation's order) a bump and an
``acquire_many`` of two of its keys can each hold the row the other waits for,
and PostgreSQL ends one of them with a deadlock error. The keys here are made
in reverse order and differ in case, so insertion order, collation order and
codepoint order all disagree.
"""

from __future__ import annotations

import contextlib
import random
import threading
import time

import pytest
from django.db import connection, transaction

from coordination import locks, restore
from coordination.backends.postgresql import CURRENT_TIMELINE_SQL
from coordination.exceptions import CoordinationError, LeaseLost, LockHeld
from coordination.models import TokenFloor
from tests.support.waiting import run_in_threads

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.postgres]

KEYS = [f"bump-{name}" for name in ("e", "D", "c", "B", "a", "Z", "y", "X")]


@pytest.mark.usefixtures("grant_point")
def test_a_bump_beside_acquire_many_on_the_same_keys_never_deadlocks() -> None:
    for key in KEYS:  # rows in reverse order of their keys
        locks.release(locks.acquire(key, holder="seed", ttl=30))
    stop = threading.Event()
    granted = [0]

    def transfers(index: int) -> int:
        rng = random.Random(index)
        while not stop.is_set():
            keys = rng.sample(KEYS, 3)
            try:
                grants = locks.acquire_many(keys, holder=f"t{index}", ttl=30, wait=5)
            except LockHeld:
                continue
            granted[0] += 1
            with contextlib.suppress(LeaseLost):  # the bump revoked it: expected
                locks.release_many(grants)
        return 0

    def bumps(_: int) -> int:
        try:
            deadline = time.monotonic() + 4
            runs = 0
            while time.monotonic() < deadline or runs < 3:
                try:
                    restore.bump_tokens(1000, apply=True, batch_size=len(KEYS))
                except CoordinationError as error:
                    # A held key is revoked, then bumped once free; one taken
                    # again each time gives up (clients should be stopped).
                    # That is the guard's documented refusal, not a deadlock
                    # (which PostgreSQL raises as a database error).
                    assert "keeps being acquired" in str(error)
                    continue
                runs += 1
            return runs
        finally:
            stop.set()

    results = run_in_threads(5, lambda i: bumps(i) if i == 0 else transfers(i), timeout=120)
    assert results[0] >= 3
    assert granted[0] > 0


def test_a_floor_row_made_again_records_the_timeline_so_no_grant_waits_for_it() -> None:
    """The promotion guard locks the floor's row when the row records no
    timeline yet. A row that appeared so in the middle of an ``acquire_many``
    (a flushed floor remade by the bump above) deadlocked two sets: one held
    the row and waited for a lock row, the other held that lock row and waited
    for the floor row. A remade row records the timeline, so no grant locks it."""
    TokenFloor.objects.filter(pk=TokenFloor.ROW).delete()
    restore.raise_floor_to(5)
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT {CURRENT_TIMELINE_SQL}")
        (current,) = cursor.fetchone()
    assert TokenFloor.objects.get().timeline == current

    held, done = threading.Event(), threading.Event()

    def hold_the_floor_row() -> None:
        try:
            with transaction.atomic():
                TokenFloor.objects.select_for_update().get()
                held.set()
                done.wait(30)
        finally:
            connection.close()

    holder = threading.Thread(target=hold_the_floor_row)
    holder.start()
    try:
        assert held.wait(10)
        with connection.cursor() as cursor:
            cursor.execute("SET lock_timeout = '5s'")  # a wait for the row fails the test
        grants = locks.acquire_many(["floor-a", "floor-b"], holder="h", ttl=30)
        assert {grant.token for grant in grants.values()} == {6}
    finally:
        done.set()
        holder.join(30)
        with connection.cursor() as cursor:
            cursor.execute("RESET lock_timeout")
