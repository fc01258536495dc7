"""Every kind of acquire, sync and async, turns a connection cut during its call into
GrantPointUnavailable (the outcome unknown, no lease returned), whether the cut
comes before its first attempt or while it waits; the next call connects again
(docs/high-availability.md)."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from coordination import aio, locks
from coordination.backends import get_backend
from coordination.exceptions import GrantPointUnavailable
from coordination.models import Grant
from coordination.semaphores import aacquire_permit, acquire_permit
from coordination.shared import aacquire_shared, acquire_shared
from coordination.waiting import Waiter
from tests.support.connections import cut_this_connection

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.postgres,
    pytest.mark.usefixtures("grant_point"),
]


# Each kind: the sync call, its async twin, and the key whose lock a holder
# keeps busy so that a waiting call waits.
ACQUIRES: dict[str, tuple[Callable[..., Any], Callable[..., Any], str]] = {
    "acquire": (
        functools.partial(locks.acquire, "cut:one"),
        functools.partial(locks.aacquire, "cut:one"),
        "cut:one",
    ),
    "acquire_many": (
        functools.partial(locks.acquire_many, ["cut:a", "cut:b"]),
        functools.partial(locks.aacquire_many, ["cut:a", "cut:b"]),
        "cut:b",
    ),
    "acquire_shared": (
        functools.partial(acquire_shared, "cut:read"),
        functools.partial(aacquire_shared, "cut:read"),
        "cut:read",
    ),
    "acquire_permit": (
        functools.partial(acquire_permit, "cut:pool", limit=1),
        functools.partial(aacquire_permit, "cut:pool", limit=1),
        "cut:pool@1",
    ),
}


@pytest.fixture(params=sorted(ACQUIRES))
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def threads_closed() -> Iterator[None]:
    yield
    aio.close_threads()


def cut_before_each_grant_attempt(monkeypatch: pytest.MonkeyPatch) -> None:
    """Cut the calling thread's connection as each grant attempt starts (on the
    app's threads too: the backend is shared, the connection is the thread's)."""
    backend = get_backend()
    for method in ("acquire", "acquire_many", "acquire_shared"):
        real = getattr(backend, method)

        def cutting(*args: Any, _real: Any = real) -> Any:
            cut_this_connection()
            return _real(*args)

        monkeypatch.setattr(backend, method, cutting)


def no_grant_recorded() -> bool:
    return not Grant.objects.filter(lock__key__startswith="cut:", holder="w").exists()


def test_a_cut_connection_makes_every_acquire_unavailable_and_the_retry_is_granted(
    kind: str,
) -> None:
    sync, _, _ = ACQUIRES[kind]
    cut_this_connection()

    with pytest.raises(GrantPointUnavailable) as raised:
        sync(holder="w", ttl=30)

    assert raised.value.code == "grant_point_unavailable"
    assert "No lease was returned" in raised.value.detail
    assert no_grant_recorded()
    granted = sync(holder="w", ttl=30)  # the broken connection was closed: it connects again
    assert granted


def test_a_connection_cut_while_waiting_makes_every_acquire_unavailable(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    sync, _, busy_key = ACQUIRES[kind]
    held = locks.acquire(busy_key, holder="other", ttl=30)
    sleep = Waiter.sleep

    def cut_while_sleeping(waiter: Waiter, pause: float) -> None:
        sleep(waiter, pause)
        cut_this_connection()  # the next attempt, or the wait's own queries, find it cut

    monkeypatch.setattr(Waiter, "sleep", cut_while_sleeping)

    with pytest.raises(GrantPointUnavailable):
        sync(holder="w", ttl=30, wait=5)

    assert no_grant_recorded()
    locks.release(held)  # the holder's lease was never touched


@pytest.mark.usefixtures("threads_closed")
def test_a_cut_connection_makes_every_async_acquire_unavailable(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, twin, _ = ACQUIRES[kind]
    cut_before_each_grant_attempt(monkeypatch)

    with pytest.raises(GrantPointUnavailable) as raised:
        asyncio.run(twin(holder="w", ttl=30))

    assert "No lease was returned" in raised.value.detail
    assert no_grant_recorded()
