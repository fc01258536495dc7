"""The ``key=value`` fields of the app's log lines, quoted so no value can forge a field.

Every structured line the app logs ends in fields built here::

    logger.info("lock acquired %s", LogFields(key=key, token=token, holder=holder))
    # lock acquired key=job:7 token=42 holder="worker 3 reason=accepted"

A value made only of letters, digits and ``. _ : @ / + -`` is written bare
(keys, tokens, timestamps); anything else, and the empty string, is written as
a JSON string: double-quoted, with ``"``, ``\\`` and control characters
escaped (and every non-ASCII character too when the value holds one that is
not printable). So a client-chosen value (a holder, a detail that quotes one)
stays one field: ``holder="x reason=accepted key=other"`` is the holder, not
three fields, and a newline cannot start a forged line. ``None`` is ``-``.

The formatting is lazy: :class:`LogFields` renders when the record is
formatted, so a disabled level costs one small object.
"""

from __future__ import annotations

import json
import re
from typing import Any

__all__ = ["LogFields", "format_fields", "quote"]

_BARE = re.compile(r"[A-Za-z0-9._:@/+-]+")


def quote(value: object) -> str:
    """One field value as it appears after ``name=``."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "true" if value else "false"
    text = str(value)
    if _BARE.fullmatch(text):
        return text
    return json.dumps(text, ensure_ascii=not text.isprintable())


def format_fields(fields: dict[str, Any]) -> str:
    """``name=value`` pairs, separated by spaces, each value through :func:`quote`."""
    return " ".join(f"{name}={quote(value)}" for name, value in fields.items())


class LogFields:
    """Fields for a log call's ``%s``, rendered only if the record is emitted."""

    __slots__ = ("fields",)

    def __init__(self, **fields: Any) -> None:
        self.fields = fields

    def __str__(self) -> str:
        return format_fields(self.fields)

    def __repr__(self) -> str:
        return f"LogFields({self})"
