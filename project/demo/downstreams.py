"""The demo's other downstreams: an S3 object, a Redis key and an outbox call,
written by the ``deposit`` task with the same grant as the account's row.

Each store checks the token on its own (rule 12 of docs/rules.md): the object
through :class:`coordination.stores.objects.FencedS3Storage` (one conditional
``PUT``), the key through :class:`coordination.stores.redis.FencedRedis` (one
script), the call through :func:`coordination.stores.outbox.record_call` (a
fenced insert; the demo starts no relay, so the call is recorded, not sent).
The object and the key are written only where their store is configured
(``coordination_demo --s3-endpoint``, ``--redis-url``); the outbox needs only
the database, so it is on everywhere, the embedded SQLite default included.

With fencing off the same writes are plain: a ``PUT`` without a precondition,
a ``SET``, an ``OutboxCall`` row created directly.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable, Iterator
from typing import Any

from coordination.exceptions import CoordinationError
from coordination.leases import Lease

__all__ = ["OUTBOX_TARGET", "STORES", "Downstreams"]

STORES = ("object", "redis", "outbox")
OUTBOX_TARGET = "https://ledger.example.invalid/deposits"


def _region() -> str:
    return os.environ.get("AWS_DEFAULT_REGION") or os.environ.get("AWS_REGION") or "us-east-1"


class Downstreams:
    """The stores of one demo run: ``config`` is ``{"s3": {"endpoint", "bucket"},
    "redis_url": ..., "run": ...}`` (each optional). The object's and the key's
    names carry the ``run``: a Redis or a bucket outlives the database whose
    tokens wrote it (a new database starts its tokens again), so each run
    writes names of its own."""

    def __init__(self, config: dict[str, Any], account_id: int) -> None:
        self.config = config
        self.account_id = account_id

    def enabled(self) -> list[str]:
        return [store for store in STORES
                if store == "outbox" or (store == "object" and self.config.get("s3"))
                or (store == "redis" and self.config.get("redis_url"))]

    # --- names -------------------------------------------------------------------

    @property
    def object_name(self) -> str:
        return f"statements/{self.run}/account-{self.account_id}.txt"

    @property
    def redis_key(self) -> str:
        return f"coordination-demo:{self.run}:account:{self.account_id}:balance"

    @property
    def run(self) -> str:
        return str(self.config.get("run") or "run")

    @property
    def outbox_resource(self) -> str:
        return f"outbox:account:{self.account_id}"

    def where(self, store: str) -> str:
        if store == "object":
            return f"s3://{self.config['s3']['bucket']}/{self.object_name}"
        if store == "redis":
            return f"Redis key {self.redis_key}"
        return f"outbox call to {OUTBOX_TARGET}"

    # --- clients -------------------------------------------------------------------

    def storage(self) -> Any:
        from coordination.stores.objects import FencedS3Storage

        s3 = self.config["s3"]
        return FencedS3Storage(bucket_name=s3["bucket"], endpoint_url=s3["endpoint"],
                               region_name=_region())

    def redis(self) -> Any:
        import redis

        return redis.Redis.from_url(self.config["redis_url"])

    def create_bucket(self) -> None:
        """Make sure the bucket exists (the command, before the workers start)."""
        if not self.config.get("s3"):
            return
        from botocore.exceptions import ClientError

        client = self.storage()._client
        bucket = self.config["s3"]["bucket"]
        try:
            client.head_bucket(Bucket=bucket)
        except ClientError:
            client.create_bucket(Bucket=bucket)

    # --- the task's writes ---------------------------------------------------------------

    def write_all(self, grant: Lease, balance: str, *, fencing: bool) -> dict[str, dict[str, str]]:
        """Write ``balance`` to every enabled store with ``grant``; what each said."""
        outcomes: dict[str, dict[str, str]] = {}
        for store, write in self._writes(grant, balance, fencing):
            try:
                write()
            except CoordinationError as refused:
                outcomes[store] = {"outcome": "rejected", "code": refused.code}
            else:
                outcomes[store] = {"outcome": "written"}
        return outcomes

    def _writes(self, grant: Lease, balance: str, fencing: bool) -> Iterator[tuple[str, Callable[[], Any]]]:
        enabled = self.enabled()
        if "object" in enabled:
            yield "object", lambda: self._put_object(grant, balance, fencing)
        if "redis" in enabled:
            yield "redis", lambda: self._set_key(grant, balance, fencing)
        yield "outbox", lambda: self._record_call(grant, balance, fencing)

    def _put_object(self, grant: Lease, balance: str, fencing: bool) -> None:
        storage = self.storage()
        if fencing:
            storage.save_fenced(self.object_name, balance.encode(), grant=grant)
        else:  # no precondition: whatever the object holds is replaced
            storage._client.put_object(Bucket=storage.bucket_name, Key=storage._key(self.object_name),
                                       Body=balance.encode())

    def _set_key(self, grant: Lease, balance: str, fencing: bool) -> None:
        client = self.redis()
        if fencing:
            from coordination.stores.redis import FencedRedis

            FencedRedis(client).set(self.redis_key, balance, grant=grant)
        else:
            client.set(self.redis_key, balance)

    def _record_call(self, grant: Lease, balance: str, fencing: bool) -> None:
        payload = {"account": self.account_id, "balance": balance}
        if fencing:
            from coordination.stores.outbox import record_call

            record_call(OUTBOX_TARGET, payload, grant=grant, resource=self.outbox_resource)
            return
        from coordination.models import OutboxCall

        OutboxCall.objects.create(
            target=OUTBOX_TARGET, payload=payload, idempotency_key=secrets.token_hex(16),
            resource=self.outbox_resource, lock_key=grant.key, token=grant.token,
            step=grant.next_step(),
        )

    # --- what the stores hold after the run ------------------------------------------------

    def final(self) -> dict[str, Any]:
        """Per enabled store, what it holds: the object's body, the key's value, and
        the balances of the outbox calls recorded (with their tokens)."""
        held: dict[str, Any] = {}
        enabled = self.enabled()
        if "object" in enabled:
            storage = self.storage()
            found = storage._client.get_object(Bucket=storage.bucket_name, Key=storage._key(self.object_name))
            held["object"] = found["Body"].read().decode()
        if "redis" in enabled:
            value = self.redis().get(self.redis_key)
            held["redis"] = None if value is None else value.decode()
        from coordination.models import OutboxCall

        calls = OutboxCall.objects.filter(resource=self.outbox_resource).order_by("id")
        held["outbox"] = [{"token": call.token, "balance": call.payload.get("balance")} for call in calls]
        return held

    def cleanup(self) -> None:
        """Delete the object and the key (and its watermark); the outbox rows stay,
        like the account and its grants, for the admin."""
        enabled = self.enabled()
        if "object" in enabled:
            storage = self.storage()
            storage._client.delete_object(Bucket=storage.bucket_name, Key=storage._key(self.object_name))
        if "redis" in enabled:
            from coordination.stores.redis import fence_key

            self.redis().delete(self.redis_key, fence_key(self.redis_key))
