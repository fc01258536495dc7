"""Waiting for a lock: wake-ups on release (PostgreSQL LISTEN/NOTIFY), fair
queueing in arrival order, and lock-delay after a lease expired or was revoked."""

from __future__ import annotations

import datetime as dt
import threading
import time
from typing import Any

import pytest
from django.db import connection, connections

from coordination import locks
from coordination.backends.base import WAKE_UP_CHANNEL
from coordination.exceptions import LeaseLost, LockHeld
from coordination.models import Grant, GrantEnd, Lock, Ticket
from tests.support.waiting import run_in_threads, wait_for, wait_until_database_time_passes

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("grant_point")]


# Only a notification can wake a waiter in time: polling would first look again
# after POLL_INTERVAL, half a minute, and the tests allow a few seconds.
NOTIFIED_WITHIN = 5.0


@pytest.fixture
def polling_too_slow_to_matter(settings: Any) -> None:
    settings.COORDINATION = {**settings.COORDINATION, "POLL_INTERVAL": 60.0, "MAX_POLL_INTERVAL": 60.0}


def acquire_in_thread(key: str, holder: str, **options: Any) -> tuple[threading.Thread, list[Any]]:
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append(locks.acquire(key, holder=holder, **options))
            outcome.append(time.perf_counter())
        except Exception as error:
            outcome.append(error)
        finally:
            connections.close_all()

    thread = threading.Thread(target=run)
    thread.start()
    return thread, outcome


def asleep_until_woken(key: str) -> None:
    """The waiter has failed its first attempt and asked to be woken (on the lock
    row) before going to sleep: a release from now on must notify it."""
    wait_for(lambda: Lock.objects.get(key=key).wake_until is not None, what=f"a waiter asleep on {key!r}")


# --- wake-ups -----------------------------------------------------------------


@pytest.mark.postgres
@pytest.mark.usefixtures("polling_too_slow_to_matter")
def test_release_wakes_a_waiter_at_once_not_after_a_polling_interval() -> None:
    held = locks.acquire("wake", holder="A", ttl=120)
    thread, outcome = acquire_in_thread("wake", "B", ttl=30, wait=30)
    asleep_until_woken("wake")

    released_at = time.perf_counter()
    locks.release(held)
    thread.join(60)

    grant, granted_at = outcome
    assert grant.token == held.token + 1
    assert granted_at - released_at < NOTIFIED_WITHIN, "the release did not wake the waiter"


@pytest.mark.postgres
@pytest.mark.usefixtures("polling_too_slow_to_matter")
def test_revoke_wakes_a_waiter() -> None:
    held = locks.acquire("wake-revoke", holder="A", ttl=120)
    thread, outcome = acquire_in_thread("wake-revoke", "B", ttl=30, wait=30)
    asleep_until_woken("wake-revoke")

    revoked_at = time.perf_counter()
    locks.revoke("wake-revoke")
    thread.join(60)

    grant, granted_at = outcome
    assert grant.token == held.token + 1
    assert granted_at - revoked_at < NOTIFIED_WITHIN, "the revoke did not wake the waiter"


def listen_raw() -> Any:
    """A psycopg connection of the test's own LISTENing on the wake-up channel,
    to read every notification in order (a waiter's listener only wakes for its key)."""
    import psycopg

    params = connection.get_connection_params()
    for django_only in ("cursor_factory", "context", "server_side_binding"):
        params.pop(django_only, None)
    listening = psycopg.connect(**params, autocommit=True)
    listening.execute(f"LISTEN {WAKE_UP_CHANNEL}")
    return listening


@pytest.mark.postgres
@pytest.mark.usefixtures("polling_too_slow_to_matter")
def test_only_releases_someone_waits_for_notify() -> None:
    # NOTIFY takes a server-wide lock until commit: a release nobody waits for
    # must not pay it. A waiter says so on the lock row before it sleeps.
    listening = listen_raw()

    def notified_before_a_marker(key: str) -> bool:
        """Whether ``key`` was notified before a marker sent now. Notifications
        reach a listener in commit order, so reading up to the marker sees every
        notification of the releases that committed before it; no time window."""
        marker = f"marker:{key}:{time.monotonic_ns()}"
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_notify(%s, %s)", [WAKE_UP_CHANNEL, marker])
        seen = []
        deadline = time.monotonic() + 30
        while marker not in seen:
            assert time.monotonic() < deadline, "the marker notification never arrived"
            seen += [n.payload for n in listening.notifies(timeout=1, stop_after=1)]
        return key in seen[: seen.index(marker)]

    try:
        quiet = locks.acquire("quiet", holder="A", ttl=30)
        locks.release(quiet)
        assert not notified_before_a_marker("quiet")

        held = locks.acquire("waited-for", holder="A", ttl=120)
        thread, outcome = acquire_in_thread("waited-for", "B", ttl=30, wait=30)
        asleep_until_woken("waited-for")
        locks.release(held)
        assert notified_before_a_marker("waited-for")
        thread.join(60)
        assert outcome[0].token == held.token + 1
    finally:
        listening.close()


@pytest.mark.usefixtures("polling_too_slow_to_matter")
def test_a_waiter_still_wakes_when_the_lease_expires_without_a_release() -> None:
    # Nothing notifies an expiry: the waiter sleeps until the lease's end, which
    # the refusal told it, not for a polling interval (half a minute here).
    held = locks.acquire("expire", holder="A", ttl=2)

    grant = locks.acquire("expire", holder="B", ttl=30, wait=30)

    assert grant.acquired_at >= held.expires_at
    assert grant.acquired_at - held.expires_at < dt.timedelta(seconds=NOTIFIED_WITHIN)


