"""One grant at every downstream (rule 12 of docs/rules.md): a fenced task writes a
row, an object, a Redis key and records an outbox call; a paused holder of the
older token is refused by each store on its own, and every store keeps the
newer holder's data."""

from __future__ import annotations

import os
from decimal import Decimal

import pytest

from coordination import locks
from coordination.exceptions import StaleToken
from coordination.models import OutboxCall, Rejection
from coordination.stores.objects import FencedS3Storage
from coordination.stores.outbox import record_call
from project.demo.models import Account
from tests.support.factories import AccountFactory
from tests.support.waiting import wait_until_database_time_passes

redis = pytest.importorskip("redis")

pytestmark = pytest.mark.django_db(transaction=True)

URL = os.environ.get("COORDINATION_TEST_REDIS_URL", "")
PREFIX = os.environ.get("COORDINATION_TEST_REDIS_PREFIX", "")


def test_each_store_refuses_the_stale_token_on_its_own(s3_endpoint: str, bucket: str) -> None:
    if not URL:
        pytest.skip("a Redis server: COORDINATION_TEST_REDIS_URL is not set")
    from coordination.stores.redis import FencedRedis, fence_key

    account = AccountFactory(balance=Decimal("10.00"))
    key = f"account:{account.pk}"
    objects = FencedS3Storage(bucket_name=bucket, endpoint_url=s3_endpoint, access_key="test",
                              secret_key="test", region_name="us-east-1")
    client = redis.Redis.from_url(URL)
    cache = FencedRedis(client)
    cache_key = f"{PREFIX}stores-all-{account.pk}"

    def write_everything(lease: locks.Lease, value: str) -> None:
        Account.objects.filter(pk=account.pk).fenced_update(lease, balance=Decimal(value))
        objects.save_fenced(f"statements/{account.pk}.txt", value.encode(), grant=lease)
        cache.set(cache_key, value, grant=lease)
        record_call("http://127.0.0.1:9/ledger", {"balance": value}, grant=lease)

    try:
        paused = locks.acquire(key, holder="A", ttl=0.2)
        wait_until_database_time_passes(paused.expires_at)  # A pauses past its lease
        newer = locks.acquire(key, holder="B", ttl=30)
        write_everything(newer, "42.00")

        refused = 0
        for write in (
            lambda: Account.objects.filter(pk=account.pk).fenced_update(paused, balance=Decimal("1")),
            lambda: objects.save_fenced(f"statements/{account.pk}.txt", b"1", grant=paused),
            lambda: cache.set(cache_key, "1", grant=paused),
            lambda: record_call("http://127.0.0.1:9/ledger", {"balance": "1"}, grant=paused),
        ):
            with pytest.raises(StaleToken):
                write()
            refused += 1
        assert refused == 4
        assert Account.objects.get(pk=account.pk).balance == Decimal("42.00")
        with objects.open(f"statements/{account.pk}.txt") as file:
            assert file.read() == b"42.00"
        assert client.get(cache_key) == b"42.00"
        assert list(OutboxCall.objects.values_list("token", flat=True)) == [newer.token]
        assert set(Rejection.objects.values_list("token", flat=True)) == {paused.token}
    finally:
        client.delete(cache_key, fence_key(cache_key))
        client.close()
