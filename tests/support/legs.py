"""Which leg this run is, and what a missing service means on it.

bin/test runs the suite on three legs: ``pg`` (PostgreSQL, the main Django),
``sqlite`` (the embedded SQLite default, the main Django) and ``lts``
(PostgreSQL, Django 5.2 LTS). The leg is read from the database and Django the
run really uses, never from a variable that could disagree with them.
"""

from __future__ import annotations

import os
from typing import NoReturn

import django
import pytest
from django.db import connection

LEGS = ("pg", "sqlite", "lts")


def current_leg() -> str:
    """``"sqlite"``, ``"pg"`` (PostgreSQL on Django 6+) or ``"lts"`` (PostgreSQL on 5.2)."""
    if connection.vendor == "sqlite":
        return "sqlite"
    return "pg" if django.VERSION >= (6, 0) else "lts"


def services_required() -> bool:
    """True in CI (``CI=true``) or with ``COORDINATION_REQUIRE_SERVICES=1``: every
    service a test needs (Redis, the PostgreSQL server binaries, Chromium) must be
    there, and a missing one fails the run instead of skipping the test."""
    if os.environ.get("COORDINATION_REQUIRE_SERVICES", "") not in ("", "0"):
        return True
    return os.environ.get("CI", "").lower() in ("true", "1", "yes")


def missing_service(what: str) -> NoReturn:
    """Skip the test because ``what`` is missing; fail it where services are required."""
    if services_required():
        pytest.fail(
            f"{what} is missing, and this run requires every service "
            "(CI=true or COORDINATION_REQUIRE_SERVICES=1)",
            pytrace=False,
        )
    pytest.skip(f"{what} is missing (CI=true or COORDINATION_REQUIRE_SERVICES=1 makes this a failure)")
