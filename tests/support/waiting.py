"""Waiting on state, never on a blind sleep: every helper here polls a condition
and fails with a message once a deadline of seconds has passed."""

from __future__ import annotations

import datetime as dt
import threading
import time
from collections.abc import Callable
from typing import Any

from django.db import connection, connections

from coordination import locks


def wait_for(condition: Callable[[], Any], timeout: float = 30.0, what: str = "condition") -> Any:
    """Poll ``condition`` until it returns something truthy; return that value.

    Fails with ``AssertionError`` naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} never held within {timeout} s")
        time.sleep(0.01)


def wait_until_database_time_passes(moment: dt.datetime, margin: float = 0.05) -> None:
    """Sleep until the database clock (never this process's) is past ``moment``."""
    deadline = time.monotonic() + 30
    while locks.database_now() <= moment + dt.timedelta(seconds=margin):
        if time.monotonic() > deadline:  # pragma: no cover
            raise AssertionError(f"database clock never passed {moment}")
        time.sleep(0.02)


def wait_until_blocked_on_a_row_lock(backend_pid: int, timeout: float = 30.0) -> None:
    """PostgreSQL only: wait until the backend ``backend_pid`` waits on a lock."""
    deadline = time.monotonic() + timeout
    with connection.cursor() as cursor:
        while time.monotonic() < deadline:
            cursor.execute(
                "SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", [backend_pid]
            )
            row = cursor.fetchone()
            if row and row[0] == "Lock":
                return
            time.sleep(0.01)
    raise AssertionError(f"backend {backend_pid} never blocked on a row lock")


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
