"""Running ``manage.py coordination_demo`` as a user runs it, against this run's
test database, with the broker of this leg."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from django.db import connection

from project.lab.management.commands.coordination_demo import worker_environment
from tests.support.legs import missing_service

REPO = Path(__file__).resolve().parents[2]


def broker_for_this_leg() -> str:
    if connection.vendor == "sqlite":
        return "filesystem://"
    url = os.environ.get("COORDINATION_TEST_REDIS_URL", "")
    if not url:
        missing_service(
            "a Redis broker: COORDINATION_TEST_REDIS_URL is not set (the demo on PostgreSQL uses a real "
            "Redis; bin/test starts one; by hand: export COORDINATION_TEST_REDIS_URL=redis://127.0.0.1:6379/0)"
        )
    return url


def run_demo(tmp_path: Path, *arguments: str) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    report = tmp_path / "demo.json"
    env = worker_environment(broker_for_this_leg())
    finished = subprocess.run(
        [sys.executable, "manage.py", "coordination_demo", "--json", str(report), *arguments],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=180, check=False,
    )
    output = f"exit {finished.returncode}\n{finished.stdout}\n{finished.stderr}"
    assert report.exists(), f"no JSON report: {output}"
    return finished, json.loads(report.read_text())


def child_environment() -> dict[str, str]:
    """The environment of a child Django process using this run's test database."""
    return worker_environment("memory://")
