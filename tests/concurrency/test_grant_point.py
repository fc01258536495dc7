"""Interleavings on PostgreSQL's row locks that a grant point must survive: the function
path (one call per acquire and release) and the ORM transaction alike; and the function
path's prepared calls."""

from __future__ import annotations

import threading

import pytest
from django.db import connection, connections

from coordination import locks
from coordination.backends import get_backend
from coordination.backends.base import format_sql
from coordination.backends.postgresql import ACQUIRE
from coordination.backends.postgresql.calls import statement_name
from coordination.exceptions import LeaseLost
from coordination.leases import Lease
from coordination.models import Grant, GrantEnd, Lock
from tests.support.waiting import (
    wait_for,
    wait_until_blocked_on_a_row_lock,
    wait_until_database_time_passes,
)

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.postgres]


@pytest.mark.usefixtures("grant_point")
def test_grant_issued_and_expired_while_waiting_for_the_row_lock_is_closed_as_expired() -> None:
    # The acquire's snapshot predates its wait for the row lock; a grant that was
    # issued and ran out meanwhile is invisible to it, yet must end up closed.
    first = locks.acquire("snap", holder="A", ttl=30)
    locks.release(first)
    lock = Lock.objects.get(key="snap")
    blocker = connections.create_connection("default")
    waiter_pid: list[int] = []
    outcome: list[object] = []

    def acquire_behind_the_blocker() -> None:
        try:
            with connection.cursor() as cursor:
                cursor.execute("SELECT pg_backend_pid()")
                waiter_pid.append(cursor.fetchone()[0])
            outcome.append(locks.acquire("snap", holder="B", ttl=30))
        except Exception as error:  # pragma: no cover - reported below
            outcome.append(error)
        finally:
            connections.close_all()

    try:
        blocker.set_autocommit(False)
        with blocker.cursor() as cursor:
            cursor.execute("SELECT id FROM coordination_lock WHERE key = 'snap' FOR UPDATE")
            waiter = threading.Thread(target=acquire_behind_the_blocker)
            waiter.start()
            wait_for(lambda: waiter_pid, what="the waiter's backend pid")
            wait_until_blocked_on_a_row_lock(waiter_pid[0])
            # Another grant, already expired, committed while the waiter waits.
            cursor.execute(
                "UPDATE coordination_lock SET token = 2, holder = 'X', lease_hash = 'h',"
                " acquired_at = clock_timestamp() - interval '2 s',"
                " expires_at = clock_timestamp() - interval '1 s' WHERE id = %s",
                [lock.pk],
            )
            cursor.execute(
                "INSERT INTO coordination_grant (lock_id, token, holder, lease_hash, acquired_at,"
                " expires_at, end_reason) VALUES (%s, 2, 'X', 'h',"
                " clock_timestamp() - interval '2 s', clock_timestamp() - interval '1 s', '')",
                [lock.pk],
            )
        blocker.commit()
        waiter.join(30)
    finally:
        blocker.close()

    granted = outcome[0]
    assert isinstance(granted, Lease), granted
    assert granted.token == 3
    expired = Grant.objects.get(lock=lock, token=2)
    assert (expired.end_reason, expired.ended_at) == (GrantEnd.EXPIRED, expired.expires_at)
    assert not Grant.objects.filter(lock=lock, ended_at=None).exclude(token=3).exists()


@pytest.mark.usefixtures("grant_point")
def test_release_of_a_lease_taken_over_says_so_and_leaves_the_new_holder_alone() -> None:
    old = locks.acquire("over", holder="A", ttl=0.1)
    wait_until_database_time_passes(old.expires_at)
    new = locks.acquire("over", holder="B", ttl=30)

    with pytest.raises(LeaseLost, match="taken over"):
        locks.release(old)
    assert Lock.objects.get(key="over").holder == "B"
    assert Grant.objects.of(old).get().end_reason == GrantEnd.EXPIRED
    locks.release(new)


def _prepared_calls() -> set[str]:
    with connection.cursor() as cursor:
        cursor.execute("SELECT statement FROM pg_prepared_statements")
        return {row[0] for row in cursor.fetchall() if "coordination_" in row[0]}


def _fresh_connection(settings: object, setting: bool | None, threshold: int | None = None) -> None:
    settings.COORDINATION = {  # type: ignore[attr-defined]
        **settings.COORDINATION, "PREPARED_STATEMENTS": setting,  # type: ignore[attr-defined]
    }
    connection.close()
    connection.ensure_connection()
    connection.connection.prepare_threshold = threshold
    assert get_backend().name == "postgresql"  # the default: functions


@pytest.mark.parametrize(
    ("setting", "threshold", "prepared"),
    [(True, None, True), (None, None, False), (None, 5, True), (False, 5, False)],
)
def test_the_grant_points_calls_are_prepared_on_their_second_use_as_configured(
    settings: object, setting: bool | None, threshold: int | None, prepared: bool
) -> None:
    # True (the default) prepares whatever the connection does; None follows the
    # connection (Django leaves preparation off unless OPTIONS["prepare_threshold"]
    # is set); False never. A connection that runs each call once prepares nothing.
    _fresh_connection(settings, setting, threshold)
    try:
        locks.release(locks.acquire("prep", holder="A", ttl=30))
        assert _prepared_calls() == set()
        locks.release(locks.acquire("prep", holder="A", ttl=30))
        calls = _prepared_calls()
        # The connection's own statements keep the connection's threshold.
        assert connection.connection.prepare_threshold == threshold
    finally:
        connection.close()
    assert (len(calls) == 2) is prepared, calls


def test_a_proxy_that_loses_prepared_statements_costs_no_grant_and_ends_preparing(
    settings: object, caplog: pytest.LogCaptureFixture
) -> None:
    # A transaction-pooling proxy sends the next statement to a server session that
    # never saw the prepare: here the server forgets them behind psycopg's back.
    _fresh_connection(settings, True)
    try:
        for _ in range(2):
            locks.release(locks.acquire("pooled", holder="A", ttl=30))
        assert len(_prepared_calls()) == 2
        connection.connection.pgconn.exec_(b"DEALLOCATE ALL")
        with caplog.at_level("WARNING", logger="coordination.locks"):
            grant = locks.acquire("pooled", holder="B", ttl=30)
            locks.release(grant)
        assert grant.token == 3
        assert Grant.objects.of(grant).get().end_reason == GrantEnd.RELEASED
        assert "PREPARED_STATEMENTS" in caplog.text
        for _ in range(3):
            locks.release(locks.acquire("pooled", holder="C", ttl=30))
        assert _prepared_calls() == set()
    finally:
        connection.close()


def test_a_proxy_session_holding_the_same_statement_name_costs_no_grant(settings: object) -> None:
    # Another client's statement under the name the acquire is prepared as (42P05).
    _fresh_connection(settings, True)
    try:
        name = statement_name(format_sql(ACQUIRE, connection)).decode()
        connection.connection.pgconn.exec_(f"PREPARE {name} AS SELECT 1".encode())
        tokens = []
        for _ in range(3):
            grant = locks.acquire("named", holder="A", ttl=30)
            tokens.append(grant.token)
            locks.release(grant)
        assert tokens == [1, 2, 3]
        assert {text for text in _prepared_calls() if "SELECT 1" not in text} == set()
    finally:
        connection.close()
