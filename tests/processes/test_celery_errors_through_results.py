"""A task's coordination error reaches the caller of ``AsyncResult.get()`` with its
class and fields: a real ``celery worker``, a Redis broker and a Redis result
backend storing results as JSON (Celery's default result serializer)."""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Callable
from typing import Any

import pytest
import redis
from celery.backends.redis import RedisBackend
from celery.result import AsyncResult

from coordination import locks
from coordination.exceptions import LockHeld, StaleToken
from project.celery import app
from tests.support import celery_result_tasks as tasks
from tests.support.celery_workers import (
    RedisBroker,
    Worker,
    unique,
)

pytestmark = [
    pytest.mark.legs("pg", "lts", reason="a real worker on the test database needs a database server"),
    pytest.mark.django_db(transaction=True),
]

#: Generous: the worker shares two cores with the rest of the suite.
RESULT_TIMEOUT = 60


@pytest.fixture(scope="module")
def results(broker: RedisBroker) -> Any:
    """The Redis result backend, as the caller's process configures it."""
    backend = RedisBackend(app=app, url=broker.url)
    assert backend.serializer == "json"
    return backend


@pytest.fixture(scope="module")
def worker(start_workers: Callable[..., Worker], broker: RedisBroker, results: Any) -> Worker:
    return start_workers(
        "results",
        # The site's settings read the result backend from the environment, and
        # `celery worker` reads --include from CELERY_WORKER_INCLUDE.
        CELERY_RESULT_BACKEND=broker.url,
        CELERY_WORKER_INCLUDE=tasks.__name__,
    )


def run(task: Any, worker: Worker, broker: RedisBroker, results: Any, *args: object) -> AsyncResult:
    with broker.connection() as conn:
        sent = task.apply_async(args, queue=worker.queue, connection=conn)
    return AsyncResult(sent.id, backend=results, app=app)


def test_a_stale_token_raised_in_a_task_is_caught_as_stale_token_by_the_caller(
    worker: Worker, broker: RedisBroker, results: Any
) -> None:
    key = unique("invoice")
    result = run(tasks.write_with_a_stale_token, worker, broker, results, key)

    with pytest.raises(StaleToken) as caught:
        result.get(timeout=RESULT_TIMEOUT, propagate=True)
    stored = json.loads(redis.Redis.from_url(broker.url).get(results.get_key_for_task(result.id)))
    result.forget()

    error = caught.value
    assert type(error) is StaleToken
    assert error.resource == key
    assert 0 < error.token < error.current_token
    assert error.as_dict()["code"] == "stale_token"
    # What the worker stored, as JSON: the class's name and module and its args.
    assert (stored["result"]["exc_module"], stored["result"]["exc_type"]) == (
        "coordination.exceptions", "StaleToken",
    )


def test_lock_held_raised_in_a_task_is_caught_as_lock_held_with_its_holder_and_expiry(
    worker: Worker, broker: RedisBroker, results: Any
) -> None:
    key = unique("report")
    held = locks.acquire(key, holder="the-caller", ttl=60)
    try:
        result = run(tasks.acquire_without_waiting, worker, broker, results, key)
        with pytest.raises(LockHeld) as caught:
            result.get(timeout=RESULT_TIMEOUT, propagate=True)
        result.forget()
    finally:
        locks.release(held)

    error = caught.value
    assert (error.key, error.holder) == (key, "the-caller")
    assert isinstance(error.expires_at, dt.datetime)
    assert abs(error.expires_at - held.expires_at) < dt.timedelta(seconds=1)
    assert 0 < error.retry_after <= 60

