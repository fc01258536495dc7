"""The asyncio API: the same grants, fences and refusals as the sync API, run on
the app's own threads, and a cancelled coroutine never leaves a lease behind.

Each test runs its coroutine with ``asyncio.run`` (no plugin needed). The
coroutines reach the database only through the app's thread pool, whose
connections are their own, so the tests are transactional; the pool is closed
after each test, which closes its connections.

Cancellation is tested at each await point a caller can reach: while an
acquire runs (after it granted, the worst moment), while the block of
``ahold`` runs, and while the release runs (the redis-py #3847 trap: a
release cancelled before it completes must still complete, and must not make
the cancelled coroutine hang). A release is held at a chosen point by wrapping
the backend's own ``release`` so that it waits for an event before doing the
real work; nothing is faked.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections.abc import Callable, Coroutine, Iterator
from decimal import Decimal
from typing import Any

import pytest

from coordination import aio, locks, signals
from coordination.backends import get_backend
from coordination.exceptions import InvalidInput, LeaseLost, LockHeld, StaleToken
from coordination.fencing import afence
from coordination.leases import Lease
from coordination.models import Fence, Grant, GrantEnd, Lock, Rejection, RejectionReason
from project.demo.models import Account
from tests.support.factories import AccountFactory

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.legs("pg", "sqlite", "lts", reason="async code differs between Django versions"),
]

DEADLINE = 30.0


@pytest.fixture(autouse=True)
def _close_async_threads() -> Iterator[None]:
    yield
    aio.close_threads()


def run(main: Callable[[], Coroutine[Any, Any, Any]]) -> Any:
    return asyncio.run(asyncio.wait_for(main(), DEADLINE))


async def in_database(func: Callable[[], Any]) -> Any:
    """Run a sync ORM read from a coroutine, on the app's threads."""
    return await aio.run_sync(func)


async def eventually(condition: Callable[[], Any], what: str) -> Any:
    """Poll ``condition`` (sync, run on the app's threads) until it holds, within seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + DEADLINE
    while True:
        value = await in_database(condition)
        if value:
            return value
        if loop.time() > deadline:
            raise AssertionError(f"{what} never held within {DEADLINE} s")
        await asyncio.sleep(0.02)


async def wait_event(event: threading.Event, what: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + DEADLINE
    while not event.is_set():
        if loop.time() > deadline:
            raise AssertionError(f"{what} never happened within {DEADLINE} s")
        await asyncio.sleep(0.01)


def lock_is_free(key: str) -> bool:
    return Lock.objects.filter(key=key, holder="").exists()


class HeldRelease:
    """Makes the backend's release wait for :attr:`go` before releasing for real."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.entered = threading.Event()
        self.go = threading.Event()
        backend = get_backend()
        real = backend.release

        def release(grant: Lease) -> Any:
            self.entered.set()
            assert self.go.wait(DEADLINE)
            return real(grant)

        monkeypatch.setattr(backend, "release", release)


def test_aacquire_arenew_arelease_keep_the_sync_guarantees_and_errors() -> None:
    async def main() -> None:
        first = await locks.aacquire("job:a", holder="a", ttl=10)
        with pytest.raises(LockHeld) as held:
            await locks.aacquire("job:a", holder="b", ttl=10)
        assert held.value.holder == "a" and held.value.retry_after > 0
        renewed = await locks.arenew(first, ttl=20)
        assert renewed is first and first.expires_at > first.acquired_at
        assert (await locks.arelease(first)).end_reason == GrantEnd.RELEASED
        with pytest.raises(LeaseLost):
            await locks.arelease(first)
        second = await locks.aacquire("job:a", holder="b", ttl=10)
        assert second.token == first.token + 1
        await locks.arelease(second)
        with pytest.raises(InvalidInput):
            await locks.aacquire("bad key!", holder="a")

    run(main)
    assert list(Grant.objects.order_by("token").values_list("token", "end_reason")) == [
        (1, GrantEnd.RELEASED), (2, GrantEnd.RELEASED),
    ]


def test_a_waiting_aacquire_gets_the_lock_when_the_holder_releases_it() -> None:
    async def main() -> tuple[int, int]:
        holder = await locks.aacquire("job:w", holder="a", ttl=30)
        waiter = asyncio.create_task(locks.aacquire("job:w", holder="b", ttl=30, wait=20))
        await asyncio.sleep(0.2)
        assert not waiter.done()
        await locks.arelease(holder)
        granted = await waiter
        await locks.arelease(granted)
        return holder.token, granted.token

    assert run(main) == (1, 2)


