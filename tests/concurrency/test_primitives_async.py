"""The async twins of the primitives: ``aacquire_many``, ``aacquire_permit`` and
``aacquire_shared`` grant
as their sync versions do, and a cancelled coroutine never leaves a grant behind."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from coordination import aio, locks, signals
from coordination.exceptions import LockHeld
from coordination.leases import Lease
from coordination.models import Lock
from coordination.semaphores import aacquire_permit
from coordination.shared import aacquire_shared
from tests.concurrency.test_async import (
    DEADLINE,
    eventually,
    in_database,
    lock_is_free,
    run,
    wait_event,
)

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def _close_async_threads() -> Any:
    yield
    aio.close_threads()


def test_aacquire_many_grants_all_or_none_and_waits_for_a_held_key() -> None:
    async def main() -> None:
        held = await locks.aacquire("apair:b", holder="other", ttl=60)
        with pytest.raises(LockHeld):
            await locks.aacquire_many(["apair:a", "apair:b"], holder="mover", ttl=60)
        # Rolled back with the refusal: apair:a was never granted.
        assert not await in_database(lambda: Lock.objects.filter(key="apair:a").exists())

        waiting = asyncio.create_task(
            locks.aacquire_many(["apair:a", "apair:b"], holder="mover", ttl=60, wait=DEADLINE)
        )
        await locks.arelease(held)
        grants = await waiting
        assert {key: lease.token for key, lease in grants.items()} == {"apair:a": 1, "apair:b": 2}
        await in_database(lambda: locks.release_many(grants))

    run(main)


def test_a_cancelled_aacquire_many_or_aacquire_permit_gives_its_grant_back() -> None:
    granted = threading.Event()
    go = threading.Event()

    def hold_in_acquire(sender: Any, grant: Lease, **kwargs: Any) -> None:
        # In the pool's thread, after the grant committed: the worst moment to cancel.
        if grant.holder == "cancelled":
            granted.set()
            assert go.wait(DEADLINE)

    async def cancel_while_granting(start: Any, keys: list[str]) -> None:
        granted.clear()
        go.clear()
        task = asyncio.create_task(start())
        await wait_event(granted, "the grant")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        go.set()
        for key in keys:
            await eventually(lambda key=key: lock_is_free(key), f"the release of {key}")

    signals.lock_acquired.connect(hold_in_acquire)
    try:
        async def main() -> None:
            await cancel_while_granting(
                lambda: locks.aacquire_many(["cpair:a", "cpair:b"], holder="cancelled", ttl=60),
                ["cpair:a", "cpair:b"],
            )
            await cancel_while_granting(
                lambda: aacquire_permit("cpermits", limit=1, holder="cancelled", ttl=60),
                ["cpermits@1"],
            )
            permit = await aacquire_permit("cpermits", limit=1, holder="next", ttl=60)
            assert (permit.key, permit.token) == ("cpermits@1", 2)
            await locks.arelease(permit)

        run(main)
    finally:
        signals.lock_acquired.disconnect(hold_in_acquire)


def test_aacquire_shared_grants_readers_together_and_waits_for_a_writer() -> None:
    async def main() -> None:
        writer = await locks.aacquire("ashared", holder="writer", ttl=60)
        with pytest.raises(LockHeld):
            await aacquire_shared("ashared", holder="reader-1", ttl=60)
        waiting = asyncio.create_task(
            aacquire_shared("ashared", holder="reader-1", ttl=60, wait=DEADLINE)
        )
        await locks.arelease(writer)
        first = await waiting
        second = await aacquire_shared("ashared", holder="reader-2", ttl=60)
        assert (first.mode, second.mode) == ("shared", "shared")
        assert writer.token < first.token < second.token
        await locks.arenew(first, ttl=60)
        await locks.arelease(first)
        await locks.arelease(second)
        assert await in_database(lambda: lock_is_free("ashared"))

    run(main)
