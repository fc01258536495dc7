"""The grant rule is written once in Python (``backends.base.grant_refusal`` and
``next_token``); the PostgreSQL function's WHERE and SET, and the MariaDB
procedure's IF, are its SQL twins. Here every
backend of this database decides a grid of lock states (free, held, expired,
lock-delay running or over, delay_until, fair-queue tickets, the last tokens, a key
never granted) under a rising token floor (below, equal to and above the counters, up
to the largest token), and must decide each one as the Python rule does and issue the
token it names, so the two cannot drift apart."""

from __future__ import annotations

import datetime as dt
import itertools
from typing import Any

import pytest
from django.db import connection, transaction

import coordination.restore as restore
from coordination import locks
from coordination.backends import get_backend
from coordination.backends.base import LockSnapshot, grant_refusal, next_token
from coordination.exceptions import InTransaction, LockHeld, TokenExhausted
from coordination.models import MAX_TOKEN, Grant, Lock, Ticket, TokenFloor, hash_lease_id

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
NEVER_GRANTED = {"holder": "", "expires_at": None, "lock_delay": 0.0, "delay_until": None}
TICKETS = ["none", "live", "expired"]
# None: a key with no Lock row, never granted.
TOKENS = [None, 5, MAX_TOKEN - 1, MAX_TOKEN]
# The floor is one row for every key and never goes down: the grid runs once per
# floor, in rising order. Below, equal to and above 5 and MAX_TOKEN - 1, then the
# largest token.
FLOORS = [0, 4, 5, 6, MAX_TOKEN - 2, MAX_TOKEN - 1, MAX_TOKEN]


def states() -> list[tuple[dict[str, Any], str, int | None]]:
    return [
        (NEVER_GRANTED if token is None else lock, tickets, token)
        for token in TOKENS
        for lock in ([NEVER_GRANTED] if token is None else FREE + HELD)
        for tickets in TICKETS
    ]


def at(now: dt.datetime, offset: float | None) -> dt.datetime | None:
    return None if offset is None else now + dt.timedelta(seconds=offset)


def outcome(refusal: Exception | None) -> str:
    return "granted" if refusal is None else type(refusal).__name__


def one_attempt(key: str) -> str:
    """What this run's grant point decides for ``key``: one attempt, no retry."""
    backend = get_backend()
    if backend.name in ("postgresql", "mysql"):
        # The function's or the procedure's own decision, read from its row.
        params = (key, "B", hash_lease_id("x"), 30.0, 0.0, MAX_TOKEN, MAX_TOKEN)
        if backend.name == "postgresql":
            from coordination.backends.postgresql import ACQUIRE, PostgreSQLGrantPoint

            assert isinstance(backend, PostgreSQLGrantPoint)
            row = backend.call(ACQUIRE, params)
        else:
            from coordination.backends import mysql

            assert isinstance(backend, mysql.MySQLGrantPoint)
            row = tuple(
                value.replace(tzinfo=dt.UTC) if isinstance(value, dt.datetime) else value
                for value in backend.call(mysql.ACQUIRE_PROCEDURE, params)
            )
            if row[0]:  # granted: its token is checked against the floor below
                return "granted"
            # Refused: the lock's state, the clock, the waiters ahead and the floor,
            # here in the PostgreSQL function's columns.
            _, token, holder, expires_at, now, delay, delay_until, ahead, floor = row
            row = (False, None, token, holder, None, expires_at, now, delay, delay_until, ahead, floor)
        granted, _, token, holder, _, expires_at, now, delay, delay_until, ahead = row[:10]
        floor = row[-1]
        assert floor == TokenFloor.objects.value()  # the function read the floor that is set
        if granted:
            return "granted"
        # Refused by the SQL: the Python rule must name a reason on the state it reports.
        reason = grant_refusal(
            LockSnapshot(key, token or 0, holder or "", "", expires_at, delay or 0.0, delay_until),
            now, ahead, floor,
        )
        return outcome(reason) if reason is not None else "refused by SQL, grantable by the rule"
    try:
        backend.acquire(key, "B", 30.0, 0.0, None)
    except (LockHeld, TokenExhausted) as refusal:
        return outcome(refusal)
    return "granted"


@pytest.mark.usefixtures("grant_point")
@pytest.mark.legs(
    "pg", "sqlite", "mariadb",
    reason="the grid checks SQL against Python; the LTS Django changes neither",
)
def test_every_backend_decides_a_grid_of_lock_states_as_the_python_rule_does() -> None:
    now = locks.database_now()
    assert TokenFloor.objects.value() == 0
    disagreements = []
    decided_by_rule = set()
    for floor in FLOORS:
        assert restore.raise_floor_to(floor) == floor
        for number, (state, tickets, token) in enumerate(states()):
            key = f"grid-{floor}-{number}"
            if token is None:
                snapshot = LockSnapshot(key, 0, "", "", None, 0.0, None)
            else:
                lock = Lock.objects.create(
                    key=key, token=token, holder=state["holder"],
                    lease_hash="h" if state["holder"] else "",
                    acquired_at=at(now, -2 * FAR) if state["holder"] else None,
                    expires_at=at(now, state["expires_at"]), lock_delay=state["lock_delay"],
                    delay_until=at(now, state["delay_until"]),
                )
                snapshot = LockSnapshot.of(lock)
            if tickets != "none":
                offset = FAR if tickets == "live" else -FAR
                Ticket.objects.create(lock_key=key, holder="W", expires_at=at(now, offset))
            ahead = int(tickets == "live")
            expected = outcome(grant_refusal(snapshot, now, ahead, floor))
            decided_by_rule.add((expected, (token or 0) < floor, token == floor))

            decided = one_attempt(key)

            if decided != expected:
                disagreements.append((floor, state, tickets, token, expected, decided))
            elif decided == "granted":
                issued = next_token(snapshot, floor)
                assert issued == max(token or 0, floor) + 1
                assert Lock.objects.get(key=key).token == issued
                assert Grant.objects.filter(lock__key=key, token=issued, holder="B").exists()
            else:  # a refusal issues no token
                assert Lock.objects.filter(key=key).values_list("token", flat=True).first() == token
    assert not disagreements
    # The grid covers both answers of every clause, and grants with the floor below,
    # equal to and above the counter.
    assert {"granted", "LockHeld", "TokenExhausted"} <= {outcome for outcome, *_ in decided_by_rule}
    granted = {(below, equal) for outcome, below, equal in decided_by_rule if outcome == "granted"}
    assert {(True, False), (False, True), (False, False)} <= granted


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
        installed = postgresql.install_if_permitted(connection)
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
