"""project/lab/bench_stores.py runs end to end and prints both rows."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.support.celery_workers import REPO

pytest.importorskip("moto")


def test_bench_stores_prints_plain_and_fenced_p50() -> None:
    url = os.environ.get("COORDINATION_TEST_REDIS_URL", "")
    if not url:
        pytest.skip("a Redis server: COORDINATION_TEST_REDIS_URL is not set")
    env = {key: value for key, value in os.environ.items() if key != "DJANGO_SETTINGS_MODULE"}
    done = subprocess.run(
        [sys.executable, "-m", "project.lab.bench_stores", "--writes", "5", "--redis", url],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "S3 object (1 KiB)" in done.stdout and "Redis key" in done.stdout
