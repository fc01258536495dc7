"""Tokens across a PostgreSQL failover, on a real Patroni + etcd cluster.

The primary is killed (SIGKILL of Patroni, PostgreSQL and its backends: the
machine dies) under a workload of acquires, fenced writes and releases; Patroni
promotes a replica once the leader key expires, and the clients follow it
through the multi-host address. Rule 8 of docs/rules.md, docs/high-availability.md.
"""

from __future__ import annotations

import copy
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

import pytest
from django.db import DatabaseError, connections

from coordination import locks
from coordination.backends.postgresql import FAILOVER_MARGIN
from coordination.checks import check_promotion_guard
from coordination.exceptions import GrantPointUnavailable, LeaseLost, LockHeld, StaleToken
from coordination.fencing import fence
from coordination.leases import Lease
from coordination.models import Grant, TokenFloor
from tests.support.cluster import CLUSTER_ALIAS, Cluster

pytestmark = [pytest.mark.postgres, pytest.mark.timeout(300)]

DB = CLUSTER_ALIAS


@dataclass
class Workload:
    """Threads that acquire their own key, write through its fence, release; forever."""

    threads: int = 4
    stop: threading.Event = field(default_factory=threading.Event)
    # (key, token, monotonic time) of every acquire that returned a lease, in order.
    granted: list[tuple[str, int, float]] = field(default_factory=list)
    errors: Counter[str] = field(default_factory=Counter)
    # Anything an acquire raised that is not a documented refusal.
    unexpected: list[BaseException] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _running: list[threading.Thread] = field(default_factory=list)

    def start(self) -> None:
        for index in range(self.threads):
            thread = threading.Thread(target=self._run, args=(f"failover:{index}",), daemon=True)
            thread.start()
            self._running.append(thread)

    def finish(self) -> None:
        self.stop.set()
        for thread in self._running:
            thread.join(timeout=60)
        assert not any(thread.is_alive() for thread in self._running), "a workload thread hung"

    def tokens(self, key: str, before: float | None = None, after: float | None = None) -> list[int]:
        return [
            token for k, token, at in self.granted
            if k == key and (before is None or at < before) and (after is None or at >= after)
        ]

    def _run(self, key: str) -> None:
        try:
            while not self.stop.is_set():
                self._one(key)
        finally:
            connections[DB].close()

    def _one(self, key: str) -> None:
        try:
            lease = locks.acquire(key, holder=key, ttl=30, using=DB)
        except (GrantPointUnavailable, LockHeld) as error:
            self.errors[type(error).__name__] += 1
            time.sleep(0.1)
            return
        except BaseException as error:
            self.unexpected.append(error)
            self.stop.set()
            return
        with self._lock:
            self.granted.append((key, lease.token, time.monotonic()))
        try:
            with fence(f"resource:{key}", lease, using=DB):
                pass
            locks.release(lease, using=DB)
        except (GrantPointUnavailable, LeaseLost, StaleToken) as error:
            self.errors[type(error).__name__] += 1
        except DatabaseError as error:  # the fenced write's connection, cut
            self.errors[type(error).__name__] += 1
            connections[DB].close()


def _replicas_caught_up() -> bool:
    """Every replica has replayed everything the primary wrote so far."""
    with connections[DB].cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FILTER (WHERE replay_lsn >= pg_current_wal_lsn()), count(*) "
            "FROM pg_stat_replication"
        )
        caught_up, replicas = cursor.fetchone()
    return bool(replicas) and caught_up == replicas


def _retry(call, attempts: int = 5):  # type: ignore[no-untyped-def]
    """A call on the cluster alias after a failover: the first may find its connection cut."""
    for _attempt in range(attempts):
        try:
            return call()
        except GrantPointUnavailable:
            time.sleep(0.5)
        except DatabaseError:
            connections[DB].close()
            time.sleep(0.5)
    return call()


def _fail_over(cluster: Cluster, workload: Workload) -> tuple[float, float, int]:
    """Kill the leader under the workload. Returns when the grants go on: the
    time from which every acknowledged grant is the new primary's, the seconds
    from the kill to the first grant on the new primary, and the new leader."""
    old = cluster.wait_healthy(replicas=1)
    killed_at = time.monotonic()
    cluster.kill_node(old.node)
    new = cluster.wait(
        lambda: (leader := cluster.leader()) and leader.node != old.node and leader,
        "a new leader after the kill", timeout=120,
    )
    # The old primary's late answers (sent before the kill, read after it)
    # arrive within moments of the kill; the new leader is reported only once
    # the dead one's key expired (ttl, 20 s). From here every grant is the new
    # primary's.
    promoted_at = time.monotonic()
    cluster.wait(
        lambda: any(at > promoted_at for _k, _t, at in workload.granted),
        "a grant on the new primary", timeout=60,
    )
    # For the figure only: the first grant well clear of the kill (the new
    # primary cannot answer before the ttl has passed).
    first = min(at for _k, _t, at in workload.granted if at > killed_at + 5)
    # Every key granted on the new primary: each thread has its own connection
    # to re-open and may sit in a back-off, so wait on that, not on a second.
    cluster.wait(
        lambda: all(
            workload.tokens(f"failover:{index}", after=promoted_at) for index in range(workload.threads)
        ),
        "a grant of every key on the new primary", timeout=60,
    )
    return promoted_at, first - killed_at, new.node


