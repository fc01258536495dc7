"""The client side of a failover: a grant-point call whose connection is cut
raises GrantPointUnavailable, and the next call connects again
(docs/high-availability.md)."""

from __future__ import annotations

import pytest

from coordination import locks
from coordination.exceptions import GrantPointUnavailable
from coordination.models import Grant
from tests.support.connections import cut_this_connection

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.postgres]


def test_an_acquire_on_a_cut_connection_raises_unavailable_and_returns_no_lease() -> None:
    cut_this_connection()

    with pytest.raises(GrantPointUnavailable) as raised:
        locks.acquire("cut", holder="w", ttl=30)

    assert raised.value.code == "grant_point_unavailable"
    assert "No lease was returned" in raised.value.detail
    assert not Grant.objects.filter(lock__key="cut").exists()
    # The broken connection was closed: the retry connects again and is granted.
    lease = locks.acquire("cut", holder="w", ttl=30)
    assert lease.token == 1


def test_a_renew_and_a_release_on_a_cut_connection_raise_unavailable() -> None:
    lease = locks.acquire("held", holder="w", ttl=30)
    cut_this_connection()
    with pytest.raises(GrantPointUnavailable):
        locks.renew(lease)
    cut_this_connection()
    with pytest.raises(GrantPointUnavailable):
        locks.release(lease)
    locks.release(lease)  # the lease was never lost
