"""Model-based test: random sequences of lock and fence operations on the real
database, compared after every step with a small in-memory model of the contract.

The model is the contract of docs/rules.md written as plain Python: a counter per key and
the token floor under them all (a key's next token is one above both), at most
one live lease per key, a (token, step) watermark per resource, refusals with
the reason the contract gives, idempotent operations run once. Hypothesis drives
acquire, renew, release, revoke, expire (a lease shortened to the minimum TTL,
then waiting for the database clock), raising the token floor, fenced writes to a FencedModel row and a
Fence-guarded ledger, writes with the wrong lock, and idempotent retries.
"""

from __future__ import annotations

import itertools
import uuid
from dataclasses import dataclass, field
from decimal import Decimal
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

from coordination import fencing, locks, restore
from coordination.exceptions import DuplicateWrite, LeaseLost, LockHeld, StaleToken, WrongLock
from coordination.leases import Lease
from coordination.models import Fence, Grant, IdempotencyRecord, Lock, Rejection, TokenFloor
from project.demo.models import Account
from tests.conftest import grant_points
from tests.support.waiting import wait_until_database_time_passes

KEYS = 2
LONG_TTL = 30.0
SHORT_TTL = 0.05


@dataclass(eq=False)
class ModelGrant:
    """A client's grant, as the model knows it."""

    grant: Lease
    index: int
    lost: bool = False

    @property
    def token(self) -> int:
        return self.grant.token


@dataclass
class ModelLock:
    counter: int = 0
    acquired: int = 0
    current: ModelGrant | None = None
    expired: bool = False  # the current lease ran out by time, nobody took over yet

    def live(self, grant: ModelGrant | None = None) -> bool:
        held = self.current is not None and not self.expired
        return held and (grant is None or self.current is grant)


@dataclass
class Watermark:
    token: int = 0
    step: int = 0
    value: int | None = None
    records: dict[tuple[int, int], int] = field(default_factory=dict)


