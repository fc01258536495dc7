"""Real processes: a holder of a pair of keys (``acquire_many``), of a
semaphore permit or of a shared (reader) grant is stopped (SIGSTOP) past its lease, another holder takes the
same grant and writes, and the stopped holder's late write, once resumed, is
refused (rules 1 and 2 of docs/rules.md; docs/primitives.md)."""

from __future__ import annotations

import datetime as dt
import json
import subprocess
import sys
from typing import Any

import pytest

from coordination import locks
from coordination.fencing import fence
from coordination.leases import Lease
from coordination.semaphores import acquire_permit
from tests.support.celery_workers import REPO, worker_environment
from tests.support.pausing import paused
from tests.support.waiting import wait_until_database_time_passes

pytestmark = [
    pytest.mark.postgres,
    pytest.mark.legs("pg", reason="a child process per test; the LTS leg runs the same code"),
    pytest.mark.django_db(transaction=True),
]


def start_holder(kind: str, name: str, ttl: float) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    child = subprocess.Popen(
        [sys.executable, "-m", "tests.support.primitive_holder", kind, name, str(ttl)],
        cwd=REPO, env=worker_environment(None), text=True,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
    )
    assert child.stdout is not None
    line = child.stdout.readline()
    assert line, f"the holder process ended early (exit {child.wait(30)})"
    return child, json.loads(line)


def read_outcome(child: subprocess.Popen[str]) -> str:
    """Let the (resumed) holder write again; its outcome."""
    assert child.stdin is not None and child.stdout is not None
    child.stdin.write("go\n")
    child.stdin.flush()
    line = child.stdout.readline()
    assert child.wait(30) == 0
    return str(json.loads(line)["outcome"])


@pytest.mark.parametrize("kind", ["pair", "permit", "reader"])
def test_a_stopped_holder_is_refused_after_the_next_holder_wrote(kind: str) -> None:
    # The semaphore's other slot is held throughout (it runs on untouched), taken
    # before the holder starts: the holder's 1 s lease may well have run out by
    # the time this process reads its report, and a slot taken then could be its.
    other = None if kind != "permit" else acquire_permit(
        f"{kind}-race", limit=2, holder="other", ttl=60
    )
    child, report = start_holder(kind, f"{kind}-race", ttl=1.0)
    try:
        with paused(child):
            ends = [dt.datetime.fromisoformat(end) for _, end in report["grants"].values()]
            wait_until_database_time_passes(max(ends))
            grants: dict[str, Lease]
            if kind == "reader":
                # A writer takes the name over from the expired reader and writes.
                grants = {f"{kind}-race": locks.acquire(f"{kind}-race", holder="writer", ttl=30)}
            elif other is None:
                grants = locks.acquire_many(sorted(report["grants"]), holder="next", ttl=30)
            else:
                assert other.key not in report["grants"]
                # The only grantable slot is the stopped holder's: taken over.
                successor = acquire_permit(f"{kind}-race", limit=2, holder="next", ttl=30)
                grants = {successor.key: successor}
            assert sorted(grants) == sorted(report["grants"])
            for key, lease in grants.items():
                assert lease.token == report["grants"][key][0] + 1
            with fence(sorted(grants), grants):
                pass
        assert read_outcome(child) == "stale_token"
        if other is not None:
            with fence(other.key, other):  # the other slot's holder writes on
                pass
    finally:
        if child.poll() is None:
            child.kill()  # SIGKILL ends it whether or not it was resumed
        child.wait(30)
