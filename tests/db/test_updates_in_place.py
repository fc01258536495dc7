"""The rows written on every use stay on their page (HOT updates), even on full tables.

A lock row is written by every acquire and release and a fence row by every
accepted write; no index covers a column those writes change, and the tables
leave a fifth of each page free (migration 0015), so PostgreSQL keeps the new
row version on its page and adds no index entries. At the default fillfactor a
table whose pages are full (a bulk load; a busy table whose rows have all been
written) sends every such update to another page and into every index. An
index added later on a written column would break this too: these tests say so.
"""

from __future__ import annotations

import pytest
from django.db import connection

from coordination import locks
from coordination.fencing import fence
from coordination.models import Fence, Lock

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.postgres]

ROWS = 600  # a few pages of rows
EVERY = 25  # the rows written: a few per page, spread over all of them


def _updates(table: str) -> tuple[int, int]:
    """(updates, HOT updates) of ``table`` so far, this backend's included."""
    with connection.cursor() as cursor:
        # Pending counts reach the shared statistics when this statement ends.
        cursor.execute("SELECT pg_stat_force_next_flush()")
        cursor.execute(
            "SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables WHERE relid = %s::regclass",
            [table],
        )
        updated, hot = cursor.fetchone()
    return updated, hot


def test_acquire_and_release_update_lock_rows_in_place() -> None:
    Lock.objects.bulk_create([Lock(key=f"page-{n}") for n in range(ROWS)])
    updated_before, hot_before = _updates(Lock._meta.db_table)
    for n in range(0, ROWS, EVERY):
        locks.release(locks.acquire(f"page-{n}", holder="writer", ttl=30))
    updated, hot = _updates(Lock._meta.db_table)
    assert updated - updated_before >= 2 * (ROWS // EVERY)  # each acquire and release
    assert hot - hot_before == updated - updated_before


def test_accepted_writes_update_fence_rows_in_place() -> None:
    Fence.objects.bulk_create(
        [Fence(resource=f"page-{n}", lock_key="page-writer") for n in range(ROWS)]
    )
    grant = locks.acquire("page-writer", holder="writer", ttl=30)
    updated_before, hot_before = _updates(Fence._meta.db_table)
    for n in range(0, ROWS, EVERY):
        with fence(f"page-{n}", grant):
            pass
    updated, hot = _updates(Fence._meta.db_table)
    assert updated - updated_before >= ROWS // EVERY
    assert hot - hot_before == updated - updated_before
