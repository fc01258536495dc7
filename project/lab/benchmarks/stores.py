"""Fenced writes to the stores outside the database against plain ones.

One writer writes the same object (or key) again and again, a plain write and
a fenced one in turn, so that both see the same machine:

- S3: a plain ``PutObject`` against ``FencedS3Storage.save_fenced`` (a ``HEAD``
  for the ETag and the watermark, then a conditional ``PutObject``), on the
  endpoint given (``--s3-endpoint``) or on moto's S3 server, started here on a
  free port;
- Redis: a plain ``SET`` against ``FencedRedis.set`` (one ``EVALSHA``), on the
  bench's Redis.

Neither fenced write touches the database unless it is refused.
"""

from __future__ import annotations

import datetime as dt
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from .common import BenchConfig, _percentile_ms

# moto's S3 server on a free port, which it prints; threaded as a real server is.
_MOTO = (
    "from moto.server import DomainDispatcherApplication, create_backend_app\n"
    "from werkzeug.serving import make_server\n"
    "s = make_server('127.0.0.1', 0, DomainDispatcherApplication(create_backend_app), threaded=True)\n"
    "print(s.port, flush=True)\n"
    "s.serve_forever()\n"
)


def stores_suite(config: BenchConfig, progress: Callable[[str], None]) -> dict[str, Any]:
    """p50 and p90 of a plain and a fenced write to each store, and their ratio."""
    result: dict[str, Any] = {"writes": config.store_writes}
    progress(f"stores: S3 object, {config.store_writes} plain and fenced writes")
    try:
        with _s3_endpoint(config.s3_endpoint) as endpoint:
            result["s3"] = _summary(*_bench_s3(endpoint, config.store_writes))
    except _Unavailable as missing:
        result["s3"] = {"skipped": str(missing)}
    progress(f"stores: Redis key, {config.store_writes} plain and fenced writes")
    if not config.redis_url:
        result["redis"] = {"skipped": "no Redis (--redis-url)"}
    else:
        try:
            result["redis"] = _summary(*_bench_redis(config.redis_url, config.store_writes))
        except _Unavailable as missing:
            result["redis"] = {"skipped": str(missing)}
    return result


class _Unavailable(Exception):
    """What a store's part needs is not installed."""


def _summary(plain: list[float], fenced: list[float]) -> dict[str, Any]:
    plain.sort()
    fenced.sort()
    plain_p50 = _percentile_ms(plain, 0.5) or 0.0
    fenced_p50 = _percentile_ms(fenced, 0.5) or 0.0
    return {
        "plain_p50_ms": plain_p50, "plain_p90_ms": _percentile_ms(plain, 0.9),
        "fenced_p50_ms": fenced_p50, "fenced_p90_ms": _percentile_ms(fenced, 0.9),
        "fenced_over_plain": round(fenced_p50 / plain_p50, 3) if plain_p50 else None,
    }


def _timed(
    count: int, plain: Callable[[int], Any], fenced: Callable[[int], Any]
) -> tuple[list[float], list[float]]:
    plain_times: list[float] = []
    fenced_times: list[float] = []
    for number in range(count):
        for write, times in ((plain, plain_times), (fenced, fenced_times)):
            began = time.perf_counter()
            write(number)
            times.append(time.perf_counter() - began)
    return plain_times, fenced_times


def _lease(key: str) -> Any:
    """A grant the stores check: they compare its token with their watermark only."""
    from coordination.leases import Lease

    now = dt.datetime.now(dt.UTC)
    return Lease(key=key, token=1, lease_id="bench", holder="bench", acquired_at=now,
                 expires_at=now + dt.timedelta(hours=1))


@contextmanager
def _s3_endpoint(given: str | None) -> Iterator[str]:
    if given:
        yield given
        return
    try:
        import moto  # noqa: F401
    except ImportError:
        raise _Unavailable("no --s3-endpoint and no moto to serve one (requirements/s3.txt)") from None
    env = {**os.environ, "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test"}
    server = subprocess.Popen([sys.executable, "-c", _MOTO], stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        assert server.stdout is not None
        yield f"http://127.0.0.1:{int(server.stdout.readline())}"
    finally:
        server.kill()
        server.wait(30)


def _bench_s3(endpoint: str, count: int) -> tuple[list[float], list[float]]:
    try:
        import boto3

        from coordination.stores.objects import FencedS3Storage
    except ImportError:
        raise _Unavailable("boto3 and django-storages are not installed (the [s3] extra)") from None
    bucket = f"bench-{uuid.uuid4().hex[:8]}"
    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                          aws_access_key_id="test", aws_secret_access_key="test")
    client.create_bucket(Bucket=bucket)
    store = FencedS3Storage(bucket_name=bucket, endpoint_url=endpoint, access_key="test",
                            secret_key="test", region_name="us-east-1")
    grant = _lease("bench:s3")
    body = b"x" * 1024
    for _ in range(10):  # both connections warm
        client.put_object(Bucket=bucket, Key="plain.bin", Body=body)
        store.save_fenced("fenced.bin", body, grant=grant)
    return _timed(
        count,
        lambda n: client.put_object(Bucket=bucket, Key="plain.bin", Body=body),
        lambda n: store.save_fenced("fenced.bin", body, grant=grant),
    )


def _bench_redis(url: str, count: int) -> tuple[list[float], list[float]]:
    try:
        import redis

        from coordination.stores.redis import FencedRedis, fence_key
    except ImportError:
        raise _Unavailable("redis-py is not installed (the [redis] extra)") from None
    client = redis.Redis.from_url(url)
    fenced = FencedRedis(client)
    prefix = f"{os.environ.get('COORDINATION_TEST_REDIS_PREFIX', '')}bench-{uuid.uuid4().hex[:8]}"
    grant = _lease("bench:redis")
    try:
        for _ in range(10):
            client.set(f"{prefix}:plain", "v")
            fenced.set(f"{prefix}:fenced", "v", grant=grant)
        return _timed(
            count,
            lambda n: client.set(f"{prefix}:plain", f"v{n}"),
            lambda n: fenced.set(f"{prefix}:fenced", f"v{n}", grant=grant),
        )
    finally:
        client.delete(f"{prefix}:plain", f"{prefix}:fenced", fence_key(f"{prefix}:fenced"))