def _assert_tokens_increase(workload: Workload) -> None:
    for index in range(workload.threads):
        tokens = workload.tokens(f"failover:{index}")
        assert tokens == sorted(set(tokens)), f"tokens of failover:{index} repeat or go back: {tokens}"


def test_check_warns_of_async_replicas_without_a_promotion_guard(
    cluster_db: Cluster, settings: Any
) -> None:
    cluster_db.wait_healthy()
    assert check_promotion_guard(databases=[DB]) == []
    settings.COORDINATION = {**settings.COORDINATION, "GRANT_POINT": "orm"}
    [warning] = check_promotion_guard(databases=[DB])
    assert warning.id == "coordination.W006" and "ORM grant point" in warning.msg


def test_async_failover_never_reissues_a_token_and_revokes_every_lease(cluster_db: Cluster) -> None:
    cluster = cluster_db
    cluster.wait_healthy()
    # A holder whose lease and first fenced write reached the replicas.
    held = locks.acquire("failover:held", holder="survivor", ttl=300, using=DB)
    with fence("resource:held", held, step=1, using=DB):
        pass
    workload = Workload()
    workload.start()
    cluster.wait(lambda: len(workload.granted) > 20, "grants before the kill")
    cluster.wait(_replicas_caught_up, "replicas caught up with the held lease", timeout=30)

    promoted_at, unavailable, new_node = _fail_over(cluster, workload)
    workload.finish()

    assert not workload.unexpected, f"an acquire raised an undocumented error: {workload.unexpected!r}"
    assert workload.errors["GrantPointUnavailable"] >= 1, workload.errors
    _assert_tokens_increase(workload)

    floor = _retry(lambda: TokenFloor.objects.using(DB).get())
    # Patroni reports a promoted node's new timeline on a later turn of its loop
    # than PostgreSQL starts it: wait until it reports one at least the guard's.
    leader = cluster.wait(
        lambda: (found := cluster.leader()) and found.timeline >= floor.timeline and found,
        "Patroni reporting the new timeline", timeout=60,
    )
    assert leader.node == new_node
    assert floor.timeline == leader.timeline, "the guard did not record the new timeline"
    skipped = []
    for index in range(workload.threads):
        key = f"failover:{index}"
        before, after = workload.tokens(key, before=promoted_at), workload.tokens(key, after=promoted_at)
        assert before and after, f"{key}: no grants on one side of the failover"
        # Every token of the new primary is above the raised floor (a margin above
        # every counter the replica had) and above every token the old primary
        # acknowledged, whether the replica received it or not.
        assert after[0] > max(before)
        assert after[0] > floor.token >= FAILOVER_MARGIN
        tokens = before + after
        skipped.append(max(b - a - 1 for a, b in pairwise(tokens)))

    # The held lease was revoked by the guard; its token is fenced out, even for
    # a holder that never tried to renew (a copy that was not marked lost).
    unaware = copy.copy(held)
    with pytest.raises(LeaseLost):
        _retry(lambda: locks.renew(held, using=DB))
    with pytest.raises(StaleToken):
        _retry(lambda: _write(unaware, step=2))
    grant = Grant.objects.using(DB).get(lock__key="failover:held", token=held.token)
    assert grant.end_reason == "revoked"
    print(
        f"\nasync failover: first grant on the new primary {unavailable:.1f} s after the kill; "
        f"tokens skipped per key {skipped}; client errors {dict(workload.errors)}"
    )


def _write(lease: Lease, *, step: int) -> None:
    with fence("resource:held", lease, step=step, using=DB):
        pass


def test_sync_failover_loses_no_acknowledged_grant(cluster_db: Cluster) -> None:
    cluster = cluster_db
    # Bring back any node a previous test killed, then require a synchronous standby.
    for member_node in (1, 2, 3):
        if member_node not in {m.node for m in cluster.members() if m.state in ("running", "streaming")}:
            cluster.start_node(member_node)
    cluster.wait_healthy(replicas=2)
    cluster.set_mode("sync")
    try:
        cluster.wait_healthy(replicas=2, sync=True)
        workload = Workload()
        workload.start()
        cluster.wait(lambda: len(workload.granted) > 20, "grants before the kill")
        promoted_at, unavailable, _new_node = _fail_over(cluster, workload)
        workload.finish()

        assert not workload.unexpected, f"an acquire raised an undocumented error: {workload.unexpected!r}"
        _assert_tokens_increase(workload)
        # Nothing acknowledged is lost: every lease an acquire returned, before
        # the kill too, is recorded on the new primary.
        recorded: dict[str, set[int]] = defaultdict(set)
        rows = _retry(lambda: list(
            Grant.objects.using(DB).filter(lock__key__startswith="failover:")
            .values_list("lock__key", "token")
        ))
        for key, token in rows:
            recorded[key].add(token)
        lost = [(key, token) for key, token, _at in workload.granted if token not in recorded[key]]
        assert not lost, f"acknowledged grants lost in a synchronous failover: {lost[:10]}"
        print(
            f"\nsync failover: first grant on the new primary {unavailable:.1f} s after the kill; "
            f"{len(workload.tokens('failover:0', before=promoted_at))} grants of failover:0 before, "
            f"all kept; client errors {dict(workload.errors)}"
        )
    finally:
        cluster.set_mode("async")
