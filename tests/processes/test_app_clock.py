"""Leases are decided by the database's clock, never the application's.

The application process runs with its wall clock really moved a year ahead or
behind (libfaketime, preloaded into a child process: ``time.time``,
``datetime.now`` and ``timezone.now`` all agree on the wrong time), against the
test database whose server keeps the right time. If any part of the grant point
read the application's clock, a held lock would look expired a year ahead, an
expired one would look held a year behind, and new leases would be dated wrong.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from coordination import locks
from coordination.models import Grant, GrantEnd
from tests.support.demo import REPO, child_environment
from tests.support.legs import missing_service
from tests.support.waiting import wait_until_database_time_passes

# On SQLite the database's clock is the application process's own clock: there
# is no second clock to disagree with.
pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]

def libfaketime() -> Path | None:
    """Debian's faketime package puts it under the architecture's library directory."""
    if os.environ.get("COORDINATION_LIBFAKETIME"):
        return Path(os.environ["COORDINATION_LIBFAKETIME"])
    found = sorted(Path("/usr/lib").glob("*/faketime/libfaketime.so.1"))
    return found[0] if found else None

CHILD = """
import datetime as dt, json, os
import django
django.setup()
from django.utils import timezone
from coordination import locks
from coordination.exceptions import LockHeld
out = {"app_now": timezone.now().isoformat(), "wall": dt.datetime.now(dt.UTC).isoformat()}
try:
    locks.acquire("clock:held", holder="skewed", ttl=5)
    out["held"] = "granted"
except LockHeld as refused:
    out["held"] = refused.code
grant = locks.acquire("clock:expired", holder="skewed", ttl=30)
out["expired"] = {"token": grant.token, "acquired_at": grant.acquired_at.isoformat(),
                  "expires_at": grant.expires_at.isoformat()}
print(json.dumps(out))
"""


def run_with_clock_moved(offset: str) -> dict[str, object]:
    library = libfaketime()
    if library is None or not library.exists():
        missing_service("libfaketime (Debian package faketime; or set COORDINATION_LIBFAKETIME)")
    env = child_environment() | {
        "LD_PRELOAD": str(library),
        "FAKETIME": offset,
        "FAKETIME_DONT_FAKE_MONOTONIC": "1",  # timeouts and waits stay sane
        "FAKETIME_NO_CACHE": "1",
    }
    done = subprocess.run(
        [sys.executable, "-c", CHILD], cwd=REPO, env=env, capture_output=True, text=True,
        timeout=120, check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.parametrize("offset", ["+365d", "-365d"])
def test_a_year_of_application_clock_skew_changes_no_lease_decision(offset: str) -> None:
    held = locks.acquire("clock:held", holder="A", ttl=60)
    expired = locks.acquire("clock:expired", holder="A", ttl=0.2)
    wait_until_database_time_passes(expired.expires_at)

    before = locks.database_now()
    child = run_with_clock_moved(offset)
    after = locks.database_now()

    # The fake clock really took hold in the child (otherwise this proves nothing).
    for seen in (child["app_now"], child["wall"]):
        skew = (dt.datetime.fromisoformat(str(seen)) - before).total_seconds()
        assert abs(skew) > 300 * 86400, f"the child's clock was not moved: {seen} vs {before}"
    # A lock held by the database's clock stays held, whatever the app believes.
    assert child["held"] == "lock_held"
    # A lease expired by the database's clock is taken over, and the new lease is
    # dated by the database's clock.
    taken = child["expired"]
    assert isinstance(taken, dict)
    assert taken["token"] == expired.token + 1
    acquired_at = dt.datetime.fromisoformat(taken["acquired_at"])
    expires_at = dt.datetime.fromisoformat(taken["expires_at"])
    assert before <= acquired_at <= after
    assert expires_at - acquired_at == dt.timedelta(seconds=30)
    assert Grant.objects.get(lock__key="clock:expired", token=expired.token).end_reason == GrantEnd.EXPIRED
    locks.release(held)
