"""The rows written on every use stay on their page (HOT updates), even on full tables.

A lock row is written by every acquire and release and a fence row by every
accepted write; no index covers a column those writes change, and the tables
leave a fifth of each page free (migration 0015), so PostgreSQL keeps the new
row version on its page and adds no index entries. At the default fillfactor a
table whose pages are full (a bulk load; a busy table whose rows have all been
written) sends every such update to another page and into every index. An
index added later on a written column would break this too: these tests say so.

Two measures, neither of which another session can make fail: the page of each
row this test wrote (its own rows, before and after), and the table's HOT
updates in the shared statistics, which other sessions can only add to. The
counterpart at fillfactor 100 shows both measures do see updates that leave
their page.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import pytest
from django.db import connection

from coordination import locks
from coordination.backends import postgresql
from coordination.fencing import fence
from coordination.models import Fence, Lock

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.postgres]

ROWS = 600  # a few pages of rows
EVERY = 25  # the rows written: a few per page, spread over all of them
WRITTEN = [f"page-{n}" for n in range(0, ROWS, EVERY)]


def _updates(table: str) -> tuple[int, int]:
    """(updates, HOT updates) of ``table`` in the shared statistics, this backend's included."""
    with connection.cursor() as cursor:
        # This backend's pending counts reach the shared statistics when this
        # statement ends; the next read then takes a fresh snapshot of them.
        cursor.execute("SELECT pg_stat_force_next_flush()")
        cursor.execute("SELECT pg_stat_clear_snapshot()")
        cursor.execute(
            "SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables WHERE relid = %s::regclass",
            [table],
        )
        updated, hot = cursor.fetchone()
    return updated, hot


def _pages(table: str, column: str, values: list[str]) -> dict[str, int]:
    """The page (block number) each row of ``table`` with ``column`` in ``values`` is on."""
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT {column}, (ctid::text::point)[0]::bigint FROM {table} WHERE {column} = ANY(%s)",
            [values],
        )
        return dict(cursor.fetchall())


@dataclass(frozen=True)
class Writes:
    """What one test's writes did to its own rows and to the table's statistics."""

    expected: int  # the updates this test made
    moved: list[str]  # its rows no longer on the page they started on
    updates: int  # in the statistics: this test's, and any other session's meanwhile
    hot: int

    @property
    def all_in_place(self) -> bool:
        # Another session's updates can only add to the counts: every update of
        # this test was HOT if its rows stayed put and the HOT count grew by at
        # least as many updates as it made.
        return not self.moved and self.hot >= self.expected


def measure(
    model: type[Lock] | type[Fence], column: str, write: Callable[[str], None], per_row: int
) -> Writes:
    """Write each row of ``WRITTEN`` with ``write`` (``per_row`` updates each)."""
    table = model._meta.db_table
    before = _pages(table, column, WRITTEN)
    updated_before, hot_before = _updates(table)
    for value in WRITTEN:
        write(value)
    updated, hot = _updates(table)
    after = _pages(table, column, WRITTEN)
    assert sorted(before) == sorted(after) == sorted(WRITTEN)
    return Writes(
        expected=per_row * len(WRITTEN),
        moved=[value for value in WRITTEN if after[value] != before[value]],
        updates=updated - updated_before,
        hot=hot - hot_before,
    )


def acquire_and_release(key: str) -> None:
    locks.release(locks.acquire(key, holder="writer", ttl=30))


def lock_rows_written() -> Writes:
    Lock.objects.bulk_create([Lock(key=f"page-{n}") for n in range(ROWS)])
    return measure(Lock, "key", acquire_and_release, per_row=2)  # an acquire and a release


@contextmanager
def fillfactor(model: type[Lock] | type[Fence], value: int) -> Iterator[None]:
    """The table of ``model`` at ``value`` for the block, then the migration's again."""
    postgresql.leave_room_for_updates(connection, model, fillfactor=value)
    try:
        yield
    finally:
        postgresql.leave_room_for_updates(connection, model)


def test_acquire_and_release_update_lock_rows_in_place() -> None:
    writes = lock_rows_written()
    assert writes.updates >= writes.expected
    assert writes.all_in_place, writes


def test_accepted_writes_update_fence_rows_in_place() -> None:
    Fence.objects.bulk_create(
        [Fence(resource=f"page-{n}", lock_key="page-writer") for n in range(ROWS)]
    )
    grant = locks.acquire("page-writer", holder="writer", ttl=30)

    def write(resource: str) -> None:
        with fence(resource, grant):
            pass

    writes = measure(Fence, "resource", write, per_row=1)
    assert writes.updates >= writes.expected
    assert writes.all_in_place, writes


def test_on_full_pages_the_same_measures_see_updates_leave_their_page() -> None:
    """The counterpart: at PostgreSQL's default fillfactor (100) the bulk load
    fills every page, and the first update of a row on a full page moves it
    (measured: 36 of 48 updates HOT). Were the measures blind, the tests above
    could not fail."""
    with fillfactor(Lock, 100):
        writes = lock_rows_written()
    assert writes.updates >= writes.expected
    assert writes.moved, writes
    # Not all HOT: another session's update adds to the updates, HOT or not.
    assert writes.hot < writes.updates, writes
    assert not writes.all_in_place
