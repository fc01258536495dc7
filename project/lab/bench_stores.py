"""The cost of a fenced write to an object store and to Redis, against a plain one.

``python -m project.lab.bench_stores [--writes 300] [--s3 URL] [--redis URL]``

One process, one writer, the same object or key written again and again, the
two kinds of write interleaved so that both see the same machine. Without
``--s3`` it starts moto's S3 server (a subprocess on a free port); without
``--redis`` it uses ``COORDINATION_TEST_REDIS_URL`` or redis://127.0.0.1:6379/0.
Prints p50 and p90 in milliseconds, side by side:

- S3: a plain ``PutObject`` against ``FencedS3Storage.save_fenced`` (a ``HEAD``
  for the ETag and watermark, then a conditional ``PutObject``);
- Redis: a plain ``SET`` against ``FencedRedis.set`` (one ``EVALSHA``).

Neither fenced write touches the database unless it is refused.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any

_MOTO = (
    "from moto.server import DomainDispatcherApplication, create_backend_app\n"
    "from werkzeug.serving import make_server\n"
    "s = make_server('127.0.0.1', 0, DomainDispatcherApplication(create_backend_app), threaded=True)\n"
    "print(s.port, flush=True)\n"
    "s.serve_forever()\n"
)


def _setup_django() -> None:
    import django
    from django.conf import settings

    if not settings.configured:
        settings.configure(
            INSTALLED_APPS=["django.contrib.contenttypes", "django.contrib.auth", "coordination"],
            DATABASES={"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}},
            USE_TZ=True,
        )
    django.setup()


def _percentiles(samples: list[float]) -> tuple[float, float]:
    ordered = sorted(samples)
    return statistics.median(ordered) * 1000, ordered[int(len(ordered) * 0.9)] * 1000


def _timed(
    count: int, plain: Callable[[int], Any], fenced: Callable[[int], Any]
) -> tuple[list[float], list[float]]:
    plain_times: list[float] = []
    fenced_times: list[float] = []
    for number in range(count):
        for run, times in ((plain, plain_times), (fenced, fenced_times)):
            start = time.perf_counter()
            run(number)
            times.append(time.perf_counter() - start)
    return plain_times, fenced_times


def _lease(key: str, token: int) -> Any:
    from coordination.leases import Lease

    now = dt.datetime.now(dt.UTC)
    return Lease(key=key, token=token, lease_id="bench", holder="bench", acquired_at=now,
                 expires_at=now + dt.timedelta(hours=1))


def bench_s3(endpoint: str, count: int) -> tuple[list[float], list[float]]:
    import boto3

    from coordination.stores.objects import FencedS3Storage

    bucket = f"bench-{uuid.uuid4().hex[:8]}"
    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                          aws_access_key_id="test", aws_secret_access_key="test")
    client.create_bucket(Bucket=bucket)
    store = FencedS3Storage(bucket_name=bucket, endpoint_url=endpoint, access_key="test",
                            secret_key="test", region_name="us-east-1")
    grant = _lease("bench:s3", 1)
    body = b"x" * 1024
    for _ in range(10):  # warm both connections up
        client.put_object(Bucket=bucket, Key="plain.bin", Body=body)
        store.save_fenced("fenced.bin", body, grant=grant)
    return _timed(
        count,
        lambda n: client.put_object(Bucket=bucket, Key="plain.bin", Body=body),
        lambda n: store.save_fenced("fenced.bin", body, grant=grant),
    )


def bench_redis(url: str, count: int) -> tuple[list[float], list[float]]:
    import redis

    from coordination.stores.redis import FencedRedis, fence_key

    client = redis.Redis.from_url(url)
    fenced = FencedRedis(client)
    prefix = f"{os.environ.get('COORDINATION_TEST_REDIS_PREFIX', '')}bench-{uuid.uuid4().hex[:8]}"
    grant = _lease("bench:redis", 1)
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--writes", type=int, default=300)
    parser.add_argument("--s3", help="an S3 endpoint URL (default: start moto's server)")
    parser.add_argument("--redis", default=os.environ.get("COORDINATION_TEST_REDIS_URL",
                                                          "redis://127.0.0.1:6379/0"))
    args = parser.parse_args(argv)
    _setup_django()
    server = None
    endpoint = args.s3
    if endpoint is None:
        env = {**os.environ, "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test"}
        server = subprocess.Popen([sys.executable, "-c", _MOTO], stdout=subprocess.PIPE,
                                  stderr=subprocess.DEVNULL, text=True, env=env)
        assert server.stdout is not None
        endpoint = f"http://127.0.0.1:{int(server.stdout.readline())}"
    try:
        rows = [("S3 object (1 KiB)", *bench_s3(endpoint, args.writes)),
                ("Redis key", *bench_redis(args.redis, args.writes))]
    finally:
        if server is not None:
            server.kill()
            server.wait(30)
    print(f"{args.writes} writes each, p50 / p90 in ms")
    print(f"{'store':<20}{'plain p50':>10}{'fenced p50':>12}{'ratio':>7}{'plain p90':>11}{'fenced p90':>12}")
    for name, plain, fenced in rows:
        plain_p50, plain_p90 = _percentiles(plain)
        fenced_p50, fenced_p90 = _percentiles(fenced)
        print(f"{name:<20}{plain_p50:>10.3f}{fenced_p50:>12.3f}{fenced_p50 / plain_p50:>7.2f}"
              f"{plain_p90:>11.3f}{fenced_p90:>12.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
