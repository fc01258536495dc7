"""Fenced Redis writes: ``SET``, ``DEL``, ``HSET`` and ``HDEL`` of a key under a token.

Each write is one Lua script, which Redis runs atomically: it reads the key's
watermark, refuses a (token, step) not above it (rule 4 of docs/rules.md) or
of another lock key (rule 7), and otherwise raises the watermark and writes
the value, with no other command in between. The watermark lives beside the
value in a companion hash, ``{<key>}:coordination-fence`` (fields ``token``,
``step``, ``lock``), in the same cluster slot as the key. It has no TTL and a
fenced ``DEL`` keeps it: the watermark outlives the value, so a paused holder
cannot write the key again after a newer holder deleted it.

:class:`FencedRedis` takes a ``redis.Redis`` client, or a Django cache alias
(:func:`client_of_cache`: Django's own ``RedisCache`` or django-redis).
:class:`AsyncFencedRedis` takes a ``redis.asyncio.Redis``. Values are written
as given (bytes, str, int, float), not through the cache's serializer.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NoReturn

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from .. import aio
from ..conf import app_settings
from ..exceptions import CoordinationError, DuplicateWrite, LeaseLost, StaleToken, WrongLock
from ..fenced.grants import resolve_grant, resolve_step
from ..fenced.rejections import record_rejection
from ..leases import Lease
from ..models import RejectionReason
from .errors import StoreUnavailable

__all__ = ["AsyncFencedRedis", "FencedRedis", "client_of_cache", "fence_key"]

FENCE_SUFFIX = ":coordination-fence"

# Tokens and steps go up to 2**63 - 1, past a Lua number's exact integers (2**53):
# they are kept as 20-digit strings, which compare as the numbers do.
SCRIPT = """
local function below(a, b)  -- a < b, both 20-digit strings
  for i = 1, 20 do
    local x, y = string.byte(a, i), string.byte(b, i)
    if x ~= y then return x < y end
  end
  return false
end
local zero = '00000000000000000000'
local mark = redis.call('HMGET', KEYS[2], 'token', 'step', 'lock')
local token, step = mark[1] or zero, mark[2] or zero
if mark[3] and mark[3] ~= ARGV[1] then return {'wrong_lock', token, step} end
if below(ARGV[2], token) then return {'stale_token', token, step} end
if ARGV[2] == token and not below(step, ARGV[3]) then return {'duplicate_write', token, step} end
redis.call('HSET', KEYS[2], 'token', ARGV[2], 'step', ARGV[3], 'lock', ARGV[1])
local op = ARGV[4]
if op == 'set' then
  if ARGV[6] ~= '' then
    redis.call('SET', KEYS[1], ARGV[5], 'PX', ARGV[6])
  else
    redis.call('SET', KEYS[1], ARGV[5])
  end
elseif op == 'del' then
  redis.call('DEL', KEYS[1])
elseif op == 'hset' then
  redis.call('HSET', KEYS[1], unpack(ARGV, 5))
elseif op == 'hdel' then
  redis.call('HDEL', KEYS[1], unpack(ARGV, 5))
end
return {'ok', token, step}
"""

_REASONS = {
    "stale_token": RejectionReason.STALE,
    "duplicate_write": RejectionReason.DUPLICATE,
    "wrong_lock": RejectionReason.WRONG_LOCK,
}


def fence_key(key: str) -> str:
    """The companion hash that keeps ``key``'s watermark, in the same cluster slot:
    ``{key}:coordination-fence``, or ``key:coordination-fence`` when ``key`` already
    has a hash tag."""
    opening = key.find("{")
    if opening != -1 and key.find("}", opening + 2) != -1:
        return key + FENCE_SUFFIX
    return "{" + key + "}" + FENCE_SUFFIX


def client_of_cache(alias: str = "default") -> Any:
    """The ``redis.Redis`` client (for writes) of the Django cache ``alias``: Django's
    ``RedisCache`` or django-redis's ``RedisCache``."""
    from django.core.cache import caches

    cache: Any = caches[alias]
    if hasattr(cache, "_cache") and hasattr(cache._cache, "get_client"):  # django.core.cache
        return cache._cache.get_client(None, write=True)
    if hasattr(cache, "client") and hasattr(cache.client, "get_client"):  # django-redis
        return cache.client.get_client(write=True)
    raise TypeError(
        f"the cache {alias!r} is not a Redis cache (it is {type(cache).__name__}): give "
        f"CACHES[{alias!r}] the BACKEND django.core.cache.backends.redis.RedisCache (or "
        "django-redis's), or pass FencedRedis a redis.Redis client"
    )


class _Fenced:
    """What the sync and async clients share: the script's arguments and the refusals."""

    def __init__(self, using: str | None) -> None:
        self.using = using

    def _prepare(
        self, key: str, grant: Lease | None, step: int | None, op: str, values: list[Any]
    ) -> tuple[Lease, int, list[str], list[Any]]:
        lease = resolve_grant(grant)
        number = resolve_step(lease, step)
        return lease, number, [key, fence_key(key)], [
            lease.key, f"{lease.token:020d}", f"{number:020d}", op, *values,
        ]

    def _outcome(self, key: str, lease: Lease, number: int, reply: list[Any]) -> tuple[int, int]:
        """The watermark before the write, or the refusal raised (and recorded)."""
        status, token, step = (_text(part) for part in reply)
        watermark = (int(token), int(step))
        if status == "ok":
            return watermark
        resource = f"redis:{key}"
        error: CoordinationError
        if status == "stale_token":
            error = StaleToken(resource, lease.token, *watermark)
        elif status == "duplicate_write":
            error = DuplicateWrite(resource, lease.token, number, watermark[1])
        else:
            error = WrongLock(f"{resource} is guarded by another lock than {lease.key!r}")
        self._refuse(key, lease, number, error, _REASONS[status], watermark)

    def _refuse(
        self, key: str, lease: Lease, number: int, error: CoordinationError,
        reason: RejectionReason, watermark: tuple[int, int] | None,
    ) -> NoReturn:
        record_rejection(resource=f"redis:{key}", grant=lease, step=number, reason=reason,
                         watermark=watermark, using=self.using or app_settings.DATABASE)
        raise error


