"""The grant point's calls sent as prepared statements on the libpq handle
(coordination/backends/postgresql/calls.py) return what the cursor returns,
are prepared from their second use under their own name, and leave anything
they cannot send in text form to the cursor."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator

import pytest
from django.db import DataError, IntegrityError, connection, connections, transaction

from coordination import locks
from coordination.backends import get_backend
from coordination.backends.base import WAKE_UP_CHANNEL, format_sql
from coordination.backends.postgresql import ACQUIRE, RELEASE
from coordination.backends.postgresql.calls import (
    DIRECT,
    PreparedCalls,
    statement_name,
    text_values,
)
from coordination.models import MAX_TOKEN, Grant, GrantEnd, hash_lease_id

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.postgres]


@pytest.fixture
def fresh() -> Iterator[None]:
    """A connection of this test's own: its prepared statements start empty."""
    connection.close()
    connection.ensure_connection()
    yield
    connection.close()


def _server_statements() -> dict[str, str]:
    with connection.cursor() as cursor:
        cursor.execute("SELECT name, statement FROM pg_prepared_statements")
        return dict(cursor.fetchall())


def test_text_values_spell_what_postgresql_reads() -> None:
    assert text_values((None, True, False, "kéy", 7, -2**63, 0.25, 1e-05), "utf-8") == [
        None, b"t", b"f", "kéy".encode(), b"7", b"-9223372036854775808", b"0.25", b"1e-05",
    ]
    # What only the cursor's dumpers can send goes through the cursor.
    assert text_values(("a\x00b",), "utf-8") is None
    assert text_values((dt.datetime.now(dt.UTC),), "utf-8") is None
    assert text_values((b"bytes",), "utf-8") is None


def test_statement_names_follow_the_text() -> None:
    assert statement_name("SELECT 1") == statement_name("SELECT 1")
    assert statement_name("SELECT 1") != statement_name("SELECT 2")
    assert statement_name("SELECT 1").startswith(b"coordination_")


@pytest.mark.skipif(not DIRECT, reason="this psycopg lacks the interfaces the direct calls use")
def test_calls_are_prepared_on_their_second_use_under_their_own_names(fresh: None) -> None:
    locks.release(locks.acquire("direct", holder="A", ttl=30))
    assert not [name for name in _server_statements() if name.startswith("coordination_")]
    for holder in ("B", "C"):
        grant = locks.acquire("direct", holder=holder, ttl=30)
        locks.release(grant)
    names = {
        statement_name(format_sql(ACQUIRE, connection)).decode(),
        statement_name(format_sql(RELEASE, connection)).decode(),
    }
    assert names <= set(_server_statements())
    assert grant.token == 3
    assert Grant.objects.of(grant).get().end_reason == GrantEnd.RELEASED


@pytest.mark.skipif(not DIRECT, reason="this psycopg lacks the interfaces the direct calls use")
def test_a_direct_call_returns_the_row_the_cursor_returns(fresh: None) -> None:
    backend = get_backend()
    cursor = backend._cursor(connections["default"])  # the grant point's cursor and loaders
    calls = PreparedCalls.of(cursor)
    sql = format_sql(ACQUIRE, connection)
    lease_hash = hash_lease_id("secret")
    params = ("rows", "A", lease_hash, 30.0, 0.0, MAX_TOKEN, MAX_TOKEN)
    first = calls.run(sql, params)  # the first use runs on the cursor
    release = format_sql(RELEASE, connection)
    calls.run(release, ("rows", first[2], lease_hash, True, WAKE_UP_CHANNEL))
    assert sql not in calls.prepared
    second = calls.run(sql, params)  # prepared, sent on the libpq handle
    assert sql in calls.prepared
    assert len(second) == len(first)
    assert [type(value) for value in second] == [type(value) for value in first]
    assert second[0] is True and second[2] == first[2] + 1
    assert second[4].tzinfo is not None and second[4].utcoffset() == dt.timedelta(0)
    assert second[5] - second[4] == dt.timedelta(seconds=30)
    released = calls.run(release, ("rows", second[2], lease_hash, True, WAKE_UP_CHANNEL))
    assert released is not None and released[0] is True


@pytest.mark.skipif(not DIRECT, reason="this psycopg lacks the interfaces the direct calls use")
def test_a_refused_direct_call_raises_as_the_cursor_does(fresh: None) -> None:
    backend = get_backend()
    calls = PreparedCalls.of(backend._cursor(connections["default"]))
    sql = "SELECT 1 / %s"
    assert calls.run(sql, (1,)) == (1,)
    with connection.wrap_database_errors:
        assert calls.run(sql, (1,)) == (1,)
    assert sql in calls.prepared
    with pytest.raises(DataError) as refused, connection.wrap_database_errors:  # Django's
        calls.run(sql, (0,))
    assert refused.value.__cause__.sqlstate == "22012"  # division_by_zero
    # The session is usable, and a statement that returns no rows returns None.
    assert calls.run("SELECT 1 WHERE %s", (False,)) is None
    assert calls.run("SELECT 1 WHERE %s", (False,)) is None


@pytest.mark.skipif(not DIRECT, reason="this psycopg lacks the interfaces the direct calls use")
def test_a_direct_call_inside_a_transaction_belongs_to_it(fresh: None) -> None:
    backend = get_backend()
    calls = PreparedCalls.of(backend._cursor(connections["default"]))
    sql = "SELECT txid_current() + %s"
    outside = {calls.run(sql, (0,))[0] for _ in range(3)}
    assert len(outside) == 3 and sql in calls.prepared  # autocommit: one transaction each
    with pytest.raises(IntegrityError), transaction.atomic():
        # psycopg opens the caller's transaction before its first statement:
        # that statement must not slip past it.
        ids = {calls.run(sql, (0,))[0] for _ in range(3)}
        assert len(ids) == 1  # one transaction: the caller's
        raise IntegrityError("roll back")


@pytest.mark.skipif(not DIRECT, reason="this psycopg lacks the interfaces the direct calls use")
def test_a_new_cursor_on_the_same_connection_keeps_its_prepared_calls(
    fresh: None, caplog: pytest.LogCaptureFixture
) -> None:
    # Django's pool hands the same psycopg connection to a new connection object,
    # which gets a cursor of its own: the server still has the statements.
    import psycopg

    raw = connection.connection
    sql = "SELECT %s::bigint * 2"
    first = PreparedCalls.of(psycopg.Cursor(raw))
    assert [first.run(sql, (n,)) for n in (1, 2)] == [(2,), (4,)]
    again = PreparedCalls.of(psycopg.Cursor(raw))
    assert again is first and sql in again.prepared
    with caplog.at_level("WARNING"):
        assert [again.run(sql, (n,)) for n in (3, 4)] == [(6,), (8,)]
    assert not caplog.records
    assert statement_name(sql).decode() in _server_statements()
