"""Errors of the coordination app.

Every error is a :class:`CoordinationError` with a stable ``code`` (used
unchanged by the REST layer and in logs) and an HTTP ``status_code``.

Every error can be built again from its ``args``, so it crosses process
boundaries with its class and fields: pickle calls ``type(error)(*error.args)``,
and so does Celery when it reads a failure back from a JSON result backend
(``AsyncResult.get()`` raises the same class, with the same fields, as the
task raised). ``args`` are the arguments the error was constructed with, not
its message; ``str(error)`` is the message.
"""

from __future__ import annotations

import datetime as dt
import inspect
from collections.abc import Mapping
from typing import Any, Self

_REPLAYABLE_KINDS = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


class CoordinationError(Exception):
    """Base class of every error raised by coordination.

    A subclass with fields of its own takes them as positional-or-keyword
    parameters of its ``__init__`` (a keyword-only parameter or ``**kwargs`` is
    refused when the class is defined: a serializer replays ``args`` by
    position). ``extra`` is what :meth:`as_dict` adds to ``code`` and ``detail``.
    """

    code = "coordination_error"
    status_code = 400
    default_detail = "The coordination request failed."

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        init = cls.__dict__.get("__init__")
        if init is None:
            return
        for parameter in list(inspect.signature(init).parameters.values())[1:]:
            if parameter.kind not in _REPLAYABLE_KINDS and parameter.kind != parameter.VAR_POSITIONAL:
                raise TypeError(
                    f"{cls.__qualname__}.__init__ takes {parameter} by keyword only: a "
                    "CoordinationError's fields must be positional-or-keyword parameters, so "
                    "that pickle and Celery's result backends can build it again from its args"
                )

    def __new__(cls, *args: Any, **kwargs: Any) -> Self:
        error = super().__new__(cls)
        # Recorded here, before any __init__ runs, as the one place that sees the
        # arguments of every subclass's constructor; __init__ makes them the args.
        error._replay = _positional(cls, args, kwargs)
        return error

    def __init__(
        self, detail: str | None = None, fields: Mapping[str, Any] | None = None, /, **extra: Any
    ) -> None:
        self.detail = detail or self.default_detail
        # ``fields`` is how a replay passes back the keywords of a direct construction.
        self.extra = {**(fields or {}), **extra}
        super().__init__(*self._replay)

    _replay: tuple[Any, ...]

    def __str__(self) -> str:
        return self.detail

    def __repr__(self) -> str:
        # Exception's repr shows the args; an error built with none (its default
        # detail) would read ``InTransaction()``: show the message instead.
        if self.args:
            return super().__repr__()
        return f"{type(self).__name__}({self.detail!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        # Exception's own __reduce__ also restores __dict__, which holds the
        # computed fields; rebuilding from the args alone is the contract.
        return (type(self), self.args)

    def as_dict(self) -> dict[str, Any]:
        """The error as the REST layer and structured logs present it."""
        body: dict[str, Any] = {"code": self.code, "detail": self.detail}
        for name, value in self.extra.items():
            body[name] = _timestamp(value) if isinstance(value, dt.datetime) else value
        return body


def _timestamp(value: dt.datetime) -> str:
    """ISO 8601 as the REST fields show times: UTC as ``Z`` (DRF's own rendering),
    so a refusal's ``expires_at`` reads like the grant's."""
    text = value.isoformat()
    return text[:-6] + "Z" if text.endswith("+00:00") else text


_SIGNATURES: dict[type[CoordinationError], inspect.Signature] = {}


def _signature(cls: type[CoordinationError]) -> inspect.Signature:
    # Read once per class: refusals (StaleToken, LockHeld) are raised on busy paths.
    found = _SIGNATURES.get(cls)
    if found is None:
        found = _SIGNATURES[cls] = inspect.signature(cls.__init__)
    return found


def _positional(
    cls: type[CoordinationError], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Any, ...]:
    """The constructor call ``cls(*args, **kwargs)`` as positional arguments alone."""
    signature = _signature(cls)
    try:
        bound = signature.bind(None, *args, **kwargs)
    except TypeError:
        return args  # __init__ raises the same TypeError, with its own message
    replay: list[Any] = []
    for parameter in list(signature.parameters.values())[1:]:
        value = bound.arguments.get(parameter.name, parameter.default)
        if parameter.kind == parameter.VAR_POSITIONAL:
            replay.extend(bound.arguments.get(parameter.name, ()))
        elif parameter.kind == parameter.VAR_KEYWORD:
            # Only the base class's own **extra (subclasses may not take **kwargs):
            # its ``fields`` slot, the second, takes the keywords back.
            extra = bound.arguments.get(parameter.name, {})
            if extra:
                replay[1] = {**(replay[1] or {}), **extra}
        else:
            replay.append(value)
    # Trailing defaults are left out, so the args are as short as the call.
    parameters = list(signature.parameters.values())[1 : len(replay) + 1]
    while replay and replay[-1] is parameters[len(replay) - 1].default:
        replay.pop()
    return tuple(replay)


