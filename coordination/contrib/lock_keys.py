"""A fenced task's lock key: a template over the task's arguments, or a callable."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..exceptions import InvalidInput
from ..models import validate_key

__all__ = ["LockSpec", "lock_key_for", "resolve_lock_key"]

#: A lock key template over the task's arguments (``"account:{account_id}"``) or a
#: callable taking the task's arguments and returning the key.
LockSpec = str | Callable[..., str]


def resolve_lock_key(
    spec: LockSpec, signature: Any, args: Sequence[Any], kwargs: Mapping[str, Any]
) -> str:
    """The lock key of one call: ``spec`` formatted with the call's bound arguments.

    ``signature`` is the task function's :class:`inspect.Signature`; defaults
    count, so ``"report:{day}"`` works when ``day`` has a default. Raises
    ``InvalidInput`` when the template names an argument the call lacks or the
    result is not a valid key.
    """
    if callable(spec):
        key = spec(*args, **kwargs)
    else:
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError as error:
            raise InvalidInput(f"cannot build lock key {spec!r}: {error}") from None
        bound.apply_defaults()
        arguments = dict(bound.arguments)
        for parameter in signature.parameters.values():
            # **kwargs of the task are usable by name in the template.
            if parameter.kind is parameter.VAR_KEYWORD:
                arguments.update(arguments.pop(parameter.name, {}))
        try:
            key = spec.format(**arguments)
        except (KeyError, IndexError, AttributeError) as error:
            raise InvalidInput(
                f"lock key template {spec!r} names {error}, which this call does not have"
            ) from None
    return validate_key(key)


def lock_key_for(
    spec: LockSpec, func: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any]
) -> str:
    """The lock key of calling ``func`` with ``args`` and ``kwargs`` (see resolve_lock_key)."""
    return resolve_lock_key(spec, _signature(func), args, kwargs)


@functools.cache
def _cached_signature(func: Callable[..., Any]) -> inspect.Signature:
    return inspect.signature(func)


def _signature(func: Callable[..., Any]) -> inspect.Signature:
    try:
        return _cached_signature(func)
    except TypeError:  # unhashable callables (bound methods are hashable)
        return inspect.signature(func)
