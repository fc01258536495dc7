"""The release function commits without waiting for its WAL flush; nothing else does.

A release lost in a server crash leaves its lease to run to its expiry, which
no token, grant or watermark depends on; an acquire or a renew lost that way
would issue or shorten a lease, so they stay durable. The function turns
``synchronous_commit`` off for its own transaction only when that transaction
wrote nothing before it: a caller's transaction stays durable."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from django.db import connection, transaction

from coordination import locks
from coordination.backends.base import WAKE_UP_CHANNEL
from coordination.backends.postgresql import ACQUIRE, RELEASE
from coordination.models import MAX_TOKEN, Lock, hash_lease_id

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.postgres]


@pytest.fixture(autouse=True)
def durable_session() -> Iterator[None]:
    """The session waits for the disk, as a production server does (the suite's
    own server may commit without waiting: bin/test's COORDINATION_PG_FAST)."""
    with connection.cursor() as cursor:
        cursor.execute("SET synchronous_commit = on")
    yield
    with connection.cursor() as cursor:
        cursor.execute("RESET synchronous_commit")


def _release_in_a_transaction(key: str, *, write_first: bool) -> tuple[bool, str]:
    grant = locks.acquire(key, holder="A", ttl=30)
    with transaction.atomic(), connection.cursor() as cursor:
        if write_first:
            Lock.objects.filter(key=key).update(wake_until=None)
        cursor.execute(RELEASE, (
            grant.key, grant.token, hash_lease_id(grant.lease_id), False, WAKE_UP_CHANNEL,
        ))
        released = cursor.fetchone()[0]
        cursor.execute("SHOW synchronous_commit")
        setting = cursor.fetchone()[0]
    return released, setting


def test_a_release_does_not_wait_for_its_wal_flush() -> None:
    assert _release_in_a_transaction("flush", write_first=False) == (True, "off")
    # Only for that transaction: the session's next one waits again.
    with connection.cursor() as cursor:
        cursor.execute("SHOW synchronous_commit")
        assert cursor.fetchone()[0] == "on"
    assert Lock.objects.get(key="flush").holder == ""


def test_a_transaction_that_wrote_before_the_release_stays_durable() -> None:
    assert _release_in_a_transaction("flush", write_first=True) == (True, "on")


def test_an_acquire_waits_for_its_wal_flush() -> None:
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(ACQUIRE, ("flush", "A", "0" * 64, 30.0, 0.0, MAX_TOKEN, MAX_TOKEN))
        assert cursor.fetchone()[0] is True
        cursor.execute("SHOW synchronous_commit")
        assert cursor.fetchone()[0] == "on"
