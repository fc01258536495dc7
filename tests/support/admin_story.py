"""The seed's story, told with the Python API, for the admin tests and screenshots.

A takes account:<pk> with a short lease and pauses past it (by the database
clock); B takes the lock, gets a higher token and writes; A wakes up and writes
with its old token, and the account's fence refuses it.
"""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal

from coordination import locks
from coordination.exceptions import StaleToken
from coordination.models import Grant
from project.demo.models import Account
from tests.support.waiting import wait_until_database_time_passes


@dataclass
class Story:
    account: Account
    key: str
    a: Grant
    b: Grant


def tell_the_seed_story(*, owner: str = "alice", ttl: float = 0.3, release_b: bool = False) -> Story:
    account = Account.objects.create(owner=owner, balance=Decimal("100.00"))
    key = f"account:{account.pk}"
    a = locks.acquire(key, holder="worker-A", ttl=ttl)
    wait_until_database_time_passes(a.expires_at)
    b = locks.acquire(key, holder="worker-B", ttl=30)
    Account.objects.filter(pk=account.pk).fenced_update(b, balance=Decimal("150.00"))
    try:
        Account.objects.filter(pk=account.pk).fenced_update(a, balance=Decimal("90.00"))
    except StaleToken:
        pass
    else:  # pragma: no cover
        raise AssertionError("A's late write was accepted")
    if release_b:
        locks.release(b)
    return Story(account, key, a, b)
