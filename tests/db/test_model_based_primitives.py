"""Model-based test of the primitives: random sequences of shared and exclusive
grants of one key, permits of a semaphore, all-or-none sets and fenced writes,
on the real database, compared after every step with a small model.

The model is docs/primitives.md as plain Python: readers share a key while no
writer holds it, a writer holds it alone, and both draw tokens from the key's
one counter; a semaphore of limit 2 has two slots, each a lock; a set is
granted all or none. The invariants read the database's grant history: no
exclusive grant overlapping any other grant of its key in database time
(no writer overlapping readers), at most ``LIMIT`` live permits and never a
slot above it, tokens increasing in grant order (so a writer's token is above
every reader's granted before it), and counters that only a whole set moves.
"""

from __future__ import annotations

import itertools
import uuid
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    initialize,
    invariant,
    multiple,
    precondition,
    rule,
    run_state_machine_as_test,
)

from coordination import fencing, locks
from coordination.exceptions import LeaseLost, LockHeld, StaleToken
from coordination.leases import Lease
from coordination.models import Fence, Grant, GrantMode, Lock, TokenFloor
from coordination.semaphores import acquire_permit
from coordination.shared import acquire_shared
from tests.conftest import grant_points
from tests.support.waiting import wait_until_database_time_passes

LIMIT = 2
LONG_TTL = 30.0
SHORT_TTL = 0.05


@dataclass(eq=False)
class Held:
    """A grant a client holds, as the model knows it."""

    grant: Lease
    expired: bool = False
    ended: bool = False  # released or revoked

    @property
    def live(self) -> bool:
        return not (self.expired or self.ended)


