"""Shared test helpers. Tests run against the database DATABASE_URL names
(PostgreSQL in CI) and against the embedded SQLite default."""

from __future__ import annotations

import datetime as dt
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from django.db import connection, connections

from coordination import locks
from coordination.backends import get_backend


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Behaviour that only PostgreSQL has (row-lock re-checks, REPEATABLE READ,
    # a second connection inside a transaction) is tested where it exists.
    if connection.vendor == "postgresql":
        return
    skip = pytest.mark.skip(reason="PostgreSQL behaviour; this run is on SQLite")
    for item in items:
        if "postgres" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def vendor() -> str:
    return connection.vendor


def grant_points() -> list[tuple[str | None, str]]:
    """The grant-point backends of this run's database: (GRANT_POINT value, test id)."""
    if connection.vendor == "postgresql":
        return [(None, "functions"), ("orm", "orm")]
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


def wait_until_database_time_passes(moment: dt.datetime, margin: float = 0.05) -> None:
    """Sleep until the database clock (never this process's) is past ``moment``."""
    deadline = time.monotonic() + 30
    while locks.database_now() <= moment + dt.timedelta(seconds=margin):
        if time.monotonic() > deadline:  # pragma: no cover
            raise AssertionError(f"database clock never passed {moment}")
        time.sleep(0.02)


def run_in_threads(count: int, work: Callable[[int], Any], timeout: float = 120) -> list[Any]:
    """Run ``work(i)`` in ``count`` threads, each with its own database connection.

    Returns the results in thread order; re-raises the first exception.
    """
    results: list[Any] = [None] * count
    errors: list[BaseException] = []
    start = threading.Barrier(count)

    def run(index: int) -> None:
        try:
            start.wait()
            results[index] = work(index)
        except BaseException as error:
            errors.append(error)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)
        assert not thread.is_alive(), "a worker thread hung"
    if errors:
        raise errors[0]
    return results


@pytest.fixture
def in_threads() -> Iterator[Callable[..., list[Any]]]:
    yield run_in_threads
