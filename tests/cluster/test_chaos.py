"""Failover chaos on the Patroni cluster (coordination_chaos --patroni).

The chaos workload (worker processes acquiring, writing through the fences,
renewing, releasing) runs against the cluster while its primary is switched
over and killed; the checker judges the whole history across primaries. The
negative control (asynchronous replication, the promotion guard disabled, WAL
shipping stopped before the kill) must show grants reissued or acknowledged
writes lost. docs/high-availability.md; project/lab/chaos/patroni.py.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from typing import Any

import pytest
from django.db import connections

from coordination.backends.postgresql import FAILOVER_MARGIN
from project.lab.chaos.run import ChaosConfig, ChaosRun
from tests.support.cluster import CLUSTER_ALIAS, Cluster

pytestmark = [pytest.mark.postgres, pytest.mark.timeout(300)]


@pytest.fixture(autouse=True)
def _fresh_cluster_connection() -> Iterator[None]:
    """The session's connection to the cluster went to a primary these runs
    replace: the tests after them must connect again."""
    yield
    if CLUSTER_ALIAS in connections.settings:
        connections[CLUSTER_ALIAS].close()


def test_failover_chaos_keeps_the_fencing_contract_across_primaries(
    cluster: Cluster, django_db_blocker: Any
) -> None:
    # The seed's first round is a switchover, then a kill of the primary: two
    # promotions, one planned, one after the leader key expired. The run goes on
    # until both were injected, however long the cluster takes to recover.
    config = ChaosConfig(seconds=20, workers=4, keys=2, ttl=1.0, seed=14, fault_interval=1.0,
                         faults=("pause", "kill", "terminate_backend"), patroni=True,
                         cluster_faults=("switchover", "kill_node"), cluster_interval=1.0,
                         min_cluster_faults=2)
    out = io.StringIO()
    with django_db_blocker.unblock():
        report = ChaosRun(config, out=out).run()
    figures = report.figures
    summary = out.getvalue() + report.summary()
    assert report.violations == [], summary
    assert report.passed, summary
    assert figures["failovers"] >= 2, summary
    # Every promotion raised the floor: the first token on each new primary is
    # at least FAILOVER_MARGIN above the last one acknowledged before.
    assert len(figures["tokens_skipped"]) == figures["failovers"], summary
    assert all(skipped >= FAILOVER_MARGIN for skipped in figures["tokens_skipped"]), summary
    # Clients the failover cut recorded unknown outcomes, not errors or refusals.
    assert figures["unknown"] > 0 and figures["worker_crashes"] == 0, summary
    print(f"\n{summary}")


def test_without_the_guard_and_synchronous_replication_a_failover_loses_grants(
    cluster: Cluster, django_db_blocker: Any
) -> None:
    # One lagging failover, even if the cluster is still recovering from the
    # test before when the run starts.
    config = ChaosConfig(seconds=8, workers=4, keys=2, ttl=1.0, seed=2, patroni=True, unsafe=True,
                         cluster_interval=1.0, lag_seconds=3.0, min_cluster_faults=1)
    out = io.StringIO()
    with django_db_blocker.unblock():
        report = ChaosRun(config, out=out).run()
    summary = out.getvalue() + report.summary()
    assert report.figures["failovers"] == 1, summary
    found = {violation.check for violation in report.violations}
    # The grants acknowledged while the standbys received nothing are not on the
    # promoted one (grant_lost), nor are the ledger records written under them
    # (lost_write); the grants after the promotion reuse their tokens (token_unique).
    assert {"grant_lost", "lost_write"} <= found, summary
    # The guard is back: the next grant on the cluster raises the floor.
    assert "promotion guard is DISABLED" in summary
    print(f"\n{summary}")
