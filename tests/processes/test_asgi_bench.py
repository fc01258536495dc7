"""The smoke run of ``manage.py coordination_asgi_bench``: uvicorn serves the async
views, every request holds its lock and answers 200, and the JSON has the
figures docs/async.md reports. No timing is asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from django.conf import settings

from coordination.models import Grant, GrantEnd, Lock
from tests.processes.test_bench import database_url

pytestmark = pytest.mark.django_db(transaction=True)


def test_asgi_bench_holds_every_lock_under_uvicorn_and_reports_the_loop_lag(tmp_path: Path) -> None:
    out = tmp_path / "asgi.json"
    done = subprocess.run(
        [sys.executable, str(settings.BASE_DIR / "manage.py"), "coordination_asgi_bench",
         "--requests", "20", "--rounds", "1", "--ramp", "0.2", "--hold", "0.1",
         "--mode", "ahold", "--mode", "baseline", "--json", str(out)],
        env={**os.environ, "DATABASE_URL": database_url(), "COORDINATION_LOG_LEVEL": "WARNING"},
        capture_output=True, text=True, timeout=240, check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]

    results = json.loads(out.read_text())
    for mode in ("ahold", "baseline", "in_process"):
        row = results[mode]
        assert row.get("errors", 0) == 0, (mode, row)
        assert row["lag_samples"] > 0 and row["lag_p99_ms"] is not None, (mode, row)
    assert results["ahold"]["ok"] == 20
    # 20 warm-up and 20 measured requests through uvicorn, 20 in-process holders:
    # each took a grant of a key of its own and released it.
    grants = Grant.objects.filter(lock__key__startswith="asgi-bench:")
    assert grants.count() == 60
    assert set(grants.values_list("end_reason", flat=True)) == {GrantEnd.RELEASED}
    assert not Lock.objects.filter(key__startswith="asgi-bench:").exclude(holder="").exists()