def test_many_concurrent_holders_get_unique_increasing_tokens_on_a_bounded_pool(settings: Any) -> None:
    settings.COORDINATION = {**getattr(settings, "COORDINATION", {}), "ASYNC_THREADS": 4}

    async def one(index: int) -> int:
        async with locks.ahold("job:hot", holder=f"h{index}", ttl=10, wait=25) as grant:
            assert locks.current_grant() is grant
            await asyncio.sleep(0)
            return grant.token

    async def main() -> list[int]:
        tokens = await asyncio.gather(*(one(i) for i in range(40)))
        assert aio.threads().started <= 4
        return tokens

    tokens = run(main)
    assert sorted(tokens) == list(range(1, 41))
    grants = Grant.objects.filter(lock__key="job:hot").order_by("token")
    # Leases of one key never overlapped in database time.
    ends = list(grants.values_list("acquired_at", "ended_at"))
    assert all(earlier[1] <= later[0] for earlier, later in itertools.pairwise(ends))
    assert Lock.objects.get(key="job:hot").holder == ""


def test_a_stale_write_from_async_code_is_refused_exactly_as_in_sync_code() -> None:
    account = AccountFactory(balance=Decimal("10.00"))
    key = f"account:{account.pk}"
    rows = Account.objects.filter(pk=account.pk)

    def race_sync() -> StaleToken:
        a = locks.acquire(key, holder="a", ttl=30)
        locks.revoke(key)  # A's lease ends while A is paused
        b = locks.acquire(key, holder="b", ttl=30)
        rows.fenced_update(b, balance=Decimal("20.00"))
        with pytest.raises(StaleToken) as refused:
            rows.fenced_update(a, balance=Decimal("99.00"))
        locks.release(b)
        return refused.value

    async def race_async() -> StaleToken:
        a = await locks.aacquire(key, holder="a", ttl=30)
        await in_database(lambda: locks.revoke(key))
        async with locks.ahold(key, holder="b", ttl=30):
            await rows.afenced_update(balance=Decimal("30.00"))   # the current grant: B's
        with pytest.raises(StaleToken) as refused:
            await Account.objects.filter(pk=account.pk).afenced_update(a, balance=Decimal("99.00"))
        return refused.value

    sync_refusal = race_sync()
    async_refusal = run(race_async)

    assert type(async_refusal) is type(sync_refusal)
    assert (sync_refusal.token, sync_refusal.current_token) == (1, 2)
    assert (async_refusal.token, async_refusal.current_token) == (3, 4)
    assert async_refusal.code == sync_refusal.code == "stale_token"
    assert async_refusal.as_dict().keys() == sync_refusal.as_dict().keys()
    assert rows.get().balance == Decimal("30.00")
    assert rows.get().fence == 4
    refusals = list(Rejection.objects.order_by("pk").values_list("token", "watermark_token", "reason"))
    assert refusals == [(1, 2, RejectionReason.STALE), (3, 4, RejectionReason.STALE)]


def test_afence_runs_the_operation_inside_the_fence_transaction_or_refuses_before_it() -> None:
    async def main() -> list[str]:
        done: list[str] = []
        a = await locks.aacquire("ledger:1", holder="a", ttl=30)
        await in_database(lambda: locks.revoke("ledger:1"))
        async with locks.ahold("ledger:1", holder="b", ttl=30):
            row = await afence("ledger-1", lambda fence: done.append(f"b:{fence.token}") or fence)
            assert isinstance(row, Fence) and row.token == 2
        with pytest.raises(StaleToken):
            await afence("ledger-1", lambda fence: done.append("a"), a)
        return done

    assert run(main) == ["b:2"]
    assert Fence.objects.get(resource="ledger-1").token == 2


def test_cancelled_while_acquiring_the_granted_lease_is_released(monkeypatch: pytest.MonkeyPatch) -> None:
    granted = threading.Event()
    go = threading.Event()

    def hold_in_acquire(sender: Any, grant: Lease, **kwargs: Any) -> None:
        # Runs in the pool's thread after the grant committed: the worst moment.
        if grant.holder == "cancelled":
            granted.set()
            assert go.wait(DEADLINE)

    signals.lock_acquired.connect(hold_in_acquire)
    try:
        async def main() -> None:
            task = asyncio.create_task(locks.aacquire("job:c1", holder="cancelled", ttl=60))
            await wait_event(granted, "the grant")
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task   # at once: the cancelled caller does not wait for the thread
            go.set()
            await eventually(lambda: lock_is_free("job:c1"), "the abandoned lease's release")
            after = await locks.aacquire("job:c1", holder="next", ttl=5)
            assert after.token == 2
            await locks.arelease(after)

        run(main)
    finally:
        signals.lock_acquired.disconnect(hold_in_acquire)
    assert Grant.objects.get(token=1).end_reason == GrantEnd.RELEASED