class InvalidInput(CoordinationError, ValueError):
    """A key, holder, ttl, wait, token or step is malformed or out of bounds."""

    code = "invalid"
    default_detail = "Invalid input."


class InTransaction(CoordinationError):
    """The grant point was called inside an open transaction.

    A grant must commit on its own: inside an outer transaction the token would
    not be durable until that transaction commits, and a rollback would let the
    same token be issued twice.
    """

    code = "in_transaction"
    status_code = 500
    default_detail = (
        "coordination.locks must not run inside transaction.atomic() "
        "(or ATOMIC_REQUESTS); call it in autocommit mode."
    )


class LockHeld(CoordinationError):
    """The lock is held by someone else; ``retry_after`` says how long to wait."""

    code = "lock_held"
    status_code = 409
    default_detail = "The lock is held."

    def __init__(
        self, key: str, holder: str, expires_at: dt.datetime, retry_after: float
    ) -> None:
        self.key = key
        self.holder = holder
        self.expires_at = expires_at
        self.retry_after = retry_after
        super().__init__(
            f"lock {key!r} is held by {holder} until {expires_at:%Y-%m-%d %H:%M:%S.%f}Z; "
            f"retry after {retry_after:.1f} s",
            holder=holder,
            expires_at=expires_at,
            retry_after=round(retry_after, 3),
        )



class LeaseLost(CoordinationError):
    """The grant is no longer the lock's current lease (expired, released, revoked or
    taken over), or the lease proof (``lease_id``) does not match."""

    code = "lease_lost"
    status_code = 409
    default_detail = "The lease is no longer held."


class StaleToken(CoordinationError):
    """A newer token already wrote to the resource; ``current_token`` is its watermark."""

    code = "stale_token"
    status_code = 409
    default_detail = "A newer token has already written to this resource."

    def __init__(
        self, resource: str, token: int, current_token: int, current_step: int = 0
    ) -> None:
        self.resource = resource
        self.token = token
        self.current_token = current_token
        self.current_step = current_step
        super().__init__(
            f"token {token} is stale for {resource}: it has accepted token {current_token}; "
            "take the lock again and re-read before writing",
            current_token=current_token,
            current_step=current_step,
        )



# The step a row deleted and created again starts at (the largest BIGINT, as
# coordination.watermarks.HIGHEST_STEP): no step of its old token is above it.
RETIRED_STEP = 2**63 - 1


def shown_step(step: int | None) -> int | str | None:
    """A watermark's step as logs and messages show it: ``RETIRED_STEP`` (a row
    deleted and created again) as ``"retired"``, any other step as it is."""
    return "retired" if step == RETIRED_STEP else step


class DuplicateWrite(CoordinationError):
    """The same token already wrote this step (or a later one) to the resource."""

    code = "duplicate_write"
    status_code = 409
    default_detail = "This token already made this write."

    def __init__(self, resource: str, token: int, step: int, current_step: int) -> None:
        self.resource = resource
        self.token = token
        self.step = step
        self.current_step = current_step
        if current_step == RETIRED_STEP:
            # A row deleted and created again starts at its old watermark with the
            # last step taken: every write of that token is retired.
            said = (
                f"token {token} wrote {resource} before the row was deleted and created "
                "again; the new row keeps that watermark, so only a newer token may write it"
            )
        else:
            said = (
                f"token {token} step {step} is a duplicate for {resource}: step {current_step} "
                "of this token is already stored; a new write of this token needs a step above "
                f"{current_step} (a write numbered with step= does not move the lease's own "
                "count), a retry of a write that applied needs an idempotency key to return "
                "its result"
            )
        super().__init__(said, current_token=token, current_step=current_step)


