"""Layout, markers and shared fixtures of the suite.

Each test lives in the directory that says what it needs, and gets that
directory's marker, so ``pytest -m unit`` runs the part that needs no database:

  tests/unit/         no database at all (pytest-django refuses any query)
  tests/db/           one connection: ordinary ``django_db`` tests
  tests/concurrency/  threads or processes with their own connections, row
                      locks, LISTEN/NOTIFY
  tests/processes/    real ``celery worker`` processes, the demo, chaos, bench,
                      other subprocesses
  tests/browser/      Chromium driven by Playwright
  tests/cluster/      a Patroni + etcd PostgreSQL cluster (bin/cluster.sh), failovers
  tests/support/      helpers, factories, worker settings (no tests)

Two marks say why a test does not run on every leg (see tests/support/legs.py):

  @pytest.mark.postgres                  the behaviour only exists on PostgreSQL
  @pytest.mark.legs("pg", reason="...")  the test runs on the named legs only,
                                         for the reason given (e.g. a long run
                                         that gains nothing from repeating it)

Without a legs mark a test runs on every leg, except in three directories
(``DEFAULT_LEGS``): tests/unit/ skips the SQLite leg (no database, and the
same Python and Django as the pg leg), tests/concurrency/ skips the LTS
leg (threads on row locks are the database's behaviour, not Django's; the
async tests, whose code differs between Django versions, are marked to run
there), and tests/cluster/ runs on the pg leg only.

Those skips are the legs' design. Any other skip fails the leg where every
service is required (CI=true, bin/test): the skip budget
(tests/support/skip_budget.py, its expected reasons in tests/support/legs.py).
A test whose service may be missing says so with ``missing_service()``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from django.db import connection

from coordination.backends import get_backend

from .support import hostile
from .support.legs import LEGS, POSTGRES_ONLY, current_leg, expected_skip, leg_only, services_required
from .support.lingering import lingering_sessions
from .support.skip_budget import SkipBudget
from .support.waiting import run_in_threads

TESTS = Path(__file__).resolve().parent
KINDS = ("unit", "db", "concurrency", "processes", "browser", "cluster")
# Seconds a test may take (pytest-timeout, setup included) before it fails as
# hung: several times the slowest test of each directory on a loaded 2-core
# machine. A test that needs more says so with @pytest.mark.timeout(...).
DEFAULT_LEGS = {
    "unit": ("pg", "lts", "dj60", "no database: the pg leg runs it on the same Python and Django"),
    "concurrency": (
        "pg", "sqlite", "mariadb", "threads on row locks are the database's behaviour, not Django's"
    ),
    "cluster": ("pg", "one Django on PostgreSQL is enough, and the cluster is slow to start"),
}
TIMEOUTS = {
    "unit": 60, "db": 120, "concurrency": 180, "processes": 600, "browser": 300, "cluster": 300,
}


def pytest_configure(config: pytest.Config) -> None:
    for kind, needs in {
        "unit": "no database (tests/unit/)",
        "db": "one database connection (tests/db/)",
        "concurrency": "threads or processes with their own connections (tests/concurrency/)",
        "processes": "celery workers, the demo, chaos and bench subprocesses (tests/processes/)",
        "browser": "Chromium and Playwright (tests/browser/)",
        "cluster": "a Patroni + etcd PostgreSQL cluster (tests/cluster/)",
    }.items():
        config.addinivalue_line("markers", f"{kind}: needs {needs}; set from the directory")
    # A leg fails on a skip it does not expect where every service is required
    # (tests/support/skip_budget.py); every run prints its skips by reason.
    config.pluginmanager.register(
        SkipBudget(current_leg, expected_skip, enforce=services_required()), "coordination-skip-budget"
    )


def _kind(item: pytest.Item) -> str:
    try:
        parts = item.path.resolve().relative_to(TESTS).parts
    except ValueError:  # pragma: no cover - a test outside tests/
        return ""
    return parts[0] if len(parts) > 1 and parts[0] in KINDS else ""


def pytest_terminal_summary(terminalreporter: Any) -> None:
    line = hostile.session_summary()
    if line is not None:
        terminalreporter.write_line(line)
    for session in lingering_sessions():
        terminalreporter.write_line(f"session still on the test database after the run: {session}")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    leg = current_leg()
    for item in items:
        kind = _kind(item)
        if not kind:
            raise pytest.UsageError(
                f"{item.nodeid}: test files go in one of tests/{{{','.join(KINDS)}}}/ "
                "(see tests/conftest.py)"
            )
        if kind == "unit" and item.get_closest_marker("django_db"):
            raise pytest.UsageError(
                f"{item.nodeid}: uses the database; move it from tests/unit/ to tests/db/"
            )
        item.add_marker(getattr(pytest.mark, kind))
        if item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(TIMEOUTS[kind]))

        if leg in ("sqlite", "mariadb", "dj60") and item.get_closest_marker("postgres"):
            item.add_marker(pytest.mark.skip(reason=POSTGRES_ONLY))
        legs_mark = item.get_closest_marker("legs")
        if legs_mark is not None:
            wanted = legs_mark.args
            reason = legs_mark.kwargs.get("reason")
            unknown = set(wanted) - set(LEGS)
            if not wanted or unknown or not reason:
                raise pytest.UsageError(
                    f"{item.nodeid}: @pytest.mark.legs needs leg names from {LEGS} and a reason="
                )
            if leg not in wanted:
                item.add_marker(pytest.mark.skip(reason=leg_only(wanted, reason)))
        elif kind in DEFAULT_LEGS and leg not in DEFAULT_LEGS[kind][:-1]:
            *wanted, reason = DEFAULT_LEGS[kind]
            item.add_marker(pytest.mark.skip(reason=leg_only(wanted, reason)))


@pytest.fixture
def vendor() -> str:
    return connection.vendor


def grant_points() -> list[tuple[str | None, str]]:
    """The grant-point backends of this run's database: (GRANT_POINT value, test id)."""
    if connection.vendor == "postgresql":
        return [(None, "functions"), ("orm", "orm")]
    if connection.vendor == "mysql":
        return [(None, "procedures"), ("orm", "orm")]
    return [(None, connection.vendor)]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    # Tests that ask for ``grant_point`` (or use it through usefixtures) run once
    # per backend the database has.
    if "grant_point" in metafunc.fixturenames:
        points = grant_points()
        metafunc.parametrize(
            "grant_point", [value for value, _ in points], ids=[name for _, name in points],
            indirect=True,
        )


@pytest.fixture
def grant_point(request: pytest.FixtureRequest, settings: Any) -> str:
    """COORDINATION["GRANT_POINT"] set to this run's value; the backend's name."""
    settings.COORDINATION = {
        **(getattr(settings, "COORDINATION", None) or {}), "GRANT_POINT": request.param,
    }
    return get_backend().name


@pytest.fixture
def in_threads() -> Iterator[Callable[..., list[Any]]]:
    yield run_in_threads


@pytest.fixture(autouse=True)
def fresh_throttle_counts() -> None:
    """Every test starts with an empty default cache: the API's throttles and the
    admin login's failure counts live there, and one test's requests (all from
    127.0.0.1) must not spend the next one's rate."""
    from django.core.cache import cache

    cache.clear()
