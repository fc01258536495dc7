"""Fixtures of the tests that run real processes against the test database."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.celery_workers import RedisBroker, wait_until_other_sessions_idle


@pytest.fixture(autouse=True)
def _workers_idle_before_teardown(request: pytest.FixtureRequest) -> Iterator[None]:
    """Before a transactional test's database is flushed, let the workers'
    transactions finish (see ``wait_until_other_sessions_idle``).

    This fixture is set up after pytest-django's database fixture (autouse
    fixtures of plugins come first), so its teardown runs before the flush.
    """
    yield
    marker = request.node.get_closest_marker("django_db")
    if marker is not None and marker.kwargs.get("transaction"):
        wait_until_other_sessions_idle()


@pytest.fixture(scope="module")
def broker() -> Iterator[RedisBroker]:
    """A Redis broker with a key prefix of the module's own, cleaned after it."""
    fresh = RedisBroker.fresh()
    yield fresh
    fresh.clean()
