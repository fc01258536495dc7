"""Stale saves racing fenced writes on one row, each thread with its own connection.

Fenced writers and plain savers write the same field of one Account: a fenced
write sets ``owner = "fenced:<token>"``, a plain save ``owner = "save:<token
the instance carried>"``. A watcher reads the row throughout. Over the whole
history: the watermark never goes back, no two accepted fenced writes share a
token, and every snapshot is consistent with the rule that a save writes only
a row whose watermark it has seen, so a save's data never sits on a row a newer
fenced write has moved past.
"""

from __future__ import annotations

import threading
import time
from decimal import Decimal

import pytest
from django.db import connections, transaction

from coordination import locks
from coordination.exceptions import StaleInstance
from project.demo.models import Account
from tests.support.factories import AccountFactory
from tests.support.waiting import run_in_threads

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.legs("pg", "lts", reason="threads on one row of a server database"),
]

WRITERS = 3
SAVERS = 3
ROUNDS = 15


def test_stale_saves_racing_fenced_writes_never_overwrite_a_newer_write() -> None:
    account = AccountFactory(owner="start", balance=Decimal("0.00"))
    key = f"account:{account.pk}"
    done = threading.Event()
    snapshots: list[tuple[int, str]] = []
    accepted_tokens: list[int] = []
    outcomes = {"saved": 0, "refused": 0}
    guard = threading.Lock()

    def watch() -> None:
        try:
            while not done.is_set():
                snapshots.append(Account.objects.values_list("fence", "owner").get(pk=account.pk))
                time.sleep(0.001)
        finally:
            connections.close_all()

    def write(index: int) -> None:
        for _ in range(ROUNDS):
            grant = locks.acquire(key, holder=f"writer-{index}", ttl=30, wait=60)
            try:
                Account.objects.filter(pk=account.pk).fenced_update(
                    grant, owner=f"fenced:{grant.token}"
                )
                with guard:
                    accepted_tokens.append(grant.token)
            finally:
                locks.release(grant)

    def save(index: int) -> None:
        for round_ in range(ROUNDS):
            loaded = Account.objects.get(pk=account.pk)
            time.sleep(0.002 * (round_ % 3))  # sometimes a fenced write lands meanwhile
            loaded.owner = f"save:{loaded.fence}"
            try:
                with transaction.atomic():
                    loaded.save()
            except StaleInstance:
                with guard:
                    outcomes["refused"] += 1
            else:
                with guard:
                    outcomes["saved"] += 1

    def run(index: int) -> None:
        if index < WRITERS:
            write(index)
        else:
            save(index)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        run_in_threads(WRITERS + SAVERS, run)
    finally:
        done.set()
        watcher.join(60)
    assert not watcher.is_alive()

    # One more, in an order that does not depend on timing: loaded, then a
    # fenced write, then saved.
    stale = Account.objects.get(pk=account.pk)
    grant = locks.acquire(key, holder="last", ttl=30)
    Account.objects.filter(pk=account.pk).fenced_update(grant, owner=f"fenced:{grant.token}")
    locks.release(grant)
    stale.owner = f"save:{stale.fence}"
    with pytest.raises(StaleInstance), transaction.atomic():
        stale.save()
    accepted_tokens.append(grant.token)

    final = Account.objects.values_list("fence", "owner").get(pk=account.pk)
    snapshots.append(final)
    assert len(accepted_tokens) == WRITERS * ROUNDS + 1
    assert len(set(accepted_tokens)) == len(accepted_tokens), "two fenced writes shared a token"
    assert final == (max(accepted_tokens), f"fenced:{max(accepted_tokens)}")
    assert outcomes["saved"] + outcomes["refused"] == SAVERS * ROUNDS
    fences = [fence for fence, _ in snapshots]
    assert fences == sorted(fences), "a watermark went back"
    for fence, owner in snapshots:
        kind, _, token = owner.partition(":")
        if kind in ("fenced", "save"):
            # A fenced write's data sits at its own token; a save's data only on
            # the watermark its instance had seen: no newer write came after it.
            assert int(token) == fence, f"{owner!r} on a row at watermark {fence}"
        else:
            assert (fence, owner) == (0, "start")
