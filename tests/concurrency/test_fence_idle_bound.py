"""A holder that pauses inside its fence() block cannot keep the resource locked.

fence() holds the Fence row locked until its transaction ends, so a holder
stopped inside the block (SIGSTOP, a GC or VM pause) would make every newer
holder's fenced write wait until it woke up. With an idle bound, PostgreSQL
ends the paused holder's transaction instead: the newer holder writes, and the
paused one learns on waking that nothing of its block was written.

The pause is a thread that stops issuing statements inside the block; the
newer holder waits on the row lock, not on a sleep; leases and bounds are
seconds long, and every wait has a deadline of tens of seconds.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from unittest import mock

import pytest
from django.db import connection, connections
from django.test import override_settings

from coordination import election, fencing, locks
from coordination.backends import base as grant_points
from coordination.exceptions import GrantPointUnavailable, InvalidInput, LeaseLost
from coordination.models import Fence
from tests.support.waiting import wait_until_database_time_passes

pytestmark = pytest.mark.django_db(transaction=True)


def mariadb_idle_setting() -> tuple[int, int]:
    """MariaDB's idle bound: (this session's, the server's default)."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT @@SESSION.idle_transaction_timeout, @@GLOBAL.idle_transaction_timeout")
        session, default = cursor.fetchone()
        return int(session), int(default)


def idle_setting() -> str:
    with connection.cursor() as cursor:
        cursor.execute("SHOW idle_in_transaction_session_timeout")
        return str(cursor.fetchone()[0])


class PausedHolder:
    """Runs ``enter()`` in a thread, then stops issuing statements until resumed."""

    def __init__(self, enter: Callable[[], AbstractContextManager[object]]) -> None:
        self.entered, self.resumed = threading.Event(), threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(enter,))

    def _run(self, enter: Callable[[], AbstractContextManager[object]]) -> None:
        try:
            with enter():
                Fence.objects.create(resource="idle-bound:paused-holder-wrote", lock_key="x")
                self.entered.set()
                self.resumed.wait(60)  # "paused": no statement until resumed
                Fence.objects.filter(resource="idle-bound:paused-holder-wrote").update(step=1)
        except BaseException as error:
            self.error = error
        finally:
            self.entered.set()
            connections.close_all()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        self.thread.start()
        try:
            assert self.entered.wait(30), "the holder never entered its fence"
            assert self.error is None, f"the holder failed before pausing: {self.error!r}"
            yield
        finally:
            self.resumed.set()
            self.thread.join(90)
            assert not self.thread.is_alive(), "the paused holder hung"


@pytest.mark.postgres
def test_a_holder_paused_in_its_fence_past_the_bound_is_cut_off_and_the_next_holder_writes() -> None:
    first = locks.acquire("idle-bound", holder="a", ttl=1)
    holder = PausedHolder(lambda: fencing.fence("idle-bound:doc", first, idle_timeout=2))
    with holder.paused():
        wait_until_database_time_passes(first.expires_at)
        second = locks.acquire("idle-bound", holder="b", ttl=60)
        # Waits on the paused holder's row lock until the server ends its session
        # (about 2 s); without the bound, until the holder resumes (60 s).
        with fencing.fence("idle-bound:doc", second) as row:
            assert row.token == second.token
        assert holder.thread.is_alive(), "the next holder wrote only once the paused one woke up"
    assert isinstance(holder.error, LeaseLost), repr(holder.error)
    assert "idle for more than 2 s" in str(holder.error)
    assert Fence.objects.get(resource="idle-bound:doc").token == second.token
    assert not Fence.objects.filter(resource="idle-bound:paused-holder-wrote").exists()


@pytest.mark.postgres
def test_a_leader_paused_in_its_fence_is_cut_off_after_its_lease_so_the_next_term_writes() -> None:
    old = election.campaign("idle-role", candidate="old", ttl=2, keepalive=False)
    holder = PausedHolder(old.fence)
    with holder.paused():
        wait_until_database_time_passes(old.lease.expires_at)
        with election.lead("idle-role", candidate="new", ttl=60, wait=30) as new:
            assert new.term > old.term
            with new.fence() as row:
                assert row.token == new.term
            assert holder.thread.is_alive(), "the new leader wrote only once the old one woke up"
    assert isinstance(holder.error, LeaseLost), repr(holder.error)
    assert not Fence.objects.filter(resource="idle-bound:paused-holder-wrote").exists()


