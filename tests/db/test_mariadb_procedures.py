"""MariaDB's grant point: one stored-procedure call per acquire and per release.

What the procedures decide is checked against the Python rule by the grid of
``test_grant_rule.py``, and what they do by the lock tests, which run on them
by default on this leg; here, what the client sends and what a database
without the procedures says.
"""

from __future__ import annotations

import datetime as dt

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.db import connection

from coordination import locks
from coordination.backends import get_backend, mysql
from coordination.exceptions import LeaseLost, LockHeld
from coordination.models import Grant, Lock, Ticket

pytestmark = [
    pytest.mark.django_db,
    pytest.mark.legs("mariadb", reason="the grant point's stored procedures are MariaDB's"),
]


def statements_sent() -> int:
    """Statements this connection's client has sent (a procedure's own do not count)."""
    with connection.cursor() as cursor:
        cursor.execute("SHOW SESSION STATUS LIKE 'Questions'")
        return int(cursor.fetchone()[1])


def test_an_acquire_and_a_release_are_one_call_each(grant_point: str) -> None:
    locks.release(locks.acquire("calls-warm", holder="A", ttl=5))  # the connection's set-up
    before = statements_sent()
    for number in range(5):
        locks.release(locks.acquire(f"calls-{number % 2}", holder="A", ttl=5))
    sent = (statements_sent() - before - 1) / 5  # minus the SHOW itself
    if grant_point == "mysql":
        assert sent == 2
    else:  # the ORM transaction: BEGIN to COMMIT, and the idle bound's SETs
        assert sent > 10


def test_the_procedures_raise_what_the_orm_transaction_raises() -> None:
    assert get_backend().name == "mysql"
    lease = locks.acquire("procs-errors", holder="A", ttl=30)
    with pytest.raises(LockHeld) as held:
        locks.acquire("procs-errors", holder="B", ttl=30)
    assert held.value.holder == "A"
    assert 25 < held.value.retry_after <= 30
    locks.release(lease)
    with pytest.raises(LeaseLost, match="is free"):
        locks.release(lease)
    assert Grant.objects.of(lease).get().end_reason == "released"
    again = locks.acquire("procs-errors", holder="B", ttl=30)
    assert again.token == lease.token + 1
    with pytest.raises(LeaseLost, match="taken over"):
        locks.release(lease)


def test_a_refused_first_acquire_leaves_no_row() -> None:
    # A refusal rolls back, as the ORM transaction's does: the row made for a new
    # key (here refused for a fair waiter ahead) is not kept.
    now = locks.database_now()
    Ticket.objects.create(lock_key="procs-new", holder="W", expires_at=now + dt.timedelta(seconds=60))
    with pytest.raises(LockHeld):
        locks.acquire("procs-new", holder="A", ttl=5)
    assert not Lock.objects.filter(key="procs-new").exists()


@pytest.mark.django_db(transaction=True)  # DROP PROCEDURE commits whatever is open
def test_missing_procedures_say_what_to_do() -> None:
    with connection.cursor() as cursor:
        cursor.execute("DROP PROCEDURE coordination_acquire")
    try:
        with pytest.raises(ImproperlyConfigured, match=r"Run migrate.*GRANT_POINT"):
            locks.acquire("procs-missing", holder="A", ttl=5)
    finally:
        mysql.install(connection)
    locks.release(locks.acquire("procs-missing", holder="A", ttl=5))
