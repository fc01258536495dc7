"""The promotion guard (migration 0012; docs/high-availability.md), on one server.

A promotion is simulated by recording another timeline in the token floor's
row: the grant point then sees "a new timeline" exactly as on a promoted
replica. The real failovers are in tests/cluster/.
"""

from __future__ import annotations

import copy

import pytest
from django.db import connection

from coordination import locks
from coordination.backends.postgresql import FAILOVER_MARGIN
from coordination.exceptions import LeaseLost, StaleToken
from coordination.fencing import fence
from coordination.models import Grant, GrantEnd, TokenFloor
from coordination.shared import acquire_shared
from tests.support.factories import LockFactory

pytestmark = [pytest.mark.django_db, pytest.mark.postgres]


def current_timeline() -> int:
    with connection.cursor() as cursor:
        cursor.execute("SELECT ('x' || left(pg_walfile_name(pg_current_wal_lsn()), 8))::bit(32)::integer")
        (timeline,) = cursor.fetchone()
    return int(timeline)


def record_timeline(timeline: int | None) -> None:
    TokenFloor.objects.get_or_create(pk=TokenFloor.ROW)
    TokenFloor.objects.filter(pk=TokenFloor.ROW).update(timeline=timeline)


def test_the_first_grant_on_a_new_timeline_raises_the_floor_revokes_and_closes_fences() -> None:
    record_timeline(current_timeline())
    held = locks.acquire("held", holder="old-primary", ttl=300)
    with fence("resource:held", held, step=1):
        pass
    LockFactory(key="busy-before", token=500)
    record_timeline(current_timeline() - 1)  # as a promoted replica sees it

    fresh = locks.acquire("fresh", holder="new-primary", ttl=30)

    floor = TokenFloor.objects.get()
    assert floor.token == 500 + FAILOVER_MARGIN
    assert floor.timeline == current_timeline()
    assert fresh.token == floor.token + 1
    assert Grant.objects.get(lock__key="held", token=held.token).end_reason == GrantEnd.REVOKED
    unaware = copy.copy(held)
    with pytest.raises(LeaseLost):
        locks.renew(held)
    with pytest.raises(StaleToken), fence("resource:held", unaware, step=2):
        pass
    # Done once: the next grant finds the timeline recorded.
    again = locks.acquire("held", holder="new-primary", ttl=30)
    assert again.token == floor.token + 1
    assert TokenFloor.objects.get().token == floor.token


def test_a_readers_grant_first_on_a_new_timeline_runs_the_guard_too() -> None:
    record_timeline(current_timeline())
    LockFactory(key="read-before", token=700)
    record_timeline(current_timeline() - 1)

    reader = acquire_shared("read-before", holder="new-primary", ttl=30)

    floor = TokenFloor.objects.get()
    assert (floor.token, floor.timeline) == (700 + FAILOVER_MARGIN, current_timeline())
    assert reader.token == floor.token + 1


def test_grants_on_the_recorded_timeline_change_nothing() -> None:
    record_timeline(current_timeline())
    first = locks.acquire("steady", holder="w", ttl=30)
    locks.release(first)
    second = locks.acquire("steady", holder="w", ttl=30)

    assert second.token == first.token + 1
    assert TokenFloor.objects.get().token == 0


def test_a_row_with_no_timeline_records_it_without_raising() -> None:
    record_timeline(None)
    lease = locks.acquire("first", holder="w", ttl=30)

    assert lease.token == 1
    assert TokenFloor.objects.get().timeline == current_timeline()
