"""Fixtures of the tests that run real processes against the test database."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.support.celery_workers import (
    RedisBroker,
    Worker,
    start_worker,
    unique,
    wait_ready,
    wait_until_other_sessions_idle,
    wait_until_workers_disconnect,
)


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


@pytest.fixture(scope="module")
def start_workers(
    django_db_setup: None, django_db_blocker: Any, request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Callable[..., Worker]]:
    """Start real ``celery worker`` processes for the module's tests.

    ``start_workers(name, **options)`` starts one on a queue of its own
    (``queue=`` to share one) on the module's Redis broker (``embedded=True``:
    the site's own broker, the embedded default's filesystem one), with
    :func:`~tests.support.celery_workers.start_worker`'s options (pool,
    concurrency, environment), and returns it once it is ready
    (``ready=False``: at once, to wait for several with ``wait_ready``). All are
    stopped with SIGKILL after the module's tests, and their database sessions
    waited out.
    """
    logs = tmp_path_factory.mktemp("worker-logs")
    started: list[Worker] = []

    def start(
        name: str, *, queue: str | None = None, embedded: bool = False, ready: bool = True,
        **options: Any,
    ) -> Worker:
        broker = None if embedded else request.getfixturevalue("broker")
        worker = start_worker(name, queue or unique(name), logs, broker=broker, **options)
        started.append(worker)
        if ready:
            wait_ready([worker])
        return worker

    try:
        yield start
    finally:
        for worker in started:
            worker.stop()
        with django_db_blocker.unblock():
            wait_until_workers_disconnect()
