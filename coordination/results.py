"""Stored results of idempotent operations: JSON that decodes to the types it was made from.

:func:`~coordination.fencing.idempotent` stores an operation's result in a JSON
column and hands it back to a retry. A plain JSON round trip would turn a
``Decimal`` into a string and a tuple into a list, so a retry would see another
type than the first call. Values JSON has no type for are stored tagged, in the
form kombu (Celery's serializer) uses, ``{"__type__": "decimal", "__value__":
"12.50"}``, and decoded back to their type. A dict that has a ``"__type__"`` key
of its own is wrapped, so data never reads as a tag.

A value of any other type (or a subclass of one of these: an enum, an
``OrderedDict``, a lazy translation string) is refused with
:class:`~coordination.exceptions.InvalidInput` naming where it is, rather than
stored as something a retry would get back as another type.
"""

from __future__ import annotations

import datetime as dt
import math
import uuid
from collections.abc import Callable
from decimal import Decimal
from typing import Any

from .exceptions import InvalidInput

__all__ = ["STORABLE_TYPES", "decode", "encode"]

TYPE, VALUE = "__type__", "__value__"

_TIMEDELTA_PARTS = ("days", "seconds", "microseconds")

# Type -> (tag, to JSON, from JSON). Looked up by exact type: a subclass would not
# come back as itself.
_TAGGED: dict[type, tuple[str, Callable[[Any], Any], Callable[[Any], Any]]] = {
    Decimal: ("decimal", str, Decimal),
    dt.datetime: ("datetime", dt.datetime.isoformat, dt.datetime.fromisoformat),
    dt.date: ("date", dt.date.isoformat, dt.date.fromisoformat),
    dt.time: ("time", dt.time.isoformat, dt.time.fromisoformat),
    dt.timedelta: (
        "timedelta",
        lambda value: [getattr(value, part) for part in _TIMEDELTA_PARTS],
        lambda parts: dt.timedelta(*parts),
    ),
    uuid.UUID: ("uuid", str, uuid.UUID),
}
_DECODERS = {tag: decoder for tag, _, decoder in _TAGGED.values()}
_PLAIN = (str, int, bool, type(None))

STORABLE_TYPES = (*_PLAIN, float, dict, list, tuple, *_TAGGED)
"""What a stored result may hold, at any depth (dict keys are strings)."""


def encode(value: Any, where: str = "the result") -> Any:
    """``value`` as JSON values, tagged where JSON has no type for it.

    Raises InvalidInput naming ``where`` the first value that cannot come back
    as itself: another type, a dict key that is not a string, NaN or infinity.
    """
    kind = type(value)
    if kind in _PLAIN:
        return value
    if kind is float:
        if not math.isfinite(value):
            raise InvalidInput(f"{where} is {value!r}: JSON has no NaN or infinity")
        return value
    if kind is list:
        return [encode(item, f"{where}[{index}]") for index, item in enumerate(value)]
    if kind is tuple:
        return {TYPE: "tuple", VALUE: [encode(item, f"{where}[{index}]") for index, item in enumerate(value)]}
    if kind is dict:
        items = {}
        for key, item in value.items():
            if type(key) is not str:
                raise InvalidInput(f"{where} has the key {key!r}: a stored dict's keys must be str")
            items[key] = encode(item, f"{where}[{key!r}]")
        return {TYPE: "dict", VALUE: items} if TYPE in items else items
    if kind in _TAGGED:
        tag, to_json, _ = _TAGGED[kind]
        return {TYPE: tag, VALUE: to_json(value)}
    raise InvalidInput(
        f"{where} is a {kind.__module__}.{kind.__qualname__}, which would not come back as "
        "itself: return str, int, float, bool, None, Decimal, datetime, date, time, "
        "timedelta, UUID, or lists, tuples and dicts (with str keys) of them"
    )


def decode(value: Any) -> Any:
    """The value :func:`encode` was given, from what it returned (after a JSON round trip).

    Plain JSON (a result stored before values were tagged) decodes as itself.
    """
    if isinstance(value, list):
        return [decode(item) for item in value]
    if not isinstance(value, dict):
        return value
    if value.keys() == {TYPE, VALUE}:
        tag, inner = value[TYPE], value[VALUE]
        if tag == "dict":
            return {key: decode(item) for key, item in inner.items()}
        if tag == "tuple":
            return tuple(decode(item) for item in inner)
        if tag in _DECODERS:
            return _DECODERS[tag](inner)
    return {key: decode(item) for key, item in value.items()}
