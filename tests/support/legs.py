"""Which leg this run is, and what a missing service means on it.

bin/test runs the suite on five legs: ``pg`` (PostgreSQL, the main Django),
``sqlite`` (the embedded SQLite default, the main Django), ``lts``
(PostgreSQL, Django 5.2 LTS), ``mariadb`` (MariaDB, the main Django: the
database's side of the suite) and ``dj60`` (SQLite, Django 6.0: the unit, db
and processes tests on the Django release between the two). The leg is read from the database and Django the
run really uses, never from a variable that could disagree with them.
"""

from __future__ import annotations

import os
from typing import NoReturn

import django
import pytest
from django.db import connection

LEGS = ("pg", "sqlite", "lts", "mariadb", "dj60")

# Why the SQLite leg skips a @pytest.mark.postgres test.
POSTGRES_ONLY = "PostgreSQL-only behaviour; this leg is not PostgreSQL"
# Skips that are a leg's design besides the marks (which say "runs on the
# ... leg only: why", see leg_only): what one Django version has and the other
# lacks. A skip for any other reason fails the leg where services are required
# (tests/support/skip_budget.py); a new kind of planned skip is added here.
EXPECTED_SKIPS: dict[str, tuple[str, ...]] = {
    "pg": ("this Django has django.tasks",),
    "sqlite": (POSTGRES_ONLY, "this Django has django.tasks"),
    "lts": ("django.tasks is Django 6.0+",),
    "mariadb": (POSTGRES_ONLY, "this Django has django.tasks"),
    "dj60": (POSTGRES_ONLY, "this Django has django.tasks"),
}


def current_leg() -> str:
    """``"sqlite"``, ``"dj60"`` (SQLite on Django 6.0), ``"mariadb"``, ``"pg"``
    (PostgreSQL on Django 6+) or ``"lts"``
    (PostgreSQL on 5.2)."""
    if connection.vendor == "sqlite":
        return "dj60" if django.VERSION[:2] == (6, 0) else "sqlite"
    if connection.vendor == "mysql":
        return "mariadb"
    return "pg" if django.VERSION >= (6, 0) else "lts"


def leg_only(wanted: tuple[str, ...] | list[str], reason: str) -> str:
    """The skip reason of a test that runs on the ``wanted`` legs only."""
    return f"runs on the {'/'.join(wanted)} leg only: {reason}"


def expected_skip(leg: str, reason: str) -> bool:
    """Whether a skip for ``reason`` is the design of ``leg``: the test runs on
    other legs only (:func:`leg_only`), or the reason is on the leg's list."""
    if reason.startswith("runs on the ") and " leg only: " in reason:
        wanted = reason.removeprefix("runs on the ").split(" leg only: ", 1)[0].split("/")
        return leg not in wanted
    return reason in EXPECTED_SKIPS.get(leg, ())


def services_required() -> bool:
    """True in CI (``CI=true``) or with ``COORDINATION_REQUIRE_SERVICES=1``: every
    service a test needs (Redis, the PostgreSQL server binaries, Chromium) must be
    there, and a missing one fails the run instead of skipping the test."""
    if os.environ.get("COORDINATION_REQUIRE_SERVICES", "") not in ("", "0"):
        return True
    return os.environ.get("CI", "").lower() in ("true", "1", "yes")


def missing_service(what: str) -> NoReturn:
    """Skip the test because ``what`` is missing; fail it where services are required.

    Every test that needs a service it may not find (a server, a binary, a
    browser) says so through this function, never with a plain ``pytest.skip``:
    a missing service must not pass unnoticed in CI."""
    if services_required():
        pytest.fail(
            f"{what} is missing, and this run requires every service "
            "(CI=true or COORDINATION_REQUIRE_SERVICES=1)",
            pytrace=False,
        )
    pytest.skip(f"{what} is missing (CI=true or COORDINATION_REQUIRE_SERVICES=1 makes this a failure)")