class FencingContract(RuleBasedStateMachine):
    grants = Bundle("grants")

    @initialize()
    def fresh_keys(self) -> None:
        self.run = uuid.uuid4().hex[:8]
        self.accounts = [Account.objects.create(owner=f"model-{self.run}-{i}") for i in range(KEYS)]
        self.keys = [f"account:{account.pk}" for account in self.accounts]
        self.ledgers = [f"ledger-{self.run}-{i}" for i in range(KEYS)]
        for ledger, key in zip(self.ledgers, self.keys, strict=True):
            Fence.objects.create(resource=ledger, lock_key=key)
        self.lock = [ModelLock() for _ in range(KEYS)]
        self.account_mark = [Watermark() for _ in range(KEYS)]
        self.ledger_mark = [Watermark() for _ in range(KEYS)]
        self.refusals = 0
        self.values = itertools.count(1)
        self.idempotent_results: dict[str, int] = {}
        self.idempotent_runs = 0
        self.floor = TokenFloor.objects.value()  # raised by earlier histories of this test

    # --- the grant point ----------------------------------------------------

    @rule(target=grants, index=st.integers(0, KEYS - 1), holder=st.sampled_from(["alice", "bob"]))
    def acquire(self, index: int, holder: str) -> Any:
        lock = self.lock[index]
        if lock.live():
            with pytest.raises(LockHeld):
                locks.acquire(self.keys[index], holder=holder, ttl=LONG_TTL)
            return multiple()
        grant = locks.acquire(self.keys[index], holder=holder, ttl=LONG_TTL)
        assert grant.token > lock.counter, "a token must be above every token issued before"
        assert grant.token == max(lock.counter, self.floor) + 1, "and above the token floor"
        lock.counter, lock.current, lock.expired = grant.token, ModelGrant(grant, index), False
        lock.acquired += 1
        return lock.current

    @rule(grant=grants)
    def renew(self, grant: ModelGrant) -> None:
        if self.lock[grant.index].live(grant):
            locks.renew(grant.grant, ttl=LONG_TTL)
            return
        with pytest.raises(LeaseLost):
            locks.renew(grant.grant, ttl=LONG_TTL)
        assert grant.grant.lost, "a failed renew marks the grant lost"
        grant.lost = True

    @rule(grant=grants)
    def release(self, grant: ModelGrant) -> None:
        lock = self.lock[grant.index]
        if lock.live(grant):
            locks.release(grant.grant)
            lock.current = None
            return
        with pytest.raises(LeaseLost):
            locks.release(grant.grant)
        if lock.current is grant:  # expired, nobody took over: the lock is freed anyway
            lock.current, lock.expired = None, False
        grant.lost = grant.grant.lost

    @rule(index=st.integers(0, KEYS - 1))
    def revoke(self, index: int) -> None:
        lock = self.lock[index]
        revoked = locks.revoke(self.keys[index])
        if lock.current is None:
            assert revoked is None
        else:
            assert revoked is not None and revoked.token == lock.current.token
        lock.current, lock.expired = None, False

    @rule(by=st.integers(1, 8))
    def raise_the_floor(self, by: int) -> None:
        """A restore guard raises the token floor: each key's next token jumps over
        it when its counter is below, leases and watermarks carry on."""
        self.floor = restore.raise_floor_to(self.floor + by)

    @precondition(lambda self: any(lock.live() for lock in self.lock))
    @rule(data=st.data())
    def expire(self, data: st.DataObject) -> None:
        """The holder stalls past its lease: shortened to the minimum, then waited out
        on the database clock."""
        lock = data.draw(st.sampled_from([lock for lock in self.lock if lock.live()]))
        assert lock.current is not None
        locks.renew(lock.current.grant, ttl=SHORT_TTL)
        wait_until_database_time_passes(lock.current.grant.expires_at, margin=0.01)
        lock.expired = True

    # --- the resource side ----------------------------------------------------

    def expect(self, grant: ModelGrant, mark: Watermark, step: int) -> type[Exception] | None:
        if grant.lost:
            return LeaseLost
        if grant.token < mark.token:
            return StaleToken
        if grant.token == mark.token and step <= mark.step:
            return DuplicateWrite
        return None

    @rule(grant=grants, step=st.integers(1, 3))
    def write_account(self, grant: ModelGrant, step: int) -> None:
        mark, value = self.account_mark[grant.index], next(self.values)
        rows = Account.objects.filter(pk=self.accounts[grant.index].pk)
        refusal = self.expect(grant, mark, step)
        if refusal is not None:
            with pytest.raises(refusal):
                rows.fenced_update(grant.grant, step=step, balance=value)
            self.refusals += 1
            return
        assert rows.fenced_update(grant.grant, step=step, balance=value) == 1
        mark.token, mark.step, mark.value = grant.token, step, value

    @rule(grant=grants, step=st.integers(1, 3))
    def write_ledger(self, grant: ModelGrant, step: int) -> None:
        """A Fence-guarded side effect: the record commits with the watermark, or not at all."""
        index = grant.index
        mark, value = self.ledger_mark[index], next(self.values)
        record = f"{self.ledgers[index]}:{grant.token}:{step}"
        refusal = self.expect(grant, mark, step)
        if refusal is not None:
            with pytest.raises(refusal), fencing.fence(self.ledgers[index], grant.grant, step=step):
                fencing.idempotent(record, lambda: value)
            self.refusals += 1
            return
        with fencing.fence(self.ledgers[index], grant.grant, step=step):
            fencing.idempotent(record, lambda: value)
        mark.token, mark.step, mark.value = grant.token, step, value
        mark.records[(grant.token, step)] = value

    @rule(grant=grants, step=st.integers(1, 3))
    def write_with_the_wrong_lock(self, grant: ModelGrant, step: int) -> None:
        other = (grant.index + 1) % KEYS
        rows = Account.objects.filter(pk=self.accounts[other].pk)
        with pytest.raises((WrongLock, LeaseLost)):
            rows.fenced_update(grant.grant, step=step, balance=0)
        ledger = self.ledgers[other]
        with pytest.raises((WrongLock, LeaseLost)), fencing.fence(ledger, grant.grant, step=step):
            pass
        self.refusals += 2

    @rule(slot=st.integers(0, 2))
    def idempotent_retry(self, slot: int) -> None:
        key, value = f"model-{self.run}-{slot}", next(self.values)

        def operation() -> int:
            self.idempotent_runs += 1
            return value

        result = fencing.idempotent(key, operation)
        expected = self.idempotent_results.setdefault(key, value)
        assert result == expected, "a retry returns the first result"
        assert self.idempotent_runs == len(self.idempotent_results), "the operation ran only once per key"

    # --- invariants, after every step -------------------------------------------

    @invariant()
    def locks_match_the_model(self) -> None:
        if not hasattr(self, "lock"):
            return
        rows = {row.key: row for row in Lock.objects.filter(key__in=self.keys)}
        for key, lock in zip(self.keys, self.lock, strict=True):
            row = rows.get(key)
            if row is None:
                assert lock.counter == 0
                continue
            assert row.token == lock.counter, "the token counter is the last token issued"
            if lock.current is None:
                assert row.holder == ""
            else:
                assert (row.holder, row.token) == (lock.current.grant.holder, lock.current.token)

    @invariant()
    def grant_history_is_sound(self) -> None:
        if not hasattr(self, "lock"):
            return
        for key, lock in zip(self.keys, self.lock, strict=True):
            grants = list(Grant.objects.filter(lock__key=key).order_by("token"))
            tokens = [grant.token for grant in grants]
            assert len(tokens) == lock.acquired == len(set(tokens))
            assert max(tokens, default=0) == lock.counter
            for earlier, later in itertools.pairwise(grants):
                assert later.acquired_at > earlier.acquired_at, "tokens increase in grant order"
                assert later.acquired_at >= (earlier.ended_at or earlier.expires_at), "leases overlap"
            live = [grant for grant in grants if grant.ended_at is None]
            assert len(live) <= 1

    @invariant()
    def resources_match_the_model(self) -> None:
        if not hasattr(self, "lock"):
            return
        for account, mark in zip(self.accounts, self.account_mark, strict=True):
            row = Account.objects.get(pk=account.pk)
            assert (row.fence, row.fence_step) == (mark.token, mark.step)
            if mark.value is not None:
                assert row.balance == Decimal(mark.value), "the last accepted write is the state"
        for ledger, mark in zip(self.ledgers, self.ledger_mark, strict=True):
            fence = Fence.objects.get(resource=ledger)
            assert (fence.token, fence.step) == (mark.token, mark.step)
            stored = {
                record.key: record.result
                for record in IdempotencyRecord.objects.filter(key__startswith=f"{ledger}:")
            }
            assert stored == {f"{ledger}:{t}:{s}": v for (t, s), v in mark.records.items()}, (
                "a side effect commits exactly when its fence admits it"
            )

    @invariant()
    def every_refusal_is_recorded(self) -> None:
        if not hasattr(self, "lock"):
            return
        assert Rejection.objects.filter(lock_key__in=self.keys).count() == self.refusals


@pytest.mark.django_db(transaction=True)
@pytest.mark.legs(
    "pg", "sqlite",
    reason="random histories check the grant point's decisions; the LTS leg runs the db tests of each call",
)
def test_the_python_api_follows_the_fencing_contract_model(grant_point: str) -> None:
    # 20 histories in all, shared between the backends this database has.
    examples = max(8, 20 // len(grant_points()))
    run_state_machine_as_test(
        FencingContract,
        settings=settings(
            max_examples=examples,
            stateful_step_count=40,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
            database=None,
        ),
    )
