"""Fenced Redis writes on the suite's real Redis: FencedRedis and AsyncFencedRedis."""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from django.db import connections

from coordination.exceptions import DuplicateWrite, LeaseLost, StaleToken, WrongLock
from coordination.leases import use_grant
from coordination.models import Rejection, RejectionReason
from coordination.stores import StoreUnavailable
from coordination.stores.redis import AsyncFencedRedis, FencedRedis, client_of_cache, fence_key
from tests.db.stores.conftest import lease
from tests.support.reply_losing_proxy import reply_losing_proxy

redis = pytest.importorskip("redis")
NoBackoff = pytest.importorskip("redis.backoff").NoBackoff

pytestmark = pytest.mark.django_db(transaction=True)

URL = os.environ.get("COORDINATION_TEST_REDIS_URL", "")
PREFIX = os.environ.get("COORDINATION_TEST_REDIS_PREFIX", "")


@pytest.fixture
def client() -> Iterator[Any]:
    if not URL:
        pytest.skip("a Redis server: COORDINATION_TEST_REDIS_URL is not set")
    found = redis.Redis.from_url(URL)
    yield found
    keys = list(found.scan_iter(match=f"*{PREFIX}stores-*"))
    if keys:
        found.delete(*keys)
    found.close()


@pytest.fixture
def key() -> str:
    return f"{PREFIX}stores-{uuid.uuid4().hex[:10]}"


def test_stale_token_is_refused_and_the_newer_value_stays(client: Any, key: str) -> None:
    fenced = FencedRedis(client)
    assert fenced.set(key, "new", grant=lease("cache:1", 42)) == (0, 0)
    with pytest.raises(StaleToken) as caught:
        fenced.set(key, "old", grant=lease("cache:1", 41))
    assert caught.value.current_token == 42
    assert client.get(key) == b"new"
    assert fenced.watermark(key) == (42, 1)
    rejection = Rejection.objects.get()
    assert (rejection.reason, rejection.resource) == (RejectionReason.STALE, f"redis:{key}")
    assert (rejection.token, rejection.watermark_token, rejection.watermark_step) == (41, 42, 1)


def test_same_token_retry_and_next_step(client: Any, key: str) -> None:
    fenced = FencedRedis(client)
    grant = lease("cache:2", 5)
    with use_grant(grant):
        fenced.set(key, "one")  # step 1
        with pytest.raises(DuplicateWrite):
            fenced.set(key, "retry", step=1)
        assert client.get(key) == b"one"
        fenced.set(key, "two")  # step 2
    assert client.get(key) == b"two"
    assert fenced.watermark(key) == (5, 2)


def test_concurrent_writers_end_at_the_highest_token(client: Any, key: str) -> None:
    tokens = list(range(1, 17))
    barrier = threading.Barrier(len(tokens))
    stale: list[int] = []

    def write(token: int) -> None:
        own = FencedRedis(redis.Redis.from_url(URL))
        barrier.wait()
        try:
            own.hset(key, {"by": str(token), f"t{token}": "1"}, grant=lease("race", token))
        except StaleToken:
            stale.append(token)
        finally:
            own.client.close()
            connections.close_all()  # the refusal's record used this thread's connection

    threads = [threading.Thread(target=write, args=(token,)) for token in tokens]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert client.hget(key, "by") == b"16"
    assert FencedRedis(client).watermark(key) == (16, 1)
    assert 16 not in stale
    assert Rejection.objects.count() == len(stale)


def test_delete_keeps_the_watermark(client: Any, key: str) -> None:
    fenced = FencedRedis(client)
    fenced.hset(key, {"a": 1, "b": 2}, grant=lease("d", 3))
    fenced.hdel(key, "a", grant=lease("d", 4))
    assert client.hgetall(key) == {b"b": b"2"}
    fenced.delete(key, grant=lease("d", 6))
    assert not client.exists(key)
    with pytest.raises(StaleToken):
        fenced.set(key, "late", grant=lease("d", 5))
    assert not client.exists(key)
    fenced.set(key, "back", grant=lease("d", 7), px=60_000)
    assert client.get(key) == b"back" and 0 < client.pttl(key) <= 60_000
    assert client.ttl(fence_key(key)) == -1  # the watermark never expires


def test_tokens_compare_exactly_up_to_the_largest(client: Any, key: str) -> None:
    fenced = FencedRedis(client)
    fenced.set(key, "top", grant=lease("big", 2**63 - 1))
    with pytest.raises(StaleToken):  # 2**63 - 2 and 2**63 - 1 are one double
        fenced.set(key, "below", grant=lease("big", 2**63 - 2))
    assert fenced.watermark(key) == (2**63 - 1, 1)


