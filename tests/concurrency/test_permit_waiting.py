"""Waiting for a permit, a shared grant or a set: woken by releases (PostgreSQL
LISTEN/NOTIFY), permits served in arrival order, and a waiter that gives up or
dies never holding the queue (docs/primitives.md)."""

from __future__ import annotations

import datetime as dt
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from django.db import connections

from coordination import locks
from coordination.exceptions import LockHeld
from coordination.leases import Lease
from coordination.models import Grant, Lock, Ticket
from coordination.semaphores import acquire_permit, permit_keys, permit_queue
from coordination.shared import acquire_shared
from tests.support.celery_workers import REPO, worker_environment
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("grant_point")]

# Only a notification can wake a waiter this soon: with the settings below a
# waiter would first look again after 15 s at the earliest (back-off from half
# a minute, with jitter), and a queued one renews its ticket every 20 s.
NOTIFIED_WITHIN = 10.0


@pytest.fixture
def polling_too_slow_to_matter(settings: Any) -> None:
    settings.COORDINATION = {
        **settings.COORDINATION, "POLL_INTERVAL": 30.0, "MAX_POLL_INTERVAL": 30.0,
        "TICKET_TTL": 60.0,
    }


def in_thread(call: Callable[[], Lease | dict[str, Lease]]) -> tuple[threading.Thread, list[Any]]:
    """Run ``call`` in a thread with its own connection; ``outcome`` receives
    the grant (or the error) and then the ``perf_counter()`` at which it returned."""
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append(call())
        except Exception as error:
            outcome.append(error)
        finally:
            outcome.append(time.perf_counter())
            connections.close_all()

    thread = threading.Thread(target=run)
    thread.start()
    return thread, outcome


def queued(name: str) -> int:
    return Ticket.objects.filter(lock_key=permit_queue(name)).count()


def asleep_until_woken(*keys: str) -> None:
    """Every lock row of ``keys`` says someone waits: a release must notify."""
    wait_for(
        lambda: Lock.objects.filter(key__in=keys, wake_until__isnull=False).count() == len(keys),
        what=f"a waiter asleep on {keys}",
    )


# --- wake-ups -------------------------------------------------------------------


@pytest.mark.postgres
@pytest.mark.usefixtures("polling_too_slow_to_matter")
def test_a_released_slot_wakes_a_permit_waiter() -> None:
    held = [acquire_permit("wake-sem", limit=2, holder=f"h{i}", ttl=120) for i in range(2)]
    thread, outcome = in_thread(
        lambda: acquire_permit("wake-sem", limit=2, holder="waiter", ttl=30, wait=60)
    )
    wait_for(lambda: queued("wake-sem") == 1, what="the waiter queued")
    asleep_until_woken(*permit_keys("wake-sem", 2))

    released_at = time.perf_counter()
    locks.release(held[1])
    thread.join(90)

    permit, granted_at = outcome
    assert isinstance(permit, Lease), permit
    assert permit.key == held[1].key and permit.token == held[1].token + 1
    assert granted_at - released_at < NOTIFIED_WITHIN, "the release did not wake the waiter"
    assert queued("wake-sem") == 0


@pytest.mark.postgres
@pytest.mark.usefixtures("polling_too_slow_to_matter")
def test_a_writers_release_wakes_a_waiting_reader() -> None:
    writer = locks.acquire("wake-read", holder="writer", ttl=120)
    thread, outcome = in_thread(
        lambda: acquire_shared("wake-read", holder="reader", ttl=30, wait=60)
    )
    asleep_until_woken("wake-read")

    released_at = time.perf_counter()
    locks.release(writer)
    thread.join(90)

    reader, granted_at = outcome
    assert isinstance(reader, Lease), reader
    assert reader.mode == "shared" and reader.token == writer.token + 1
    assert granted_at - released_at < NOTIFIED_WITHIN, "the release did not wake the reader"


@pytest.mark.postgres
@pytest.mark.usefixtures("polling_too_slow_to_matter")
def test_a_release_of_any_key_of_a_set_wakes_its_waiter() -> None:
    free = locks.acquire("wake-set:a", holder="other", ttl=120)
    locks.release(free)  # a row for each key, so both can carry the request
    held = locks.acquire("wake-set:b", holder="other", ttl=120)
    thread, outcome = in_thread(
        lambda: locks.acquire_many(["wake-set:a", "wake-set:b"], holder="mover", ttl=30, wait=60)
    )
    asleep_until_woken("wake-set:a", "wake-set:b")

    released_at = time.perf_counter()
    locks.release(held)
    thread.join(90)

    grants, granted_at = outcome
    assert isinstance(grants, dict), grants
    assert grants["wake-set:b"].token == held.token + 1
    assert granted_at - released_at < NOTIFIED_WITHIN, "the release did not wake the set"


# --- the permit queue ---------------------------------------------------------------


def test_permit_waiters_are_served_in_arrival_order() -> None:
    name, waiters = "fifo-sem", 5
    held = [acquire_permit(name, limit=2, holder=f"first{i}", ttl=60) for i in range(2)]
    threads = []
    for index in range(waiters):
        threads.append(
            in_thread(
                lambda i=index: locks.release(
                    acquire_permit(name, limit=2, holder=f"w{i}", ttl=30, wait=90)
                )
            )
        )
        # Waiter i arrives (takes its ticket) after waiter i - 1.
        wait_for(lambda n=index + 1: queued(name) == n, what=f"waiter {index} queued")
    for permit in held:
        locks.release(permit)
    for thread, outcome in threads:
        thread.join(120)
        assert isinstance(outcome[0], Lease), outcome[0]

    # A waiter's grant commits after the grant of every waiter ahead of it (it
    # is refused while their tickets are live), so database grant times give
    # the order the queue served them in.
    holders = list(
        Grant.objects.filter(lock__key__in=permit_keys(name, 2))
        .order_by("acquired_at", "id").values_list("holder", flat=True)
    )
    assert holders == ["first0", "first1"] + [f"w{i}" for i in range(waiters)]
    assert queued(name) == 0


