"""Same-token retries that return the stored result (rule 10 of docs/rules.md)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, TypeVar, cast

from django.db import connections, transaction

from .. import results
from ..backends import dialect_of
from ..conf import app_settings
from ..exceptions import InvalidInput
from ..models import IdempotencyRecord

T = TypeVar("T")


def idempotent(key: str, operation: Callable[[], T], *, using: str | None = None) -> T:
    """Run ``operation`` once for ``key``; a retry returns the stored result instead.

    For same-token retries (rule 10 of docs/rules.md): the operation and the stored result
    commit in one transaction, so either both happen or neither does. A
    concurrent retry waits for the first to finish, then gets its result.

    A retry gets the result back with the types the first call returned: it is
    stored as JSON, with ``Decimal``, ``datetime``, ``date``, ``time``,
    ``timedelta``, ``UUID`` and tuples tagged so that they decode as themselves
    (:mod:`coordination.results`), in lists and dicts at any depth. The first
    call returns the operation's result unchanged. A result that would come back
    as another type (any other class, a subclass such as an enum, a dict key
    that is not a string) or that JSON cannot hold (NaN, infinity, a string with
    NUL) raises :class:`InvalidInput` naming the value, and nothing is stored:
    the record and the operation's own database writes roll back together. An operation that
    raises stores nothing either, so it may be retried.
    """
    if not isinstance(key, str) or not key or len(key) > 255:
        raise InvalidInput("idempotency key must be 1 to 255 characters")
    alias = using or app_settings.DATABASE
    records = IdempotencyRecord.objects.using(alias)
    with transaction.atomic(using=alias):
        # Insert-or-nothing, then lock: a concurrent retry blocks on this row
        # until the first run commits, instead of running the operation again.
        dialect_of(connections[alias]).create_missing(records, [IdempotencyRecord(key=key)], "key")
        record = records.select_for_update().get(key=key)
        if record.completed:
            return cast(T, results.decode(record.result))
        result = operation()
        record.result, record.completed = _storable_result(key, result), True
        record.save(update_fields=["result", "completed"])
        return result


def _storable_result(key: str, result: object) -> Any:
    """``result`` as the JSON value to store, or InvalidInput naming what cannot be stored."""
    try:
        stored = results.encode(result, where=f"idempotent({key!r}): the result")
        text = json.dumps(stored, allow_nan=False)
    except RecursionError:  # a cycle
        raise InvalidInput(f"idempotent({key!r}): the result contains itself") from None
    # PostgreSQL's jsonb cannot hold U+0000; refused here rather than as a database
    # error. In the JSON text a NUL is the escape \\u0000; literal backslashes are
    # escaped as pairs, dropped first so that a string holding "\\u0000" passes.
    if "\\u0000" in text.replace("\\\\", ""):
        raise InvalidInput(f"idempotent({key!r}): the result contains a NUL character (\\u0000).")
    return stored
