"""Objects and Redis keys as chaos resources: written under the cycle's grant.

With an S3 endpoint (``--s3-endpoint``) every exclusive cycle also writes one
object per account through :class:`coordination.stores.objects.FencedS3Storage`
(``s3:<bucket>/chaos/<run>/account-<pk>``), and with a Redis URL
(``--redis-url``) one key through :class:`coordination.stores.redis.FencedRedis`
(``redis:coordination-chaos:<run>:account:<pk>``), both with the grant the
cycle wrote the account with. The history logs them as writes of those
resources, and after the run the controller reads what each store holds (the
object's metadata and body, the key's watermark hash and value) as their
``final`` events: the checker judges them like rows.

With fencing off (the negative control) the same writes are plain: a
``PUT`` without a precondition, a ``SET``, each leaving its own token beside
the value as a client that does not check one would.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

from .history import Event

__all__ = ["StoreWrites", "prepare_stores"]

Write = Callable[[Any, int, int], dict[str, Any]]


def prepare_stores(run: str, *, redis_url: str = "", s3_endpoint: str = "",
                   s3_bucket: str = "coordination-chaos") -> dict[str, Any]:
    """The stores part of the workers' configuration; creates the bucket and checks
    that each store answers (``RuntimeError`` if not)."""
    stores: dict[str, Any] = {}
    if redis_url:
        import redis

        try:
            redis.Redis.from_url(redis_url).ping()
        except redis.RedisError as error:
            raise RuntimeError(f"Redis at {redis_url} did not answer: {error}") from error
        stores["redis"] = {"url": redis_url, "prefix": f"coordination-chaos:{run}:"}
    if s3_endpoint:
        from botocore.exceptions import BotoCoreError, ClientError

        settings = {"endpoint": s3_endpoint, "bucket": s3_bucket, "prefix": f"chaos/{run}/"}
        client = _s3_client(settings)
        try:
            try:
                client.head_bucket(Bucket=s3_bucket)
            except ClientError:
                client.create_bucket(Bucket=s3_bucket)
        except (BotoCoreError, ClientError) as error:
            raise RuntimeError(f"the S3 endpoint {s3_endpoint} did not answer: {error}") from error
        stores["s3"] = settings
    return stores


def _region() -> str:
    return os.environ.get("AWS_DEFAULT_REGION") or os.environ.get("AWS_REGION") or "us-east-1"


def _s3_client(settings: dict[str, Any]) -> Any:
    import boto3

    return boto3.client("s3", endpoint_url=settings["endpoint"], region_name=_region())


class StoreWrites:
    """A worker's writes to the configured stores, fenced or (negative control) plain."""

    def __init__(self, stores: dict[str, Any], fencing: bool) -> None:
        self.config = stores
        self.fencing = fencing
        self._redis: Any = None
        self._fenced_redis: Any = None
        self._storage: Any = None

    def writers(self, pk: int) -> Iterator[tuple[str, Write]]:
        """(resource, write) for each configured store; ``write(grant, step, value)``."""
        if "s3" in self.config:
            storage = self.storage()
            name = self.object_name(pk)
            yield storage.resource(name), lambda grant, step, value: self.put_object(name, grant, step, value)
        if "redis" in self.config:
            key = self.redis_key(pk)
            yield f"redis:{key}", lambda grant, step, value: self.set_key(key, grant, step, value)

    # --- objects ------------------------------------------------------------------

    def object_name(self, pk: int) -> str:
        return f"{self.config['s3']['prefix']}account-{pk}"

    def storage(self) -> Any:
        if self._storage is None:
            from coordination.stores.objects import FencedS3Storage

            s3 = self.config["s3"]
            self._storage = FencedS3Storage(
                bucket_name=s3["bucket"], endpoint_url=s3["endpoint"], region_name=_region(),
            )
        return self._storage

    def put_object(self, name: str, grant: Any, step: int, value: int) -> dict[str, Any]:
        storage = self.storage()
        if self.fencing:
            storage.save_fenced(name, str(value).encode(), grant=grant, step=step)
            return {}
        from coordination.stores.objects import KEY, STEP, TOKEN

        storage._client.put_object(  # no precondition: whatever the object holds is replaced
            Bucket=storage.bucket_name, Key=storage._key(name), Body=str(value).encode(),
            Metadata={TOKEN: str(grant.token), STEP: str(step), KEY: grant.key},
        )
        return {}

    # --- Redis keys ---------------------------------------------------------------

    def redis_key(self, pk: int) -> str:
        return f"{self.config['redis']['prefix']}account:{pk}"

    def client(self) -> Any:
        if self._redis is None:
            import redis

            self._redis = redis.Redis.from_url(self.config["redis"]["url"])
        return self._redis

    def set_key(self, key: str, grant: Any, step: int, value: int) -> dict[str, Any]:
        if self.fencing:
            if self._fenced_redis is None:
                from coordination.stores.redis import FencedRedis

                self._fenced_redis = FencedRedis(self.client())
            self._fenced_redis.set(key, value, grant=grant, step=step)
            return {}
        from coordination.stores.redis import fence_key

        with self.client().pipeline(transaction=False) as pipe:  # no check: a plain SET
            pipe.set(key, value)
            pipe.hset(fence_key(key), mapping={"token": f"{grant.token:020d}",
                                               "step": f"{step:020d}", "lock": grant.key})
            pipe.execute()
        return {}

    # --- what the stores hold after the run -----------------------------------------

    def final_events(self, accounts: list[int]) -> Iterator[Event]:
        """One ``final`` event per object and key written (none for one never written)."""
        if "s3" in self.config:
            storage = self.storage()
            for pk in accounts:
                name = self.object_name(pk)
                mark = storage.watermark(name)
                if mark.etag is None:
                    continue
                body = storage._client.get_object(Bucket=storage.bucket_name, Key=storage._key(name))
                data = body["Body"].read().decode()
                yield {"type": "final", "resource": storage.resource(name), "token": mark.token,
                       "step": mark.step, "value": None if mark.deleted else int(data)}
        if "redis" in self.config:
            from coordination.stores.redis import fence_key

            client = self.client()
            for pk in accounts:
                key = self.redis_key(pk)
                token, step = client.hmget(fence_key(key), "token", "step")
                value = client.get(key)
                if token is None and value is None:
                    continue
                yield {"type": "final", "resource": f"redis:{key}", "token": int(token or 0),
                       "step": int(step or 0), "value": None if value is None else int(value)}

    def cleanup(self, accounts: list[int]) -> None:
        """Delete what the run wrote (its objects, its keys and their watermarks)."""
        if "s3" in self.config:
            storage = self.storage()
            for pk in accounts:
                storage._client.delete_object(Bucket=storage.bucket_name,
                                              Key=storage._key(self.object_name(pk)))
        if "redis" in self.config:
            from coordination.stores.redis import fence_key

            keys = [self.redis_key(pk) for pk in accounts]
            self.client().delete(*keys, *(fence_key(key) for key in keys))