def test_a_newcomer_does_not_take_a_free_slot_a_waiter_is_queued_for() -> None:
    # A waiter whose ticket is live is ahead of everyone who comes later, even
    # with a slot free: here a ticket of a waiter that died, still live for 3 s.
    name = "nobarge-sem"
    now = locks.database_now()
    dead_until = now + dt.timedelta(seconds=3)
    Ticket.objects.create(lock_key=permit_queue(name), holder="dead", expires_at=dead_until)

    with pytest.raises(LockHeld, match="queued first"):
        acquire_permit(name, limit=2, holder="newcomer", ttl=30)

    # Once its ticket has expired (database clock) it holds nobody up.
    permit = acquire_permit(name, limit=2, holder="newcomer", ttl=30, wait=30)
    assert permit.acquired_at >= dead_until
    assert not Ticket.objects.filter(lock_key=permit_queue(name), holder="newcomer").exists()


def test_a_permit_waiter_that_gives_up_leaves_the_queue_and_the_next_is_served() -> None:
    name = "quit-sem"
    held = acquire_permit(name, limit=1, holder="holder", ttl=60)
    # The patient waiter must queue behind the quitter before it gives up: a
    # thread start and one attempt, given seconds to spare on a loaded machine.
    quitter, quit_outcome = in_thread(
        lambda: acquire_permit(name, limit=1, holder="quitter", ttl=30, wait=6)
    )
    wait_for(lambda: queued(name) == 1, what="the quitter queued")
    patient, patient_outcome = in_thread(
        lambda: acquire_permit(name, limit=1, holder="patient", ttl=30, wait=90)
    )
    wait_for(lambda: queued(name) == 2, what="the patient waiter queued")

    quitter.join(60)
    assert isinstance(quit_outcome[0], LockHeld)
    assert list(Ticket.objects.filter(lock_key=permit_queue(name)).values_list("holder", flat=True)) == [
        "patient"
    ]
    locks.release(held)
    patient.join(120)

    permit = patient_outcome[0]
    assert isinstance(permit, Lease), permit
    assert permit.holder == "patient" and permit.token == held.token + 1
    assert queued(name) == 0


def test_fair_readers_and_writers_are_served_in_arrival_order() -> None:
    key = "fair-rw"
    first = locks.acquire(key, holder="first", ttl=60)
    arrivals = ["r1", "w2", "r3", "r4"]  # readers and a writer, queued in this order
    threads = []
    for index, holder in enumerate(arrivals):

        def take(holder: str = holder) -> Lease:
            if holder.startswith("r"):
                grant = acquire_shared(key, holder=holder, ttl=30, wait=90, fair=True)
            else:
                grant = locks.acquire(key, holder=holder, ttl=30, wait=90, fair=True)
            locks.release(grant)
            return grant

        threads.append(in_thread(take))
        wait_for(lambda n=index + 1: Ticket.objects.filter(lock_key=key).count() == n,
                 what=f"{holder} queued")
    locks.release(first)
    for thread, outcome in threads:
        thread.join(120)
        assert isinstance(outcome[0], Lease), outcome[0]

    # Tokens are issued in grant order: r3 and r4 never overtook the writer
    # queued before them, and the writer never overtook r1.
    granted = list(
        Grant.objects.filter(lock__key=key).order_by("token")
        .values_list("holder", "mode", "acquired_at", "ended_at")
    )
    assert [(holder, mode) for holder, mode, _, _ in granted] == [
        ("first", "exclusive"), ("r1", "shared"), ("w2", "exclusive"),
        ("r3", "shared"), ("r4", "shared"),
    ]
    r1, w2, r3 = granted[1], granted[2], granted[3]
    assert r1[3] <= w2[2] and w2[3] <= r3[2]  # the writer alone, between the readers
    assert not Ticket.objects.filter(lock_key=key).exists()


@pytest.mark.postgres
@pytest.mark.legs("pg", reason="a child process; the LTS leg runs the same code")
def test_a_killed_waiter_does_not_block_the_queue() -> None:
    name, ticket_ttl = "dead-sem", 2.0
    held = acquire_permit(name, limit=1, holder="holder", ttl=60)
    doomed = subprocess.Popen(
        [sys.executable, "-m", "tests.support.permit_waiter", name, str(ticket_ttl)],
        cwd=REPO, env=worker_environment(None), stdout=subprocess.PIPE, text=True,
    )
    try:
        wait_for(lambda: queued(name) == 1, what="the child process queued")
        patient, outcome = in_thread(
            lambda: acquire_permit(name, limit=1, holder="patient", ttl=30, wait=90)
        )
        wait_for(lambda: queued(name) == 2, what="the patient waiter queued behind it")
        doomed.send_signal(signal.SIGKILL)  # its session ends; its ticket stays
        assert doomed.wait(30) == -signal.SIGKILL
    finally:
        if doomed.poll() is None:
            doomed.kill()
            doomed.wait(30)
    locks.release(held)
    patient.join(120)

    permit = outcome[0]
    assert isinstance(permit, Lease), permit
    assert permit.holder == "patient" and permit.token == held.token + 1
    assert not Ticket.objects.filter(lock_key=permit_queue(name), holder="patient").exists()