class UnfencedWrite(CoordinationError):
    """A plain write (``save()``, ``update()``, the admin) to a row of a ``fence_strict``
    model: the database refuses every UPDATE of such a row that does not raise its
    watermark, so its writes must go through ``fenced_update()`` or ``fenced_save()``.

    ``current_token`` and ``current_step`` are the row's watermark, None when unknown.
    """

    code = "unfenced_write"
    status_code = 409
    default_detail = "This model is fenced strictly: write it with a grant."

    def __init__(
        self, resource: str, current_token: int | None = None, current_step: int | None = None
    ) -> None:
        self.resource = resource
        self.current_token = current_token
        self.current_step = current_step
        watermark = (
            "" if current_token is None
            else f" (token {current_token}, step {shown_step(current_step)})"
        )
        super().__init__(
            f"{resource} is fenced strictly: an UPDATE that does not raise its watermark"
            f"{watermark} is refused; write it with fenced_update() or fenced_save() under a "
            "grant of its lock",
            current_token=current_token,
            current_step=current_step,
        )



class StaleInstance(CoordinationError):
    """A ``save()`` of a FencedModel instance loaded before the row's watermark rose:
    a fenced write (or another instance's) changed the row since, and saving this
    instance's values would overwrite it. Nothing was written.

    ``watermark`` is the (fence, fence_step) the instance carries, ``current_token``
    and ``current_step`` the row's. Reload the instance (``refresh_from_db()``) and
    make the change again, or write under a grant (``fenced_save()``); an operator
    who means to overwrite says so with ``coordination.unfenced(reason=...)``.
    """

    code = "stale_instance"
    status_code = 409
    default_detail = "The row changed since this instance was loaded; reload it and try again."

    def __init__(
        self, resource: str, token: int, step: int, current_token: int, current_step: int
    ) -> None:
        self.resource = resource
        self.token = token
        self.step = step
        self.current_token = current_token
        self.current_step = current_step
        super().__init__(
            f"{resource} was loaded at watermark ({token}, {shown_step(step)}) but the row is at "
            f"({current_token}, {shown_step(current_step)}): a newer write changed it, so saving this "
            "instance would overwrite that write; nothing was saved. Reload it with "
            "refresh_from_db() and redo the change, or write it under a grant with "
            "fenced_save()",
            current_token=current_token,
            current_step=current_step,
        )


class WrongLock(CoordinationError):
    """The grant belongs to another lock key than the one guarding the resource."""

    code = "wrong_lock"
    status_code = 409
    default_detail = "The grant's lock does not guard this resource."


class KeyForbidden(CoordinationError):
    """The user's access rules do not allow this action on this lock key
    (docs/access-rules.md); nothing was changed."""

    code = "key_forbidden"
    status_code = 403
    default_detail = "Your access rules do not allow this action on this key."


class TokenExhausted(CoordinationError):
    """The lock's token counter reached 2**63 - 1; tokens never wrap."""

    code = "token_exhausted"
    status_code = 409
    default_detail = "The lock has issued its last token; use a new key."


class GrantPointUnavailable(CoordinationError):
    """The grant point's database connection failed during the call (a failover,
    a restart, the network): the outcome is unknown.

    An acquire that raises this returned no lease, so the caller does not hold
    the lock, whatever the database did: if the grant committed before the
    connection was cut, nobody holds its lease id, and it ends at its TTL (or
    when the promotion guard revokes it on a new primary). A renew or release
    that raises this leaves the lease as it was; act as if it may be lost.
    The broken connection is closed, so a retry connects again (to the new
    primary, with a multi-host URL and ``target_session_attrs=read-write``).
    """

    code = "grant_point_unavailable"
    status_code = 503
    default_detail = "The grant point's database is unavailable; retry later."


class NotMigrated(CoordinationError):
    """The grant point's database lacks migrations of the app (``manage.py migrate``
    was not run there, or not since the package was upgraded): its tables or
    functions are missing or old. Nothing was granted, renewed or released."""

    code = "not_migrated"
    status_code = 503
    default_detail = (
        "coordination's migrations are not all applied on the grant point's database: "
        "run python manage.py migrate."
    )


class NoGrant(CoordinationError):
    """A fenced write was attempted with no grant passed and none in context."""

    code = "no_grant"
    status_code = 500
    default_detail = (
        "No grant: pass one to the fenced write, or run it inside locks.hold(), "
        "locks.use_grant() or a fenced task."
    )


class IdempotencyKeyReused(CoordinationError):
    """An idempotency key came back with a different request than the one it stored."""

    code = "idempotency_key_reused"
    status_code = 409
    default_detail = (
        "This Idempotency-Key was used for a different request; use a new key for a new write."
    )