class FencedRedis(_Fenced):
    """Fenced writes of Redis keys through ``client`` (a ``redis.Redis``, or a Django
    cache alias: :func:`client_of_cache`).

    Each method writes with ``grant`` (default: the current grant) and ``step``
    (default: the lease's next) and returns the key's watermark before the write;
    a refusal raises ``StaleToken``, ``DuplicateWrite``, ``WrongLock`` or
    ``LeaseLost`` and is recorded as a Rejection (resource ``redis:<key>``);
    Redis unreachable raises ``StoreUnavailable``.
    """

    def __init__(self, client: Any, *, using: str | None = None) -> None:
        super().__init__(using)
        self.client = client_of_cache(client) if isinstance(client, str) else client
        self._script = self.client.register_script(SCRIPT)

    def _run(self, key: str, grant: Lease | None, step: int | None, op: str,
             values: list[Any]) -> tuple[int, int]:
        lease, number, keys, args = self._prepare(key, grant, step, op, values)
        if lease.lost:
            self._refuse(key, lease, number, LeaseLost(), RejectionReason.LEASE_LOST, None)
        try:
            reply = self._script(keys=keys, args=args)
        except (RedisConnectionError, RedisTimeoutError) as error:
            raise StoreUnavailable(f"redis:{key}", str(error)) from error
        return self._outcome(key, lease, number, reply)

    def set(self, key: str, value: Any, *, grant: Lease | None = None, step: int | None = None,
            px: int | None = None) -> tuple[int, int]:
        """``SET key value [PX px]`` under the fence (the watermark never expires)."""
        return self._run(key, grant, step, "set", [value, "" if px is None else int(px)])

    def delete(self, key: str, *, grant: Lease | None = None, step: int | None = None) -> tuple[int, int]:
        """``DEL key`` under the fence; the watermark stays."""
        return self._run(key, grant, step, "del", [])

    def hset(self, key: str, mapping: Mapping[str, Any], *, grant: Lease | None = None,
             step: int | None = None) -> tuple[int, int]:
        """``HSET key field value ...`` under the fence."""
        return self._run(key, grant, step, "hset", _pairs(mapping))

    def hdel(self, key: str, *fields: str, grant: Lease | None = None,
             step: int | None = None) -> tuple[int, int]:
        """``HDEL key field ...`` under the fence."""
        return self._run(key, grant, step, "hdel", list(fields))

    def watermark(self, key: str) -> tuple[int, int]:
        """The (token, step) of the key's last fenced write ((0, 0): none)."""
        token, step = self.client.hmget(fence_key(key), "token", "step")
        return int(token or 0), int(step or 0)


class AsyncFencedRedis(_Fenced):
    """:class:`FencedRedis` for a ``redis.asyncio.Redis`` client: the same methods, awaited."""

    def __init__(self, client: Any, *, using: str | None = None) -> None:
        super().__init__(using)
        self.client = client
        self._script = client.register_script(SCRIPT)

    async def _run(self, key: str, grant: Lease | None, step: int | None, op: str,
                   values: list[Any]) -> tuple[int, int]:
        lease, number, keys, args = self._prepare(key, grant, step, op, values)
        if lease.lost:
            await aio.run_sync(
                self._refuse, key, lease, number, LeaseLost(), RejectionReason.LEASE_LOST, None
            )
        try:
            reply = await self._script(keys=keys, args=args)
        except (RedisConnectionError, RedisTimeoutError) as error:
            raise StoreUnavailable(f"redis:{key}", str(error)) from error
        if _text(reply[0]) == "ok":
            return int(reply[1]), int(reply[2])
        # A refusal is recorded in the database: off the event loop.
        return await aio.run_sync(self._outcome, key, lease, number, reply)

    async def set(self, key: str, value: Any, *, grant: Lease | None = None,
                  step: int | None = None, px: int | None = None) -> tuple[int, int]:
        return await self._run(key, grant, step, "set", [value, "" if px is None else int(px)])

    async def delete(self, key: str, *, grant: Lease | None = None,
                     step: int | None = None) -> tuple[int, int]:
        return await self._run(key, grant, step, "del", [])

    async def hset(self, key: str, mapping: Mapping[str, Any], *, grant: Lease | None = None,
                   step: int | None = None) -> tuple[int, int]:
        return await self._run(key, grant, step, "hset", _pairs(mapping))

    async def hdel(self, key: str, *fields: str, grant: Lease | None = None,
                   step: int | None = None) -> tuple[int, int]:
        return await self._run(key, grant, step, "hdel", list(fields))

    async def watermark(self, key: str) -> tuple[int, int]:
        token, step = await self.client.hmget(fence_key(key), "token", "step")
        return int(token or 0), int(step or 0)


def _pairs(mapping: Mapping[str, Any]) -> list[Any]:
    if not mapping:
        raise ValueError("hset() needs at least one field")
    return [part for pair in mapping.items() for part in pair]


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