def test_cancelled_while_holding_releases_before_the_cancellation_propagates() -> None:
    async def main() -> None:
        entered = asyncio.Event()

        async def job() -> None:
            async with locks.ahold("job:c2", holder="a", ttl=60):
                entered.set()
                await asyncio.Event().wait()   # forever, until cancelled

        task = asyncio.create_task(job())
        await entered.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await in_database(lambda: lock_is_free("job:c2"))
        assert locks.current_grant() is None

    run(main)


def test_a_timeout_around_ahold_releases_the_lock() -> None:
    async def main() -> None:
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(2), locks.ahold("job:c3", holder="a", ttl=60):
                await asyncio.sleep(60)
        # Released before the timeout propagated, or (had the timeout struck while
        # acquiring on a loaded machine) by the abandoned acquire's own release.
        await eventually(lambda: not Lock.objects.filter(key="job:c3").exclude(holder="").exists(),
                         "no holder of job:c3")

    run(main)


def test_cancelled_again_while_releasing_leaves_at_once_and_the_release_completes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    held = HeldRelease(monkeypatch)

    async def main() -> None:
        entered = asyncio.Event()

        async def job() -> None:
            async with locks.ahold("job:c4", holder="a", ttl=60):
                entered.set()
                await asyncio.Event().wait()

        task = asyncio.create_task(job())
        await entered.wait()
        task.cancel()                         # into the block: ahold starts releasing
        await wait_event(held.entered, "the release starting")
        task.cancel()                         # again, inside the release
        with pytest.raises(asyncio.CancelledError):
            await task                        # no hang although the release is stuck
        assert not await in_database(lambda: lock_is_free("job:c4"))
        held.go.set()
        await eventually(lambda: lock_is_free("job:c4"), "the release finishing")

    run(main)
    assert Grant.objects.get(lock__key="job:c4").end_reason == GrantEnd.RELEASED


def test_a_cancelled_arelease_still_releases(monkeypatch: pytest.MonkeyPatch) -> None:
    held = HeldRelease(monkeypatch)

    async def main() -> None:
        grant = await locks.aacquire("job:c5", holder="a", ttl=60)
        task = asyncio.create_task(locks.arelease(grant))
        await wait_event(held.entered, "the release starting")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        held.go.set()
        await eventually(lambda: lock_is_free("job:c5"), "the release finishing")

    run(main)


def test_async_keepalive_keeps_the_lease_and_marks_it_lost_when_revoked() -> None:
    ttl = 5.0  # the shortest lease the docs call safe with the keep-alive

    async def main() -> None:
        async with locks.ahold("job:k", holder="a", ttl=ttl, keepalive=True) as grant:
            await asyncio.sleep(ttl + 1)      # past the lease as first granted
            with pytest.raises(LockHeld):
                await locks.aacquire("job:k", holder="b", ttl=ttl)
            assert not grant.lost
        account = await in_database(lambda: AccountFactory())
        key = f"account:{account.pk}"
        with pytest.raises(LeaseLost):
            async with locks.ahold(key, holder="a", ttl=ttl, keepalive=True) as grant:
                await in_database(lambda: locks.revoke(key))
                loop = asyncio.get_running_loop()
                deadline = loop.time() + DEADLINE
                while not grant.lost:
                    assert loop.time() < deadline, "the keep-alive never noticed the revoke"
                    await asyncio.sleep(0.05)
                with pytest.raises(LeaseLost):
                    await Account.objects.filter(pk=account.pk).afenced_update(balance=Decimal(1))

    run(main)


def test_cancelled_while_waiting_or_before_a_thread_took_it_nothing_is_granted(settings: Any) -> None:
    settings.COORDINATION = {**getattr(settings, "COORDINATION", {}), "ASYNC_THREADS": 1}
    blocker = threading.Event()

    async def main() -> None:
        holder = await locks.aacquire("job:c6", holder="a", ttl=60)
        waiting = asyncio.create_task(locks.aacquire("job:c6", holder="waiter", ttl=60, wait=30))
        await asyncio.sleep(0.3)       # it has tried, been refused and sleeps in its back-off
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        await locks.arelease(holder)
        # The only thread busy: an acquire queued behind it is cancelled before it runs.
        busy = aio.submit(blocker.wait, DEADLINE)
        queued = asyncio.create_task(locks.aacquire("job:c7", holder="queued", ttl=60))
        await asyncio.sleep(0.1)
        queued.cancel()
        with pytest.raises(asyncio.CancelledError):
            await queued
        blocker.set()
        await asyncio.wrap_future(busy)
        await asyncio.sleep(0.2)

    try:
        run(main)
    finally:
        blocker.set()
    assert not Grant.objects.filter(holder__in=["waiter", "queued"]).exists()
    assert not Lock.objects.filter(key="job:c7").exists()
    assert Lock.objects.get(key="job:c6").holder == ""
