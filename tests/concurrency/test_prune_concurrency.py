"""coordination_prune running while threads take and release leases."""

from __future__ import annotations

import datetime as dt
import threading
from collections.abc import Callable
from typing import Any

import pytest

from coordination import locks, pruning
from coordination.models import Grant, Lock


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