# --- fair queueing ------------------------------------------------------------


def test_fair_waiters_are_granted_in_arrival_order_and_nobody_starves() -> None:
    key, waiters = "fair", 8
    first = locks.acquire(key, holder="first", ttl=30)
    order: list[int] = []

    def worker(index: int) -> None:
        try:
            grant = locks.acquire(key, holder=f"w{index}", ttl=30, wait=60, fair=True)
            order.append(index)
            time.sleep(0.01)
            locks.release(grant)
        finally:
            connections.close_all()

    threads = []
    for index in range(waiters):
        # Waiter i arrives (takes its ticket) after waiter i - 1.
        threads.append(threading.Thread(target=worker, args=(index,)))
        threads[-1].start()
        wait_for(lambda n=index + 1: Ticket.objects.filter(lock_key=key).count() == n)
    locks.release(first)
    for thread in threads:
        thread.join(60)

    assert order == list(range(waiters)), "waiters were not granted in arrival order"
    assert not Ticket.objects.filter(lock_key=key).exists()
    holders = list(
        Grant.objects.filter(lock__key=key).order_by("token").values_list("holder", flat=True)
    )
    assert holders == ["first"] + [f"w{i}" for i in range(waiters)]


def test_a_fair_waiter_that_gives_up_leaves_the_queue() -> None:
    locks.acquire("fair-quit", holder="A", ttl=30)

    with pytest.raises(LockHeld):
        locks.acquire("fair-quit", holder="B", ttl=30, wait=0.3, fair=True)

    assert not Ticket.objects.filter(lock_key="fair-quit").exists()


def test_a_crashed_waiters_ticket_expires_and_stops_holding_the_queue() -> None:
    now = locks.database_now()
    Ticket.objects.create(lock_key="fair-crash", holder="crashed", expires_at=now + dt.timedelta(seconds=3))

    with pytest.raises(LockHeld, match="queued"):
        locks.acquire("fair-crash", holder="B", ttl=30)  # the live ticket is first
    grant = locks.acquire("fair-crash", holder="B", ttl=30, wait=30, fair=True)

    assert grant.acquired_at >= now + dt.timedelta(seconds=3)
    assert not Ticket.objects.filter(lock_key="fair-crash", holder="B").exists()


def test_many_fair_waiters_contending_all_get_the_lock_in_ticket_order() -> None:
    key, threads, rounds = "fair-many", 6, 3
    granted: list[tuple[int, int]] = []  # (ticket order proxy: token, thread)
    guard = threading.Lock()

    def worker(index: int) -> None:
        for _ in range(rounds):
            grant = locks.acquire(key, holder=f"t{index}", ttl=30, wait=60, fair=True)
            with guard:
                granted.append((grant.token, index))
            locks.release(grant)

    run_in_threads(threads, worker)

    assert sorted(token for token, _ in granted) == list(range(1, threads * rounds + 1))
    per_thread = {i: sum(1 for _, t in granted if t == i) for i in range(threads)}
    assert set(per_thread.values()) == {rounds}, "a waiter starved"
    assert not Ticket.objects.filter(lock_key=key).exists()


# --- lock-delay -----------------------------------------------------------------


def test_lock_delay_keeps_an_expired_lock_ungrantable_for_a_while() -> None:
    held = locks.acquire("delay", holder="A", ttl=0.2, lock_delay=3)
    wait_until_database_time_passes(held.expires_at)

    with pytest.raises(LockHeld, match="lock-delay") as caught:
        locks.acquire("delay", holder="B", ttl=30)
    assert caught.value.expires_at == held.expires_at + dt.timedelta(seconds=3)

    wait_until_database_time_passes(held.expires_at + dt.timedelta(seconds=3))
    grant = locks.acquire("delay", holder="B", ttl=30)
    assert grant.token == held.token + 1
    assert Grant.objects.of(held).get().end_reason == GrantEnd.EXPIRED


def test_lock_delay_applies_after_a_revoke_and_a_late_release_but_not_a_clean_release() -> None:
    clean = locks.acquire("d2", holder="A", ttl=30, lock_delay=5)
    locks.release(clean)
    revoked = locks.acquire("d2", holder="B", ttl=30, lock_delay=3)  # clean release: at once

    locks.revoke("d2")
    with pytest.raises(LockHeld, match="lock-delay"):
        locks.acquire("d2", holder="C", ttl=30)
    late = locks.acquire("d2", holder="C", ttl=0.1, wait=30, lock_delay=3)
    assert late.acquired_at >= revoked.acquired_at + dt.timedelta(seconds=3)

    wait_until_database_time_passes(late.expires_at)
    with pytest.raises(LeaseLost, match="expired"):
        locks.release(late)  # frees the lock, yet the delay runs from its expiry
    with pytest.raises(LockHeld, match="lock-delay"):
        locks.acquire("d2", holder="D", ttl=30)


def test_global_lock_delay_setting_is_the_default(settings: Any) -> None:
    settings.COORDINATION = {**settings.COORDINATION, "LOCK_DELAY": 30.0}
    locks.acquire("d3", holder="A", ttl=30)
    locks.revoke("d3")

    with pytest.raises(LockHeld, match="lock-delay"):
        locks.acquire("d3", holder="B", ttl=30)
    with pytest.raises(LockHeld):
        locks.acquire("d3", holder="B", ttl=30, lock_delay=0)  # the running delay stands
