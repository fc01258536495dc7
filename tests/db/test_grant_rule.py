"""The grant rule is written once in Python (``backends.base.grant_refusal``); the
PostgreSQL function's WHERE is its SQL twin. Here every backend of this database
decides a grid of lock states (free, held, expired, lock-delay running or over,
delay_until, fair-queue tickets, the last tokens), and must decide each one as the
Python rule does, so the two cannot drift apart."""

from __future__ import annotations

import datetime as dt
import itertools
from typing import Any

import pytest
from django.db import connection, transaction

from coordination import locks
from coordination.backends import get_backend
from coordination.backends.base import LockSnapshot, grant_refusal
from coordination.exceptions import InTransaction, LockHeld, TokenExhausted
from coordination.models import MAX_TOKEN, Grant, Lock, Ticket, hash_lease_id

pytestmark = pytest.mark.django_db

# Far from now, in database seconds, so the clock moving during the test never
# changes a state's outcome.
FAR = 1000.0

FREE = [
    {"holder": "", "expires_at": None, "lock_delay": delay, "delay_until": until}
    for delay, until in itertools.product([0.0, 50 * FAR], [None, -FAR, FAR])
]
HELD = [
    {"holder": "A", "expires_at": expires, "lock_delay": delay, "delay_until": None}
    for expires, delay in itertools.product([-FAR, FAR], [0.0, FAR / 2, 2 * FAR])
]
TICKETS = ["none", "live", "expired"]
TOKENS = [5, MAX_TOKEN - 1, MAX_TOKEN]


def states() -> list[tuple[dict[str, Any], str, int]]:
    return [(lock, tickets, token) for lock in FREE + HELD for tickets in TICKETS for token in TOKENS]


def at(now: dt.datetime, offset: float | None) -> dt.datetime | None:
    return None if offset is None else now + dt.timedelta(seconds=offset)


def outcome(refusal: Exception | None) -> str:
    return "granted" if refusal is None else type(refusal).__name__


def one_attempt(key: str) -> str:
    """What this run's grant point decides for ``key``: one attempt, no retry."""
    backend = get_backend()
    if backend.name == "postgresql":
        from coordination.backends.postgresql import ACQUIRE, PostgreSQLGrantPoint

        assert isinstance(backend, PostgreSQLGrantPoint)
        row = backend.call(
            ACQUIRE, (key, "B", hash_lease_id("x"), 30.0, 0.0, MAX_TOKEN, MAX_TOKEN)
        )
        granted, _, token, holder, _, expires_at, now, delay, delay_until, ahead = row[:10]
        if granted:
            return "granted"
        # Refused by the SQL: the Python rule must name a reason on the state it reports.
        reason = grant_refusal(
            LockSnapshot(key, token or 0, holder or "", "", expires_at, delay or 0.0, delay_until),
            now, ahead,
        )
        return outcome(reason) if reason is not None else "refused by SQL, grantable by the rule"
    try:
        backend.acquire(key, "B", 30.0, 0.0, None)
    except (LockHeld, TokenExhausted) as refusal:
        return outcome(refusal)
    return "granted"


@pytest.mark.usefixtures("grant_point")
def test_every_backend_decides_a_grid_of_lock_states_as_the_python_rule_does() -> None:
    now = locks.database_now()
    disagreements = []
    for number, (state, tickets, token) in enumerate(states()):
        key = f"grid-{number}"
        lock = Lock.objects.create(
            key=key, token=token, holder=state["holder"],
            lease_hash="h" if state["holder"] else "",
            acquired_at=at(now, -2 * FAR) if state["holder"] else None,
            expires_at=at(now, state["expires_at"]), lock_delay=state["lock_delay"],
            delay_until=at(now, state["delay_until"]),
        )
        if tickets != "none":
            offset = FAR if tickets == "live" else -FAR
            Ticket.objects.create(lock_key=key, holder="W", expires_at=at(now, offset))
        ahead = int(tickets == "live")
        expected = outcome(grant_refusal(LockSnapshot.of(lock), now, ahead))

        decided = one_attempt(key)

        if decided != expected:
            disagreements.append((state, tickets, token, expected, decided))
        elif decided == "granted":
            assert Lock.objects.get(key=key).token == token + 1
            assert Grant.objects.filter(lock__key=key, token=token + 1, holder="B").exists()
        else:
            assert Lock.objects.get(key=key).token == token  # a refusal issues no token
    assert not disagreements
    # The grid covers both answers of every clause.
    assert {"granted", "LockHeld", "TokenExhausted"} <= {
        outcome(grant_refusal(
            LockSnapshot("k", token, s["holder"], "", at(now, s["expires_at"]), s["lock_delay"],
                         at(now, s["delay_until"])), now, int(t == "live"),
        ))
        for s, t, token in states()
    }


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("grant_point")
def test_the_grant_point_refuses_a_transaction_opened_by_hand() -> None:
    # Not only atomic(): autocommit turned off by hand is the caller's transaction too.
    transaction.set_autocommit(False)
    try:
        with pytest.raises(InTransaction):
            locks.acquire("by-hand", holder="A", ttl=5)
    finally:
        transaction.rollback()
        transaction.set_autocommit(True)
    assert connection.get_autocommit()
    assert not Lock.objects.filter(key="by-hand", token__gt=0).exists()


@pytest.mark.postgres
def test_migrate_goes_on_without_the_functions_where_the_app_may_not_create_them(
    settings: Any,
) -> None:
    from coordination.backends import postgresql

    with connection.cursor() as cursor:
        cursor.execute("CREATE ROLE coordination_no_functions NOLOGIN")
        cursor.execute("GRANT USAGE ON SCHEMA public TO coordination_no_functions")
        cursor.execute("SET LOCAL ROLE coordination_no_functions")
    try:
        installed = postgresql.install_if_permitted(connection, lock=Lock, grant=Grant, ticket=Ticket)
    finally:
        with connection.cursor() as cursor:
            cursor.execute("RESET ROLE")
    assert installed is False
    # The transaction goes on (the refused statement was in a savepoint), and the
    # portable grant point needs no function.
    settings.COORDINATION = {**(getattr(settings, "COORDINATION", None) or {}), "GRANT_POINT": "orm"}
    with connection.cursor() as cursor:
        cursor.execute("GRANT ALL ON ALL TABLES IN SCHEMA public TO coordination_no_functions")
        cursor.execute("GRANT ALL ON ALL SEQUENCES IN SCHEMA public TO coordination_no_functions")
        cursor.execute("SET LOCAL ROLE coordination_no_functions")
    try:
        lease = locks.acquire("no-functions", holder="A", ttl=5)
        locks.release(lease)
    finally:
        with connection.cursor() as cursor:
            cursor.execute("RESET ROLE")
    assert Grant.objects.of(lease).get().end_reason == "released"