class Primitives(RuleBasedStateMachine):
    grants = Bundle("grants")

    @initialize()
    def fresh_names(self) -> None:
        run = uuid.uuid4().hex[:8]
        self.doc = f"doc-{run}"
        self.pool = f"pool-{run}"
        self.slots = [f"{self.pool}@{slot}" for slot in range(1, LIMIT + 1)]
        self.set_keys = [f"set-{run}:{name}" for name in "abc"]
        self.resource = f"doc-resource-{run}"
        Fence.objects.create(resource=self.resource, lock_key=self.doc)
        self.floor = TokenFloor.objects.value()
        self.counter: dict[str, int] = dict.fromkeys([self.doc, *self.slots, *self.set_keys], 0)
        self.holders: dict[str, list[Held]] = {key: [] for key in self.counter}
        self.watermark = 0

    def live(self, key: str) -> list[Held]:
        return [held for held in self.holders[key] if held.live]

    def granted(self, grant: Lease) -> Held:
        key = grant.key
        assert grant.token == max(self.counter[key], self.floor) + 1, "the key's next token"
        self.counter[key] = grant.token
        held = Held(grant)
        self.holders[key].append(held)
        return held

    # --- shared and exclusive grants of one key ------------------------------------

    @rule(target=grants, shared=st.booleans(), holder=st.sampled_from(["alice", "bob"]))
    def acquire_doc(self, shared: bool, holder: str) -> Any:
        live = self.live(self.doc)
        writer_live = any(held.grant.mode == "exclusive" for held in live)
        grantable = not writer_live if shared else not live
        take = acquire_shared if shared else locks.acquire
        if not grantable:
            with pytest.raises(LockHeld):
                take(self.doc, holder=holder, ttl=LONG_TTL)
            return multiple()
        grant = take(self.doc, holder=holder, ttl=LONG_TTL)
        assert grant.mode == ("shared" if shared else "exclusive")
        return self.granted(grant)

    # --- permits and sets ----------------------------------------------------------

    @rule(target=grants, holder=st.sampled_from(["alice", "bob"]))
    def acquire_permit(self, holder: str) -> Any:
        free = [slot for slot in self.slots if not self.live(slot)]
        if not free:
            with pytest.raises(LockHeld):
                acquire_permit(self.pool, limit=LIMIT, holder=holder, ttl=LONG_TTL)
            return multiple()
        permit = acquire_permit(self.pool, limit=LIMIT, holder=holder, ttl=LONG_TTL)
        assert permit.key in free, "a permit is one of the free slots"
        return self.granted(permit)

    @rule(target=grants, pair=st.sampled_from([(0, 1), (1, 2), (0, 2)]))
    def acquire_set(self, pair: tuple[int, int]) -> Any:
        keys = [self.set_keys[i] for i in pair]
        if any(self.live(key) for key in keys):
            with pytest.raises(LockHeld):
                locks.acquire_many(keys, holder="mover", ttl=LONG_TTL)
            return multiple()  # none granted: the counters invariant checks it
        grants = locks.acquire_many(keys, holder="mover", ttl=LONG_TTL)
        assert sorted(grants) == sorted(keys)
        return multiple(*[self.granted(grants[key]) for key in sorted(keys)])

    # --- any grant ---------------------------------------------------------------

    @rule(held=grants)
    def renew(self, held: Held) -> None:
        if held.live:
            locks.renew(held.grant, ttl=LONG_TTL)
            return
        with pytest.raises(LeaseLost):
            locks.renew(held.grant, ttl=LONG_TTL)

    @rule(held=grants)
    def release(self, held: Held) -> None:
        if held.live:
            locks.release(held.grant)
        else:
            with pytest.raises(LeaseLost):
                locks.release(held.grant)
        held.ended = True

    @precondition(lambda self: any(self.live(key) for key in getattr(self, "holders", {})))
    @rule(data=st.data())
    def expire(self, data: st.DataObject) -> None:
        """A holder stalls past its lease: shortened to the minimum, waited out."""
        live = [held for key in self.holders for held in self.live(key)]
        held = data.draw(st.sampled_from(live))
        locks.renew(held.grant, ttl=SHORT_TTL)
        wait_until_database_time_passes(held.grant.expires_at, margin=0.01)
        held.expired = True

    @rule()
    def revoke_doc(self) -> None:
        locks.revoke(self.doc)
        for held in self.holders[self.doc]:
            held.ended = True

    @rule(held=grants)
    def write_doc(self, held: Held) -> None:
        """A fenced write under any grant of the key: a reader's read-derived write
        too. Refused when a newer token (a writer's, or a newer reader's) wrote."""
        if held.grant.key != self.doc:
            return
        if held.grant.lost:
            expected: type[Exception] | None = LeaseLost
        elif held.grant.token < self.watermark:
            expected = StaleToken
        else:
            expected = None
        if expected is not None:
            with pytest.raises(expected), fencing.fence(self.resource, held.grant):
                pass
            return
        with fencing.fence(self.resource, held.grant):
            pass
        self.watermark = held.grant.token

    # --- invariants -----------------------------------------------------------------

    def history(self, keys: list[str]) -> list[Grant]:
        return list(Grant.objects.filter(lock__key__in=keys).select_related("lock").order_by("token"))

    @invariant()
    def no_writer_overlaps_another_grant_of_its_key(self) -> None:
        if not hasattr(self, "doc"):
            return
        grants = self.history([self.doc])
        for earlier, later in itertools.pairwise(grants):
            assert later.acquired_at > earlier.acquired_at, "tokens increase in grant order"
        for first, second in itertools.combinations(grants, 2):
            if GrantMode.EXCLUSIVE in {first.mode, second.mode}:
                first_end = first.ended_at or first.expires_at
                second_end = second.ended_at or second.expires_at
                assert first_end <= second.acquired_at or second_end <= first.acquired_at, (
                    f"{first.mode} grant {first.token} overlaps {second.mode} grant {second.token}"
                )
        live = Grant.objects.filter(lock__key=self.doc).live()
        assert live.count() == len(self.live(self.doc))
        assert {g.mode for g in live} <= {GrantMode.SHARED} or live.count() == 1

    @invariant()
    def at_most_limit_permits_and_no_slot_above_it(self) -> None:
        if not hasattr(self, "doc"):
            return
        assert not Lock.objects.filter(key__startswith=f"{self.pool}@").exclude(key__in=self.slots).exists()
        assert Grant.objects.filter(lock__key__in=self.slots).live().count() <= LIMIT
        by_slot = itertools.groupby(self.history(self.slots), key=lambda grant: grant.lock.key)
        for _slot, grants in by_slot:
            for earlier, later in itertools.pairwise(sorted(grants, key=lambda g: g.token)):
                assert later.acquired_at >= (earlier.ended_at or earlier.expires_at), "a slot overlaps"

    @invariant()
    def counters_match_the_model(self) -> None:
        """A refused set moved no counter; a granted one moved every key's."""
        if not hasattr(self, "doc"):
            return
        rows = dict(Lock.objects.filter(key__in=list(self.counter)).values_list("key", "token"))
        for key, counter in self.counter.items():
            assert rows.get(key, 0) == counter, f"the counter of {key}"
            assert Grant.objects.filter(lock__key=key).count() == len(self.holders[key])


@pytest.mark.django_db(transaction=True)
@pytest.mark.legs(
    "pg", "sqlite",
    reason="random histories check the grant point's decisions; the LTS leg runs the db tests of each call",
)
def test_the_primitives_follow_their_model(grant_point: str) -> None:
    examples = max(6, 12 // len(grant_points()))
    run_state_machine_as_test(
        Primitives,
        settings=settings(
            max_examples=examples,
            stateful_step_count=40,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
            database=None,
        ),
    )
