"""Fences beyond the database: stores that refuse a stale token themselves.

- :mod:`.objects`: a Django ``Storage`` over django-storages' S3 backend whose
  writes and deletes are conditional requests carrying the grant's token
  (extra ``[s3]``);
- :mod:`.redis`: fenced ``SET``, ``DEL`` and ``HSET`` of a Redis key, one
  server-side script each (extra ``[redis]``);
- :mod:`.outbox`: calls that cannot check a token (an HTTP request, an
  email), recorded under a fence and sent by one relay with a stable
  idempotency key.

Each store checks the same ``(token, step)`` rule as a fenced row (rule 4 of
docs/rules.md) and records a refusal as a :class:`~coordination.models.Rejection`.
Nothing here is imported by the rest of the app: a site that uses none of it
needs none of the extras.
"""

from .errors import StoreUnavailable

__all__ = ["StoreUnavailable"]
