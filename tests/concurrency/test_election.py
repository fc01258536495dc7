"""Fenced leader election: one leader at a time, terms that only grow, and a
deposed leader whose writes with its old term are refused.

The paused leader is a lease left to expire by the database's clock (no
keep-alive), as a ``SIGSTOP``-ed process leaves it; leases are seconds long and
every wait is on state, so a loaded machine does not decide an outcome.
"""

from __future__ import annotations

import datetime as dt
import threading
import time

import pytest

from coordination import election, locks
from coordination.exceptions import LeaseLost, LockHeld, StaleToken
from coordination.models import Fence, Rejection
from tests.support.waiting import run_in_threads, wait_for, wait_until_database_time_passes

pytestmark = pytest.mark.django_db(transaction=True)

#: A kept-alive lease: the shortest one the docs call safe with the keep-alive.
KEEPALIVE_TTL = 5.0


def test_campaign_elects_one_leader_and_a_second_candidate_is_told_who_leads() -> None:
    with election.lead("report", candidate="host-a", ttl=5) as leadership:
        assert leadership.term >= 1
        with pytest.raises(LockHeld) as held:
            election.campaign("report", candidate="host-b", ttl=5)
        assert held.value.holder == "host-a"
        now = election.leader("report")
        assert now is not None
        assert (now.holder, now.term) == ("host-a", leadership.term)
        assert now.since <= now.expires_at
    assert leadership.lost
    assert election.leader("report") is None
    # A resigned leader writes no more: refused before its block runs.
    with pytest.raises(LeaseLost), leadership.fence():
        pytest.fail("a resigned leadership's block ran")


def test_resign_lets_a_waiting_candidate_win_with_a_higher_term() -> None:
    first = election.campaign("sync", candidate="host-a", ttl=5)
    won: list[election.Leadership] = []

    def standby() -> None:
        won.append(election.campaign("sync", candidate="host-b", ttl=5, wait=20))

    thread = threading.Thread(target=standby)
    thread.start()
    time.sleep(0.2)  # let the standby start waiting; the outcome does not depend on it
    first.resign()
    thread.join(30)
    assert won, "the standby never won"
    try:
        assert won[0].term > first.term
        assert [grant.token for grant in election.terms("sync")] == [won[0].term, first.term]
    finally:
        won[0].resign()


def test_a_paused_leaders_write_with_its_old_term_is_refused_after_a_newer_term_wrote() -> None:
    # The old leader's lease runs out as if its process were stopped: no keep-alive.
    old = election.campaign("ledger", candidate="paused", ttl=1.0, keepalive=False)
    with old.fence():
        pass  # it wrote once while it led
    wait_until_database_time_passes(old.lease.expires_at, margin=0.2)
    new = election.campaign("ledger", candidate="standby", ttl=10, wait=10)
    try:
        assert new.term > old.term
        with new.fence():
            pass
        # The paused leader wakes up: it still believes it leads (nothing told it),
        # and its write with the old term is refused by the role's fence.
        assert not old.lost
        with pytest.raises(StaleToken), old.fence():
            pytest.fail("the deposed leader's block ran")
        fence = Fence.objects.get(resource=election.role_key("ledger"))
        assert fence.token == new.term
        assert Rejection.objects.filter(lock_key=election.role_key("ledger"), token=old.term).exists()
    finally:
        new.resign()


def test_a_revoked_leadership_is_lost_and_its_callback_runs() -> None:
    called = threading.Event()
    leadership = election.campaign(
        "janitor", candidate="host-a", ttl=KEEPALIVE_TTL, on_lost=lambda lost, error: called.set()
    )
    locks.revoke(election.role_key("janitor"))
    # The keep-alive renews every ttl / 3 and finds the lease gone.
    assert leadership.wait_lost(timeout=20)
    assert called.wait(5)
    late = threading.Event()
    leadership.add_on_lost(lambda lost, error: late.set())  # added after the loss: called at once
    assert late.is_set()
    with pytest.raises(LeaseLost):
        leadership.check()
    with pytest.raises(LeaseLost), leadership.fence():
        pytest.fail("a lost leadership's block ran")
    leadership.resign()  # never raises


def test_the_keepalive_holds_leadership_past_several_leases() -> None:
    with election.lead("holder", candidate="host-a", ttl=KEEPALIVE_TTL) as leadership:
        # Two leases as first granted, by the database's clock: only renewals keep it.
        first_expiry = leadership.lease.expires_at
        wait_until_database_time_passes(first_expiry + dt.timedelta(seconds=KEEPALIVE_TTL))
        assert not leadership.lost
        assert leadership.lease.expires_at > first_expiry  # renewed, not merely unnoticed
        with pytest.raises(LockHeld):
            election.campaign("holder", candidate="host-b", ttl=KEEPALIVE_TTL)


def test_concurrent_campaigners_never_lead_at_the_same_time_and_terms_increase() -> None:
    # Each candidate campaigns, leads a moment, writes through the fence, and
    # resigns, several times; the fence refuses nothing, because no two terms
    # overlap, and the terms it accepted only grow.
    accepted: list[int] = []
    guard = threading.Lock()
    inside = [0]

    def candidate(index: int) -> None:
        for _ in range(4):
            leadership = election.campaign(
                "contended", candidate=f"host-{index}", ttl=5, wait=30
            )
            try:
                with guard:
                    inside[0] += 1
                    assert inside[0] == 1, "two leaders at once"
                with leadership.fence(), guard:
                    accepted.append(leadership.term)
                with guard:
                    inside[0] -= 1
            finally:
                leadership.resign()

    run_in_threads(3, candidate, timeout=120)
    assert len(accepted) == 12
    assert accepted == sorted(accepted) and len(set(accepted)) == 12
    assert not Rejection.objects.filter(lock_key=election.role_key("contended")).exists()
    wait_for(lambda: election.leader("contended") is None, 5, "no leader left")
