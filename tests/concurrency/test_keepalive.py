"""The keep-alive on its own: a thread with its own connection renews a lease
while the body runs, and marks the grant lost when it cannot."""

from __future__ import annotations

import time
from decimal import Decimal
from typing import Any

import pytest

from coordination import locks, signals
from coordination.contrib.execution import FencedExecution, KeepAlive
from coordination.exceptions import LeaseLost, LockHeld
from coordination.models import Grant
from project.demo.models import Account
from tests.support.factories import AccountFactory

pytestmark = pytest.mark.django_db(transaction=True)


def test_keepalive_renews_every_third_of_the_ttl_and_keeps_the_lease() -> None:
    grant = locks.acquire("job:keep", holder="me", ttl=0.6)
    keeper = KeepAlive(grant, ttl=0.6).start()
    try:
        time.sleep(1.5)
        with pytest.raises(LockHeld):
            locks.acquire("job:keep", holder="other", ttl=1)
    finally:
        keeper.stop()
    assert 3 <= keeper.renewals <= 8
    assert not grant.lost
    locks.release(grant)


def test_keepalive_marks_the_grant_lost_when_a_renewal_fails_and_later_writes_are_refused() -> None:
    account = AccountFactory(balance=Decimal("1.00"))
    lost: list[Grant] = []

    def on_lost(sender: Any, grant: Grant, **kwargs: Any) -> None:
        lost.append(grant)

    signals.lock_lost.connect(on_lost)
    try:
        with FencedExecution(f"account:{account.pk}", holder="me", ttl=0.6) as grant:
            locks.revoke(f"account:{account.pk}")  # an operator takes the lock away
            deadline = time.monotonic() + 10
            while not grant.lost:
                assert time.monotonic() < deadline, "the keep-alive never noticed"
                time.sleep(0.02)
            with pytest.raises(LeaseLost):
                Account.objects.filter(pk=account.pk).fenced_update(balance=Decimal("2.00"))
    finally:
        signals.lock_lost.disconnect(on_lost)

    assert lost == [grant]
    assert Account.objects.get(pk=account.pk).balance == Decimal("1.00")
    assert locks.current_grant() is None