@pytest.mark.postgres
def test_the_bound_is_the_fence_transactions_alone() -> None:
    grant = locks.acquire("idle-scope", holder="a", ttl=30)
    before = idle_setting()
    with fencing.fence("idle-scope:doc", grant, idle_timeout=7.5):
        assert idle_setting() == "7500ms"
    assert idle_setting() == before
    with fencing.fence("idle-scope:doc", grant):
        assert idle_setting() == before  # no bound by default: the server's own setting
    with override_settings(COORDINATION={"FENCE_IDLE_TIMEOUT": 12}), \
            fencing.fence("idle-scope:doc", grant):
        assert idle_setting() == "12s"
    leadership = election.campaign("idle-scope-role", candidate="a", ttl=9, keepalive=False)
    with leadership.fence():
        assert idle_setting() == "9s"
    leadership.resign()


@pytest.mark.legs("mariadb", reason="MariaDB's bound is a session variable, set and reset")
def test_mariadbs_bound_is_the_grant_transactions_alone() -> None:
    during: list[tuple[int, int]] = []
    original_now = grant_points.GrantPoint.now

    def now(point: grant_points.GrantPoint) -> object:
        during.append(mariadb_idle_setting())
        return original_now(point)

    # A renewal is an ORM transaction on every MariaDB grant point (an acquire,
    # a procedure call there, runs no statement of the client's inside it).
    grant = locks.acquire("idle-mariadb", holder="a", ttl=30)
    with mock.patch.object(grant_points.GrantPoint, "now", now):
        grant = locks.renew(grant, ttl=30)
    session, default = mariadb_idle_setting()
    assert during and during[0][0] == math.ceil(grant_points.IDLE_BOUND) != default
    assert session == default  # the caller's transactions keep the server's setting
    locks.release(grant)
    assert mariadb_idle_setting()[0] == default


def test_a_bad_bound_is_refused_before_anything_is_locked() -> None:
    grant = locks.acquire("idle-bad", holder="a", ttl=30)
    for bad in (0, -1, "5", True):
        with pytest.raises(InvalidInput), fencing.fence("idle-bad:doc", grant, idle_timeout=bad):  # type: ignore[arg-type]
            pytest.fail("the block ran")
    assert not Fence.objects.filter(resource="idle-bad:doc").exists()
    # SQLite has no idle bound: a valid one is accepted and ignored there.
    with fencing.fence("idle-bad:doc", grant, idle_timeout=5) as row:
        assert row.token == grant.token


@pytest.mark.legs("pg", "mariadb", reason="SQLite has no idle bound (one writer at a time)")
def test_a_client_paused_inside_a_renewal_does_not_keep_the_key_ungrantable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The renewal is the ORM transaction of the grant point (row locked, then the
    database clock read, then the updates): paused after the row lock, the client
    would keep every acquire of the key waiting until it woke up."""
    grant = locks.acquire("idle-renew", holder="a", ttl=1)
    paused_thread: list[threading.Thread] = []
    entered, resumed = threading.Event(), threading.Event()
    original_now = grant_points.GrantPoint.now

    def now(point: grant_points.GrantPoint) -> object:
        if threading.current_thread() in paused_thread:
            entered.set()
            resumed.wait(60)  # "paused" with the lock row locked
        return original_now(point)

    monkeypatch.setattr(grant_points.GrantPoint, "now", now)
    errors: list[BaseException] = []

    def renew() -> None:
        try:
            locks.renew(grant, ttl=1)
        except BaseException as error:
            errors.append(error)
        finally:
            connections.close_all()

    thread = threading.Thread(target=renew)
    paused_thread.append(thread)
    thread.start()
    try:
        assert entered.wait(30), "the renewal never reached the grant point"
        wait_until_database_time_passes(grant.expires_at)
        # Waits on the paused renewal's row lock until the server ends its session
        # (the grant point's idle bound); without it, until the renewal resumes.
        second = locks.acquire("idle-renew", holder="b", ttl=30, wait=30)
        assert thread.is_alive(), "the acquire went through only once the renewal woke up"
        assert second.token == grant.token + 1
    finally:
        resumed.set()
        thread.join(60)
    assert errors and isinstance(errors[0], GrantPointUnavailable), errors
