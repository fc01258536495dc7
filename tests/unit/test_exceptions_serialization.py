"""Every coordination error crosses Celery's result backends with its class and fields.

Celery stores a task's failure through ``Backend.prepare_exception`` and reads it
back through ``Backend.exception_to_python``: with pickle it unpickles the error,
with JSON it stores ``exc.args`` and calls ``cls(*args)``. These tests run
Celery's own code on every ``CoordinationError`` subclass, found by walking the
class tree, so an error added later is covered without a line here.
"""

from __future__ import annotations

import datetime as dt
import importlib
import inspect
import pkgutil
import types
import typing
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from celery.backends.base import Backend

import coordination
from coordination.exceptions import CoordinationError, LockHeld, StaleToken

SAMPLES: dict[Any, Any] = {
    str: "invoice:7",
    int: 41,
    float: 4.25,
    dt.datetime: dt.datetime(2026, 1, 1, 12, 0, 5, 250000, tzinfo=dt.UTC),
}


def all_error_classes() -> list[type[CoordinationError]]:
    """CoordinationError and every subclass, wherever in the app it is defined."""
    for module in pkgutil.walk_packages(coordination.__path__, "coordination."):
        if ".migrations" not in module.name and ".management" not in module.name:
            importlib.import_module(module.name)

    def walk(cls: type[CoordinationError]) -> Iterator[type[CoordinationError]]:
        yield cls
        for sub in cls.__subclasses__():
            yield from walk(sub)

    return sorted(set(walk(CoordinationError)), key=lambda cls: cls.__qualname__)


def sample(annotation: Any, where: str) -> Any:
    if annotation in SAMPLES:
        return SAMPLES[annotation]
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        options = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
        return sample(options[0], where)
    raise AssertionError(f"{where}: add a sample value for {annotation!r} to SAMPLES")


def constructed(cls: type[CoordinationError]) -> list[CoordinationError]:
    """The error built with every field given by name, and with the required ones by position."""
    if cls.__init__ is CoordinationError.__init__:
        return [
            cls(),
            cls("what happened, and what to do"),
            cls("with fields, as raised", action="write", key="invoice:7"),
            cls("with a field, as replayed", {"holder": "worker-3"}),
        ]
    hints = typing.get_type_hints(cls.__init__)
    parameters = list(inspect.signature(cls.__init__).parameters.values())[1:]
    full = {p.name: sample(hints[p.name], f"{cls.__qualname__}.{p.name}") for p in parameters}
    required = [full[p.name] for p in parameters if p.default is p.empty]
    return [cls(**full), cls(*required)]


def backend(serializer: str) -> Backend:
    return Backend(Celery(set_as_current=False), serializer=serializer, accept=[serializer])


def through(serializer: str, error: CoordinationError) -> BaseException:
    """``error`` stored as a task's failure and read back, as a result backend does it."""
    store = backend(serializer)
    payload = store.encode({"status": "FAILURE", "result": store.prepare_exception(error)})
    # A fresh backend reads it, as the caller's process would.
    read = backend(serializer)
    return read.exception_to_python(read.decode(payload)["result"])


CASES = [(error, cls) for cls in all_error_classes() for error in constructed(cls)]
CASE_IDS = [f"{cls.__name__}-{i}" for i, (_, cls) in enumerate(CASES)]


def test_the_walk_finds_the_documented_errors() -> None:
    names = {cls.__name__ for cls in all_error_classes()}
    assert {"LockHeld", "LeaseLost", "StaleToken", "DuplicateWrite", "WrongLock"} <= names


@pytest.mark.parametrize("serializer", ["json", "pickle"])
@pytest.mark.parametrize(("error", "cls"), CASES, ids=CASE_IDS)
def test_every_error_comes_back_from_a_result_backend_with_its_class_and_fields(
    serializer: str, error: CoordinationError, cls: type[CoordinationError]
) -> None:
    back = through(serializer, error)

    assert type(back) is cls
    assert isinstance(back, CoordinationError)
    assert str(back) == str(error)
    assert back.args == error.args
    assert back.as_dict() == error.as_dict()
    assert vars(back) == vars(error)


def test_the_caller_catches_stale_token_and_lock_held_by_class_through_json() -> None:
    stale = StaleToken("invoice:7", 41, 42, 3)
    held = LockHeld("invoice:7", "worker-3", SAMPLES[dt.datetime], 4.2)

    with pytest.raises(StaleToken) as caught_stale:
        raise through("json", stale)
    with pytest.raises(LockHeld) as caught_held:
        raise through("json", held)

    assert (caught_stale.value.token, caught_stale.value.current_token, caught_stale.value.current_step) == (
        41, 42, 3,
    )
    assert caught_held.value.expires_at == SAMPLES[dt.datetime]
    assert caught_held.value.retry_after == 4.2


def test_an_error_whose_fields_are_keyword_only_is_refused_when_it_is_defined() -> None:
    with pytest.raises(TypeError, match="positional-or-keyword"):

        class Unreplayable(CoordinationError):
            def __init__(self, *, resource: str) -> None:
                super().__init__(resource)
