"""The keep-alive on its own: a thread with its own connection renews a lease
while the body runs, retries a renewal that failed while the lease is certainly
live, and marks the grant lost once it may have expired.

Leases here are the shortest the docs call safe with the keep-alive (5 s), so a
loaded machine's stalls (a renewal of the thread can be late by a fraction of a
second) never decide an outcome, and every bound on a time leaves seconds of
slack; the one-second figures are measured by tests/support/keepalive_probe.py
instead.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from decimal import Decimal
from typing import Any

import pytest
from django.db import connection

from coordination import locks, signals
from coordination.contrib.execution import FencedExecution, KeepAlive
from coordination.exceptions import LeaseLost, LockHeld
from coordination.models import Grant
from project.demo.models import Account
from tests.support.factories import AccountFactory
from tests.support.waiting import wait_for, wait_until_database_time_passes

pytestmark = pytest.mark.django_db(transaction=True)

TTL = 5.0


def burn_cpu(seconds: float) -> None:
    """A CPU-bound body in pure Python: it holds the GIL except when the
    interpreter hands it over (every sys.getswitchinterval())."""
    end = time.monotonic() + seconds
    total = 0
    while time.monotonic() < end:
        total += sum(i * i for i in range(1_000))


def test_keepalive_keeps_the_lease_through_a_cpu_bound_body_of_several_ttls() -> None:
    grant = locks.acquire("job:keep", holder="me", ttl=TTL)
    keeper = KeepAlive(grant, ttl=TTL).start()
    started = time.monotonic()
    try:
        burn_cpu(TTL + 1)  # past the lease as first granted
        with pytest.raises(LockHeld):
            locks.acquire("job:keep", holder="other", ttl=TTL)
        burn_cpu(2 * TTL + 1 - (time.monotonic() - started))
        with pytest.raises(LockHeld):
            locks.acquire("job:keep", holder="other", ttl=TTL)
    finally:
        keeper.stop()
    ran = time.monotonic() - started
    assert not grant.lost
    # A third of the ttl after each renewal started: never more often (a bug that
    # renewed in a loop would show here), and at least once per ttl.
    assert ran / TTL <= keeper.renewals <= ran / (TTL / 3) + 1, (keeper.renewals, ran)
    assert keeper.retries == 0
    locks.release(grant)


def test_keepalive_marks_the_grant_lost_when_a_renewal_fails_and_later_writes_are_refused() -> None:
    account = AccountFactory(balance=Decimal("1.00"))
    lost: list[Grant] = []

    def on_lost(sender: Any, grant: Grant, **kwargs: Any) -> None:
        lost.append(grant)

    signals.lock_lost.connect(on_lost)
    try:
        with FencedExecution(f"account:{account.pk}", holder="me", ttl=TTL) as grant:
            locks.revoke(f"account:{account.pk}")  # an operator takes the lock away
            wait_for(lambda: grant.lost, what="the keep-alive noticing the revoke")
            with pytest.raises(LeaseLost):
                Account.objects.filter(pk=account.pk).fenced_update(balance=Decimal("2.00"))
    finally:
        signals.lock_lost.disconnect(on_lost)

    assert lost == [grant]
    assert Account.objects.get(pk=account.pk).balance == Decimal("1.00")
    assert locks.current_grant() is None


def other_backends() -> list[int]:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database()"
            " AND pid <> pg_backend_pid() AND backend_type = 'client backend'"
        )
        return [row[0] for row in cursor.fetchall()]


def cut_off(pids: list[int]) -> None:
    with connection.cursor() as cursor:
        for pid in pids:
            cursor.execute("SELECT pg_terminate_backend(%s)", [pid])


@contextmanager
def database_refusing_new_connections() -> Iterator[None]:
    """New connections to the test database fail (superusers too); open ones stay.

    PostgreSQL only lets another database's session change that."""
    import psycopg

    settings = connection.settings_dict
    quoted = connection.ops.quote_name(settings["NAME"])
    with psycopg.connect(
        host=settings["HOST"] or None, port=settings["PORT"] or None, user=settings["USER"] or None,
        password=settings["PASSWORD"] or None, dbname="postgres", autocommit=True,
    ) as admin:
        admin.execute(f"ALTER DATABASE {quoted} ALLOW_CONNECTIONS false")
        try:
            yield
        finally:
            admin.execute(f"ALTER DATABASE {quoted} ALLOW_CONNECTIONS true")


@pytest.mark.postgres
def test_a_renewal_cut_off_by_the_database_is_retried_and_the_lease_kept() -> None:
    grant = locks.acquire("job:cut", holder="me", ttl=TTL)
    keeper = KeepAlive(grant, ttl=TTL).start()
    try:
        wait_for(lambda: keeper.renewals >= 1, what="a first renewal")
        cut_off(other_backends())  # a restart or a proxy dropping it: the next renewal fails
        wait_for(lambda: keeper.retries >= 1 and keeper.renewals >= 2, what="a retried renewal")
        deadline = time.monotonic() + TTL + 2
        while time.monotonic() < deadline:  # well past the lease the retry saved (at most TTL)
            assert not grant.lost
            time.sleep(0.1)
        with pytest.raises(LockHeld):
            locks.acquire("job:cut", holder="other", ttl=TTL)
    finally:
        keeper.stop()
    assert not grant.lost
    locks.release(grant)


@pytest.mark.postgres
def test_renewals_failing_until_the_lease_may_have_expired_mark_the_grant_lost_then() -> None:
    grant = locks.acquire("job:down", holder="me", ttl=TTL)
    keeper = KeepAlive(grant, ttl=TTL).start()
    try:
        wait_for(lambda: keeper.renewals >= 1, what="a first renewal")
        with database_refusing_new_connections():
            cut_off(other_backends())
            cut_at = time.monotonic()
            wait_for(lambda: grant.lost, timeout=4 * TTL, what="the grant marked lost")
            lost_after = time.monotonic() - cut_at
    finally:
        keeper.stop()
    # Not at the first failed renewal: only once no renewal could have kept the
    # lease (its deadline is at most one ttl after the last renewal started, and
    # that start was at most a third of the ttl before the cut, give or take the
    # thread's scheduling). The bounds leave 2 s of slack to a loaded machine.
    assert keeper.retries >= 2
    assert TTL / 4 < lost_after <= TTL + 2.5, lost_after
    # Rightly so: by the database's clock the lease did run out.
    wait_until_database_time_passes(grant.expires_at)
    with pytest.raises(LeaseLost, match="expired"):
        locks.release(grant)
