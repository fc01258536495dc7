"""A fenced task's lock key: a template over the task's arguments, or a callable."""

from __future__ import annotations

import functools
import inspect
import string
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..exceptions import InvalidInput
from ..models import validate_key

__all__ = ["LockSpec", "check_template", "lock_key_for", "resolve_lock_key", "signature_of"]

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
    return resolve_lock_key(spec, signature_of(func), args, kwargs)


@functools.cache
def _cached_signature(func: Callable[..., Any]) -> inspect.Signature:
    return inspect.signature(func)


def signature_of(func: Callable[..., Any]) -> inspect.Signature:
    """``func``'s signature, looked up once per function."""
    try:
        return _cached_signature(func)
    except TypeError:  # unhashable callables (bound methods are hashable)
        return inspect.signature(func)


def check_template(spec: LockSpec, func: Callable[..., Any], *, bound: bool = False) -> None:
    """Refuse, when the task is declared, a template naming an argument ``func`` does
    not take: ``"order:{orderid}"`` on ``def settle(order_id)`` would fail every
    execution in the worker. ``bound``: the first parameter is the task itself,
    which a template cannot name. A callable, or a function taking ``**kwargs``,
    is checked at each call only."""
    if callable(spec):
        return
    parameters = list(signature_of(func).parameters.values())
    if bound and parameters:
        parameters = parameters[1:]
    if any(parameter.kind is parameter.VAR_KEYWORD for parameter in parameters):
        return
    takes = [parameter.name for parameter in parameters if parameter.kind is not parameter.VAR_POSITIONAL]
    try:
        fields = [field for _text, field, _spec, _conv in string.Formatter().parse(spec) if field is not None]
    except ValueError as error:
        raise InvalidInput(f"lock key template {spec!r} is not a valid template: {error}") from None
    for field in fields:
        name = field.split(".", 1)[0].split("[", 1)[0]
        if name not in takes:
            raise InvalidInput(
                f"lock key template {spec!r} of {func.__qualname__} names {{{name}}}, which is not "
                f"one of its parameters ({', '.join(takes) or 'none'})"
            )