def test_another_key_and_a_lost_lease_are_refused(client: Any, key: str) -> None:
    fenced = FencedRedis(client)
    fenced.set(key, "a", grant=lease("key:a", 1))
    with pytest.raises(WrongLock) as wrong:
        fenced.set(key, "b", grant=lease("key:b", 9))
    assert str(wrong.value) == f"redis:{key} is guarded by another lock than 'key:b'"
    lost = lease("key:a", 2)
    lost.mark_lost()
    with pytest.raises(LeaseLost):
        fenced.set(key, "c", grant=lost)
    assert client.get(key) == b"a"
    assert sorted(Rejection.objects.values_list("reason", flat=True)) == [
        RejectionReason.LEASE_LOST, RejectionReason.WRONG_LOCK,
    ]


def test_unreachable_redis_is_a_clear_error(client: Any, key: str) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    down = FencedRedis(redis.Redis(port=port, socket_connect_timeout=1))
    with pytest.raises(StoreUnavailable) as caught:
        down.set(key, "x", grant=lease("u", 1))
    assert caught.value.code == "store_unavailable"
    assert not client.exists(key) and not client.exists(fence_key(key))


def test_a_write_whose_reply_is_lost_applied_whole_and_its_retry_is_a_duplicate(
    client: Any, key: str
) -> None:
    """Redis applied the script, then the connection dropped before its answer: the
    caller gets ``StoreUnavailable`` (outcome unknown), the store holds the value
    with its watermark (one script: both or neither), a retry of the same step is
    refused as already stored, and a stale token stays refused."""
    from redis.retry import Retry

    address = redis.Redis.from_url(URL).connection_pool.connection_kwargs
    with reply_losing_proxy(address["host"], address["port"]) as proxy:
        db = address.get("db", 0)
        through = redis.Redis(port=proxy.port, db=db, retry=Retry(NoBackoff(), 0))
        fenced = FencedRedis(through)
        fenced.set(key, "old", grant=lease("lost", 5))  # the script is loaded now
        proxy.lose_reply_to(b"EVALSHA", key.encode())
        with pytest.raises(StoreUnavailable) as caught:
            fenced.set(key, "new", grant=lease("lost", 6))
        assert proxy.lost == 1 and caught.value.code == "store_unavailable"
        assert client.get(key) == b"new" and FencedRedis(client).watermark(key) == (6, 1)
        with pytest.raises(DuplicateWrite):
            FencedRedis(client).set(key, "new again", grant=lease("lost", 6), step=1)
        with pytest.raises(StaleToken):
            FencedRedis(client).set(key, "stale", grant=lease("lost", 5), step=2)
        assert client.get(key) == b"new"

        # With the client's own retries (redis-py's default), the retry finds it stored.
        retrying = FencedRedis(redis.Redis(port=proxy.port, db=db))
        proxy.lose_reply_to(b"EVALSHA", key.encode())
        with pytest.raises(DuplicateWrite):
            retrying.set(key, "newer", grant=lease("lost", 7))
        assert proxy.lost == 1
        assert client.get(key) == b"newer" and FencedRedis(client).watermark(key) == (7, 1)
        through.close()
        retrying.client.close()


def test_the_django_cache_client(client: Any, key: str, settings: Any) -> None:
    settings.CACHES = {**settings.CACHES, "fenced": {
        "BACKEND": "django.core.cache.backends.redis.RedisCache", "LOCATION": URL}}
    fenced = FencedRedis("fenced")
    fenced.set(key, "via cache", grant=lease("c", 1))
    assert client_of_cache("fenced").get(key) == b"via cache"
    with pytest.raises(TypeError, match=r"it is LocMemCache\): give CACHES\['default'\] the BACKEND"):
        client_of_cache("default")


def test_async_client(client: Any, key: str) -> None:
    from redis.asyncio import Redis as AsyncRedis

    async def scenario() -> None:
        own = AsyncRedis.from_url(URL)
        fenced = AsyncFencedRedis(own)
        await fenced.set(key, "new", grant=lease("a", 8))
        with pytest.raises(StaleToken):
            await fenced.set(key, "old", grant=lease("a", 7))
        await fenced.hset(key + "h", {"f": "v"}, grant=lease("a", 8))
        assert await fenced.watermark(key) == (8, 1)
        await own.aclose()

    asyncio.run(scenario())
    assert client.get(key) == b"new"
    assert Rejection.objects.get().reason == RejectionReason.STALE
