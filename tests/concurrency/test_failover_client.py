"""The client side of a failover: a grant-point call whose connection is cut
raises GrantPointUnavailable, and the next call connects again
(docs/high-availability.md)."""

from __future__ import annotations

import psycopg
import pytest
from django.db import connection

from coordination import locks
from coordination.exceptions import GrantPointUnavailable
from coordination.models import Grant

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.postgres]


def cut_this_connection() -> None:
    """Terminate this thread's server process from another connection, as a
    failover does to every connection of the old primary."""
    connection.ensure_connection()
    pid = connection.connection.info.backend_pid
    params = connection.get_connection_params()
    for django_only in ("cursor_factory", "context", "server_side_binding"):
        params.pop(django_only, None)
    with psycopg.connect(**params, autocommit=True) as other:
        other.execute("SELECT pg_terminate_backend(%s)", (pid,))


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
