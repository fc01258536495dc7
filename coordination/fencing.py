"""The resource side: fences that refuse late writers where the side effect happens.

A resource keeps a watermark, the highest (token, step) it has accepted, and
checks a write against it in the same atomic statement or transaction as the
write itself (rule 4 of docs/rules.md):

- token below the watermark: refused as stale (``StaleToken``);
- token above it: accepted, and the watermark rises;
- the same token: accepted only for a later step of the same grant (a holder
  numbering its writes 1, 2, 3...); the same or an earlier step is a
  duplicate (``DuplicateWrite``). Same-token retries that must return the
  first result go through :func:`idempotent`.

Three ways to fence a resource:

- :class:`FencedModel` rows are their own fences: ``fenced_update`` is one
  conditional ``UPDATE ... WHERE fence < :token OR (fence = :token AND
  fence_step < :step)``.
- :func:`fence` locks named :class:`~coordination.models.Fence` rows in the
  caller's transaction, for side effects that are not one row update.
- The REST document store, built on :func:`fence`.

Every refusal is recorded as a :class:`~coordination.models.Rejection`.
"""

from __future__ import annotations

import getpass
import json
import logging
import os
import re
import socket
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from contextvars import ContextVar
from functools import cache
from typing import Any, ClassVar, NamedTuple, NoReturn, TypeVar, cast, overload

from django.core.exceptions import (
    FieldDoesNotExist,
    FieldError,
    ValidationError,
)
from django.db import DatabaseError, IntegrityError, connections, models, router, transaction
from django.db.models import F, Func, Lookup, Q, Value
from django.db.models.expressions import Expression
from django.db.models.functions import Cast, Concat

from . import aio, results, signals, watermarks
from .backends import get_backend
from .conf import app_settings
from .exceptions import (
    CoordinationError,
    DuplicateWrite,
    InvalidInput,
    LeaseLost,
    NoGrant,
    StaleInstance,
    StaleToken,
    UnfencedWrite,
    WrongLock,
)
from .leases import Lease
from .locks import current_grant
from .logfields import LogFields
from .models import (
    MAX_TOKEN,
    DatabaseNow,
    Fence,
    IdempotencyRecord,
    Lock,
    Rejection,
    RejectionReason,
    TokenFloor,
    UnfencedSave,
    validate_key,
)

__all__ = [
    "FencedModel",
    "FencedQuerySet",
    "Grants",
    "WatermarkField",
    "WatermarkRaise",
    "afence",
    "fence",
    "idempotent",
    "lock_key_expression",
    "lock_key_of",
    "raise_fence_to_lock",
    "record_rejection",
    "unfenced",
]

logger = logging.getLogger("coordination.fencing")

T = TypeVar("T")
_Model = TypeVar("_Model", bound=models.Model)
_PLACEHOLDER = re.compile(r"\{(\w+)\}")


class FencedQuerySet(models.QuerySet[_Model]):
    """QuerySet of a :class:`FencedModel`, with the fenced conditional update."""

    def update(self, **kwargs: Any) -> int:
        """``QuerySet.update()``, with the watermark triggers' refusals named for the row.

        An UPDATE that would lower a row's watermark raises ``StaleToken`` (a lower
        token) or ``DuplicateWrite`` (a lower step of the same token); one that
        leaves the watermark of a ``fence_strict`` row where it is raises
        ``UnfencedWrite``. ``bulk_update()`` goes through here too. The rows are
        left as they were: the database undoes the whole statement.
        """
        try:
            return super().update(**kwargs)
        except IntegrityError as error:
            refused = _explain_refusal(error, self, kwargs)
            if refused is None:
                raise
            raise refused from error

    def fenced_update(
        self, grant: Lease | None = None, /, *, step: int | None = None, **values: Any
    ) -> int:
        """Apply ``values`` to the row guarded by ``grant``'s lock key, if its fence admits it.

        One conditional UPDATE: the check and the write cannot be separated by a
        pause. ``grant`` defaults to the current one (``locks.hold``,
        ``locks.use_grant`` or a fenced task); ``step`` defaults to the grant's
        next write number. Returns the number of rows written (at least 1).

        Raises ``StaleToken`` (a newer token wrote; ``current_token`` says which),
        ``DuplicateWrite`` (this token already wrote this step or a later one),
        ``WrongLock`` (the grant's key does not guard the rows asked for; nothing is
        written), ``LeaseLost`` (the grant was marked lost), or the model's
        ``DoesNotExist``. Each refusal is recorded as a Rejection.
        """
        model: Any = self.model
        grant = _resolve_grant(grant)
        label = model._meta.label_lower
        binding = lock_binding(model, grant.key)
        if binding is None:
            _refuse(
                WrongLock(
                    f"lock {grant.key!r} does not guard {label} rows "
                    f"(they are guarded by {model.fence_lock!r})"
                ),
                resource=label, grant=grant, step=step or 0, reason=RejectionReason.WRONG_LOCK,
                using=self.db,
            )
        write_step = _resolve_step(grant, step)
        if grant.lost:
            _refuse(
                LeaseLost(f"the lease of {grant.key!r} token {grant.token} was lost; not writing"),
                resource=label, grant=grant, step=write_step, reason=RejectionReason.LEASE_LOST,
                using=self.db,
            )
        token = grant.token
        admitted, fits = _admitted(self, token, write_step, binding)
        # A refused write changes nothing, and the watermark only rises, so a
        # refusal found by the reads below still holds; the loop is for a row
        # deleted and re-created in between.
        for _attempt in range(3):
            written = admitted.update(fence=token, fence_step=write_step, **values)
            self._result_cache = None  # as update() leaves the queryset it ran on
            if written:
                # send() returns at once when nobody listens; has_listeners() first
                # would resolve the receivers twice (the app's own always listen).
                signals.write_accepted.send(
                    sender=Fence, resource=label, grant=grant, step=write_step
                )
                return written
            # Only a refusal needs the guarded rows on their own, to explain it.
            guarded = self.filter(**binding) if fits else self.none()
            rows = list(guarded.values_list("pk", "fence", "fence_step")[:1])
            if not rows:
                if self.exists():
                    _refuse(
                        WrongLock(f"lock {grant.key!r} does not guard the {label} rows asked for"),
                        resource=label, grant=grant, step=write_step,
                        reason=RejectionReason.WRONG_LOCK, using=self.db,
                    )
                raise model.DoesNotExist(
                    f"no {label} row guarded by lock {grant.key!r} matches the query"
                )
            pk, current, current_step = rows[0]
            resource = f"{label}:{pk}"
            refusal = _refusal(resource, token, write_step, current, current_step)
            if refusal is not None:
                reason, error = refusal
                _refuse(
                    error, resource=resource, grant=grant, step=write_step, reason=reason,
                    watermark=(current, current_step), using=self.db,
                )
        raise CoordinationError(f"fenced_update of {label} did not settle; retry")  # pragma: no cover


    async def afenced_update(
        self, grant: Lease | None = None, /, *, step: int | None = None, **values: Any
    ) -> int:
        """``fenced_update()`` for async code: the same conditional UPDATE, guarantees
        and refusals, run on the app's thread pool (:mod:`coordination.aio`).

        ``grant`` defaults to the current one (``locks.ahold``, ``use_grant`` or a
        fenced task) and ``step`` to its next write number, both taken in the
        caller's context. Cancelled before a thread took it, the write never
        runs; once it runs, it completes (one statement) and its outcome is dropped.
        """
        grant = _resolve_grant(grant)
        write_step = _resolve_step(grant, step)
        return await aio.run_sync(self.fenced_update, grant, step=write_step, **values)


def _admitted(
    rows: models.QuerySet[Any], token: int, step: int, binding: Mapping[str, str]
) -> tuple[models.QuerySet[Any], bool]:
    """``rows`` narrowed to those ``(token, step)`` may write: bound to the lock key
    and below the watermark (:class:`_Admits`), and whether the key's values fit
    the fields they bind (if not, no row is admitted)."""
    try:
        return rows.filter(_Admits(token, step), **binding), True
    except (ValueError, ValidationError, FieldError):
        return rows.none(), False


class _Watermark(Func):
    """A fenced row's watermark, ``(fence, fence_step)``, as one row value."""

    template = "(%(expressions)s)"
    output_field = models.BigIntegerField()

    def __init__(self) -> None:
        super().__init__(F("fence"), F("fence_step"))


class _WatermarkCondition(Lookup):
    """A condition on a fenced row's watermark, ``(fence, fence_step) <op> (token,
    step)``: the watermark rule as one row comparison. A lookup passed to
    ``filter()``: its columns resolve as ``F()`` does (a multi-table child's
    through the join to its parent's row), and Django compiles the statement
    around it, on each Django this app supports.
    """

    operator: ClassVar[str]
    prepare_rhs = False

    def __init__(self, token: int, step: int) -> None:
        super().__init__(_Watermark(), (token, step))

    def as_sql(self, compiler: Any, connection: Any) -> tuple[str, tuple[Any, ...]]:
        watermark, params = compiler.compile(self.lhs)
        return f"{watermark} {self.operator} (%s, %s)", (*params, *self.rhs)


class _Admits(_WatermarkCondition):
    """The rows a fenced write may change: ``(fence, fence_step) < (token, step)``
    (fence < token OR fence = token AND fence_step < step), strictly below."""

    operator = "<"


class _NotAbove(_WatermarkCondition):
    """The rows a plain ``save()`` may write: ``(fence, fence_step) <= (token, step)``,
    the watermark the instance carries."""

    operator = "<="


class _Override(NamedTuple):
    reason: str
    by: str


# The unfenced() block the current thread or task is in, if any.
_override: ContextVar[_Override | None] = ContextVar("coordination_unfenced", default=None)


@contextmanager
def unfenced(*, reason: str, by: str | None = None) -> Iterator[None]:
    """Let saves of stale FencedModel instances through, for operators and data migrations.

    By default a ``save()`` of an instance loaded before the row's watermark
    rose is refused (``StaleInstance``). Inside this block it writes the
    instance's values over the newer ones instead, and each save it lets
    through is audited: a WARNING on the ``coordination.fencing`` logger
    (resource, both watermarks, ``reason``, ``by``) and an
    :class:`~coordination.models.UnfencedSave` row, written in the same
    transaction as the save. Entering the block is logged at WARNING too.

    It never lowers a watermark: ``save()`` does not write it, and the
    database refuses any UPDATE that would, whatever runs it. It does not
    lift ``fence_strict`` either: such a model's rows are written under a
    grant only. Saves of instances that are not stale, inserts and other
    write paths behave as outside the block.

    ``reason`` says why (required, not blank); ``by`` who (default: the OS
    user, host and process id). Scoped to the current thread or asyncio task.
    """
    if not isinstance(reason, str) or not reason.strip():
        raise InvalidInput("unfenced() needs a reason: say why stale instances may be saved")
    who = by if by else _process_identity()
    logger.warning(
        "unfenced block entered %s", LogFields(reason=reason, by=who),
        extra={"coordination": {"event": "unfenced", "reason": reason, "by": who}},
    )
    token = _override.set(_Override(reason, who))
    try:
        yield
    finally:
        _override.reset(token)


def _process_identity() -> str:
    try:
        user = getpass.getuser()
    except (OSError, KeyError):  # no name for the uid (a container's)
        user = f"uid {os.getuid()}"
    return f"{user}@{socket.gethostname()} pid {os.getpid()}"


class WatermarkField(models.BigIntegerField):  # type: ignore[type-arg]
    """A watermark column: an insert writes it, a plain ``save()`` of an existing row never does.

    On an update, ``pre_save`` returns the column itself (``SET fence = fence``),
    so a stale instance's ``save()`` keeps the watermark a newer token wrote
    (rule 8 of docs/rules.md), with or without ``update_fields`` naming it, while
    the rest of ``save()`` keeps Django's semantics: an instance whose row was
    deleted is inserted again with its own values. A field rather than an
    overridden ``save()``: Django asks the field for its value on every path
    that saves an instance (``save``, ``update_or_create``, the admin), and
    an override could only drop the columns from ``update_fields``, which turns
    the insert fallback into an error. Django 6 reads the row's watermark back
    into the instance (``RETURNING``); on 5.2 the instance keeps the value it
    was loaded with until ``refresh_from_db()``.

    It deconstructs as a plain ``BigIntegerField``: the column is the same, so
    no migration of a user's app changes.
    """

    def pre_save(self, model_instance: models.Model, add: bool) -> Any:
        if add:
            return super().pre_save(model_instance, add)
        return F(self.name)

    def deconstruct(self) -> Any:
        name, _path, args, kwargs = super().deconstruct()
        return name, "django.db.models.BigIntegerField", args, kwargs


class FencedModel(models.Model):
    """A model whose rows are their own fences.

    Declare which lock key guards a row with ``fence_lock``, a template over the
    row's fields: ``fence_lock = "account:{pk}"`` means the grant of
    ``account:7`` may write the row with pk 7 and no other. The ``fence`` column is
    the watermark (BIGINT NOT NULL DEFAULT 0: a NULL would make the first
    comparison UNKNOWN and block every write) and ``fence_step`` numbers the
    writes under one token.

    The watermark never goes back (rule 8 of docs/rules.md): ``save()`` never
    writes it (:class:`WatermarkField`), and a trigger that ``migrate``
    installs refuses any UPDATE that lowers it, whatever wrote it
    (:mod:`coordination.watermarks`). With ``fence_strict = True`` the trigger
    also refuses every UPDATE that does not raise it, so only ``fenced_update()``
    and ``fenced_save()`` can change a row; switching it on or off takes effect
    at the next ``migrate``.

    A ``save()`` of an instance loaded before the row's watermark rose is
    refused (``StaleInstance``): the instance carries the watermark it was
    loaded with (its ``fence`` and ``fence_step``, or what its own
    ``fenced_save()`` wrote), and the UPDATE only writes a row whose watermark
    is not above it. ``coordination.unfenced()`` lets such a save through,
    audited. A deleted row's watermark is kept, and a row inserted again with
    its primary key starts above it.
    """

    fence = WatermarkField(default=0, db_default=0, editable=False)
    fence_step = WatermarkField(default=0, db_default=0, editable=False)

    fence_lock: ClassVar[str]
    fence_strict: ClassVar[bool] = False

    objects = FencedQuerySet.as_manager()

    class Meta:
        abstract = True
        constraints = [
            models.CheckConstraint(
                condition=Q(fence__gte=0), name="%(app_label)s_%(class)s_fence_gte_0"
            ),
            models.CheckConstraint(
                condition=Q(fence_step__gte=0), name="%(app_label)s_%(class)s_fence_step_gte_0"
            ),
        ]

    def save(self, *args: Any, **kwargs: Any) -> None:
        """Django's ``save()``, refused for a stale instance, never writing the
        watermark of an existing row.

        Raises ``StaleInstance`` if the row's watermark is above the one this
        instance carries (a newer write changed the row since it was loaded),
        with ``update_fields`` or without; nothing is written. Reload it with
        ``refresh_from_db()`` and redo the change, or write under a grant with
        :meth:`fenced_save`. The check is part of the UPDATE (``WHERE (fence,
        fence_step) <= (carried)``), so no write can slip in between. An
        instance loaded without its watermark (``only()``, ``defer()``)
        carries (0, 0).

        On a ``fence_strict`` model the database refuses it: ``UnfencedWrite``
        instead of its ``IntegrityError`` (write such rows with
        :meth:`fenced_save`). An insert writes the instance's watermark, or
        the deleted row's if one was deleted with this primary key and that is
        higher (the instance then carries it).
        """
        try:
            super().save(*args, **kwargs)
        except IntegrityError as error:
            using = kwargs.get("using") or router.db_for_write(type(self), instance=self)
            rows = type(self)._base_manager.db_manager(using).filter(pk=self.pk)
            refused = _explain_refusal(error, rows, {})
            if refused is None:
                raise
            raise refused from error

    def carried_watermark(self) -> tuple[int, int]:
        """The (fence, fence_step) this instance carries: as loaded, or as its own
        fenced write or insert left them; (0, 0) where it was loaded without them.
        Read without touching the database (a deferred field is not loaded)."""
        values = self.__dict__
        fence, step = values.get("fence"), values.get("fence_step")
        if isinstance(fence, int) and isinstance(step, int):
            return fence, step
        return 0, 0

    def _do_update(  # type: ignore[override]  # Django 5.2 has no returning_fields
        self, base_qs: models.QuerySet[Any], using: str, pk_val: Any, values: Any,
        update_fields: Any, forced_update: bool, *args: Any,
    ) -> Any:
        # Django's UPDATE of one table for save(), narrowed to a row whose watermark
        # is not above the carried one. No row updated is then either no row
        # (Django inserts it, as before) or a stale instance: told apart by
        # reading the row. A watermark only rises, so a row found above the
        # carried watermark was above it at the UPDATE too.
        model: type[models.Model] = base_qs.model
        if not values or not _has_watermark(model):
            return super()._do_update(
                base_qs, using, pk_val, values, update_fields, forced_update, *args
            )
        token, step = self.carried_watermark()
        # A multi-table child's watermark is its parent's row's, joined.
        guarded = base_qs.filter(_NotAbove(token, step))
        updated = super()._do_update(
            guarded, using, pk_val, values, update_fields, forced_update, *args
        )
        if updated:
            return updated
        current = base_qs.filter(pk=pk_val).values_list("fence", "fence_step").first()
        if current is None or current <= (token, step):
            return updated  # no row (or one inserted since): Django's own path
        resource = f"{self._meta.label_lower}:{pk_val}"
        override = _override.get()
        if override is None:
            logger.warning(
                "save refused %s",
                LogFields(
                    reason="stale_instance", resource=resource, token=token, step=step,
                    watermark_token=current[0], watermark_step=current[1],
                ),
                extra={
                    "coordination": {
                        "event": "save_refused", "reason": "stale_instance",
                        "resource": resource, "token": token, "step": step,
                        "watermark_token": current[0], "watermark_step": current[1],
                    }
                },
            )
            raise StaleInstance(resource, token, step, current[0], current[1])
        # The escape hatch: the plain UPDATE (the watermark column still set to
        # itself, and the triggers still refusing a lowering), with its audit
        # row in the same transaction.
        with transaction.atomic(using=using):
            updated = super()._do_update(
                base_qs, using, pk_val, values, update_fields, forced_update, *args
            )
            if updated:
                written = base_qs.filter(pk=pk_val).values_list("fence", "fence_step").first()
                mark = written or current
                UnfencedSave.objects.using(using).create(
                    resource=resource[: UnfencedSave._meta.get_field("resource").max_length],
                    lock_key=lock_key_of(self)[: UnfencedSave._meta.get_field("lock_key").max_length],
                    token=token, step=step, watermark_token=mark[0], watermark_step=mark[1],
                    reason=override.reason,
                    by=override.by[: UnfencedSave._meta.get_field("by").max_length],
                )
        if updated:
            logger.warning(
                "stale save let through %s",
                LogFields(
                    resource=resource, token=token, step=step, watermark_token=mark[0],
                    watermark_step=mark[1], reason=override.reason, by=override.by,
                ),
                extra={
                    "coordination": {
                        "event": "unfenced_save", "resource": resource, "token": token,
                        "step": step, "watermark_token": mark[0], "watermark_step": mark[1],
                        "reason": override.reason, "by": override.by,
                    }
                },
            )
            # The instance now holds the row's data: it is as fresh as a reload.
            self.fence, self.fence_step = mark
        return updated

    def _do_insert(
        self, manager: Any, using: str, fields: Any, returning_fields: Any, raw: bool
    ) -> Any:
        # With a primary key chosen before the insert, the row may be one deleted
        # before: the database then starts it at the deleted row's watermark
        # (a tombstone), and the instance must carry that one, or its next
        # save() would be refused as stale. A key the database picks is new.
        marks = _own_watermark(manager.model)
        if raw or self.pk is None or marks is None:
            return super()._do_insert(manager, using, fields, returning_fields, raw)  # type: ignore[misc]
        connection = connections[using]
        if (
            watermarks.insert_returns_restored(connection)
            and connection.features.can_return_columns_from_insert
        ):
            # The INSERT returns the watermark the trigger started the row at.
            asked = [*returning_fields, *(field for field in marks if field not in returning_fields)]
            result = super()._do_insert(manager, using, fields, asked, raw)  # type: ignore[misc]
            returned = dict(zip(asked, result[0], strict=True))
            self.fence, self.fence_step = returned[marks[0]], returned[marks[1]]
            return [tuple(returned[field] for field in returning_fields)]
        result = super()._do_insert(manager, using, fields, returning_fields, raw)  # type: ignore[misc]
        found = manager.using(using).filter(pk=self.pk).values_list("fence", "fence_step").first()
        if found is None:
            return result
        self.fence, self.fence_step = found
        # Django assigns what the INSERT returned after this, which (SQLite) is
        # the row before its AFTER INSERT trigger restored the watermark.
        if result and returning_fields:
            read = dict(zip(marks, found, strict=True))
            result = [
                tuple(
                    read.get(field, value)
                    for field, value in zip(returning_fields, result[0], strict=False)
                ),
                *result[1:],
            ]
        return result

    def fenced_save(
        self, grant: Lease | None = None, /, *, fields: Sequence[str], step: int | None = None
    ) -> None:
        """Write ``fields`` of this instance with ``grant``'s token, and raise its watermark.

        The one way to save an instance's values under a grant: one
        ``fenced_update`` of this row with these fields, refused like it
        (``StaleToken``, ``DuplicateWrite``, ``WrongLock``, ``LeaseLost``,
        ``DoesNotExist``). Afterwards the instance's ``fence`` and ``fence_step``
        are the new watermark. ``step`` defaults to the grant's next write number.
        """
        grant = _resolve_grant(grant)
        write_step = _resolve_step(grant, step)
        manager = type(self)._default_manager.using(self._state.db)
        manager.filter(pk=self.pk).fenced_update(
            grant, step=write_step, **{name: getattr(self, name) for name in fields}
        )
        self.fence, self.fence_step = grant.token, write_step


@cache
def _has_watermark(model: type[models.Model]) -> bool:
    """Whether ``model``'s own table holds the watermark columns, or inherits them
    (a multi-table child: the UPDATE then checks its parent's row)."""
    try:
        model._meta.get_field("fence")
    except FieldDoesNotExist:
        return False
    return True


@cache
def _own_watermark(model: type[models.Model]) -> tuple[models.Field[Any, Any], ...] | None:
    """The watermark fields (fence, fence_step) if ``model``'s own table holds them."""
    if not _has_watermark(model):
        return None
    meta = model._meta
    fields = (meta.get_field("fence"), meta.get_field("fence_step"))
    if any(getattr(field, "model", None) is not model for field in fields):
        return None
    return cast("tuple[models.Field[Any, Any], ...]", fields)


def lock_binding(model: type[models.Model], key: str) -> dict[str, str] | None:
    """The field lookups of the rows that lock ``key`` guards, or None if it guards none."""
    match = _template_pattern(_fence_lock(model)).fullmatch(key)
    return None if match is None else match.groupdict()


def lock_key_expression(model: type[models.Model]) -> Expression:
    """The lock key guarding each row of ``model``, computed by the database.

    ``fence_lock = "account:{pk}"`` gives ``'account:' || CAST(id AS text)``,
    so rows can be filtered by key (the admin's access rules) in the query.
    """
    parts: list[Expression] = []
    template, position = _fence_lock(model), 0
    for placeholder in _PLACEHOLDER.finditer(template):
        if placeholder.start() > position:
            parts.append(Value(template[position : placeholder.start()]))
        parts.append(Cast(placeholder.group(1), models.CharField()))
        position = placeholder.end()
    if position < len(template):
        parts.append(Value(template[position:]))
    if len(parts) == 1:
        return parts[0]
    return Concat(*parts, output_field=models.CharField())


def lock_key_of(row: models.Model) -> str:
    """The lock key guarding ``row`` (its model's ``fence_lock`` filled in)."""
    return _PLACEHOLDER.sub(lambda name: str(getattr(row, name.group(1))), _fence_lock(type(row)))


def _fence_lock(model: type[models.Model]) -> str:
    template = getattr(model, "fence_lock", None)
    if not isinstance(template, str):
        raise CoordinationError(
            f"{model._meta.label} must declare fence_lock, e.g. "
            f'fence_lock = "{model._meta.model_name}:{{pk}}"'
        )
    return template


@cache
def _template_pattern(template: str) -> re.Pattern[str]:
    parts: list[str] = []
    position = 0
    for placeholder in _PLACEHOLDER.finditer(template):
        parts.append(re.escape(template[position : placeholder.start()]))
        parts.append(f"(?P<{placeholder.group(1)}>[^:]+)")
        position = placeholder.end()
    parts.append(re.escape(template[position:]))
    return re.compile("".join(parts))


Grants = Lease | Mapping[str, Lease] | Iterable[Lease]
"""What ``fence()`` takes as its grant: one lease, or several (a list, or the
``{key: lease}`` dict of :func:`coordination.locks.acquire_many`)."""


@overload
def fence(  # type: ignore[overload-overlap]  # a str is also a Sequence[str]
    resource: str, grant: Grants | None = None, *, step: int | None = None,
    using: str | None = None, idle_timeout: float | None = None,
    key_check: Callable[[str], None] | None = None,
) -> AbstractContextManager[Fence]: ...


@overload
def fence(
    resource: Sequence[str],
    grant: Grants | None = None,
    *,
    step: int | None = None,
    using: str | None = None,
    idle_timeout: float | None = None,
    key_check: Callable[[str], None] | None = None,
) -> AbstractContextManager[list[Fence]]: ...


def fence(
    resource: str | Sequence[str],
    grant: Grants | None = None,
    *,
    step: int | None = None,
    using: str | None = None,
    idle_timeout: float | None = None,
    key_check: Callable[[str], None] | None = None,
) -> AbstractContextManager[Any]:
    """Guard a side effect with the named Fence row(s), inside one transaction.

    On entry, locks the Fence row(s) (created on first use, guarded by
    ``grant``'s lock key) with ``SELECT ... FOR UPDATE`` in resource-name order,
    so several resources in one transaction never deadlock; checks the grant's
    (token, step) against each watermark and raises the watermark. The block runs
    inside the same transaction: database writes in it commit together with the
    new watermark, or not at all. Yields the Fence (a list for several).

    ``grant`` may be several leases of different keys (a list, or the dict
    :func:`coordination.locks.acquire_many` returns), for resources guarded by
    different keys: each Fence row is checked with the lease of the key that
    guards it (rule 7 of docs/rules.md: tokens compare only within one key),
    and a row none of them guards is refused (``WrongLock``). A Fence row
    created on first use is guarded by the lease whose key is its name, or by
    the only lease; with several leases and none named like it, ``InvalidInput``
    (create the Fence row first, naming its ``lock_key``). Without ``step``,
    each lease numbers its write with its own next step.

    Refusals raise ``StaleToken``, ``DuplicateWrite``, ``WrongLock`` (the fence is
    guarded by another key) or ``LeaseLost``, before the block runs; with several
    leases, the first refused row (in resource-name order) is reported and
    nothing is written.

    The Fence rows stay locked until the transaction ends, so a holder that
    pauses inside the block (GC, SIGSTOP, a VM pause) or hangs there blocks
    every newer holder of the resource, however long ago its lease ended.
    ``idle_timeout`` (default ``COORDINATION["FENCE_IDLE_TIMEOUT"]``; None
    leaves the server's own setting) bounds that on PostgreSQL: once the
    transaction has waited that many seconds for its holder's next statement,
    the server ends the holder's session, which rolls the whole block back and
    frees the rows. The holder then gets ``LeaseLost`` (its write did not
    happen) from its next statement or from the commit. Statements that run
    for long are not idle: the bound is on the pauses between them. Keep it
    above the longest pause a live holder makes inside the block (a call to
    another service, say). SQLite has no such bound: a paused writer there
    holds the database's write lock.

    ``key_check(lock_key)`` runs for each Fence row once it is locked, before
    its watermark is compared: whatever it raises is raised, the transaction
    rolls back (a row created on first use with it) and no rejection is
    recorded. The REST API refuses there a row guarded by a key outside the
    writer's access rules, so that neither the key nor its watermark reaches
    the writer, however the writer raced the row's first write.
    """
    names = [resource] if isinstance(resource, str) else sorted(set(resource))
    if not names:
        raise InvalidInput("fence() needs at least one resource name")
    for name in names:
        validate_key(name, what="resource")
    return _fenced_block(
        names, grant, step, using or app_settings.DATABASE, isinstance(resource, str),
        idle_timeout=_idle_bound(idle_timeout), key_check=key_check,
    )


async def afence(
    resource: str | Sequence[str],
    operation: Callable[[Any], T] | None = None,
    grant: Grants | None = None,
    *,
    step: int | None = None,
    using: str | None = None,
    idle_timeout: float | None = None,
) -> T | None:
    """``fence()`` for async code: ``operation(fence)`` runs inside the fence's transaction.

    The same check as :func:`fence` (the Fence row(s) locked, the grant's
    (token, step) checked against each watermark and raised) and the same
    refusals, raised before ``operation`` runs. ``operation`` is a plain
    function that receives the Fence (a list for several) and makes the
    side effect's database writes; it runs on the app's thread pool, inside
    the fence's transaction, and its result is returned. Its writes commit
    together with the new watermark, or not at all.

    Why not ``async with``: the transaction lives on one thread's connection,
    and an async block's ORM calls run on other threads (other connections),
    outside it; a transaction held open across the event loop's awaits would
    also hold the fence's row lock for as long as the slowest await.
    """
    leases = _resolve_grants(grant)
    steps = {id(lease): _resolve_step(lease, step) for lease in leases}
    bound = _idle_bound(idle_timeout)

    def run() -> T | None:
        with _fenced_block(
            [resource] if isinstance(resource, str) else sorted(set(resource)),
            leases, None, using or app_settings.DATABASE, isinstance(resource, str), steps,
            idle_timeout=bound,
        ) as row:
            return None if operation is None else operation(row)

    if not resource:
        raise InvalidInput("fence() needs at least one resource name")
    for name in [resource] if isinstance(resource, str) else resource:
        validate_key(name, what="resource")
    return await aio.run_sync(run)


def _resolve_grants(grant: Grants | None) -> list[Lease]:
    """The leases of ``grant``: one, or several of distinct keys."""
    if grant is None or isinstance(grant, Lease):
        return [_resolve_grant(grant)]
    leases = list(grant.values()) if isinstance(grant, Mapping) else list(grant)
    if not leases:
        raise InvalidInput("fence() needs at least one grant")
    keys = [lease.key for lease in leases]
    if len(set(keys)) != len(keys):
        raise InvalidInput("fence() takes at most one grant per lock key")
    return [_resolve_grant(lease) for lease in leases]


@contextmanager
def _fenced_block(
    names: list[str],
    grant: Grants | list[Lease] | None,
    step: int | None,
    alias: str,
    single: bool,
    steps: dict[int, int] | None = None,
    *,
    idle_timeout: float | None = None,
    key_check: Callable[[str], None] | None = None,
) -> Iterator[Any]:
    leases = _resolve_grants(grant)
    by_key = {lease.key: lease for lease in leases}
    if steps is None:
        steps = {id(lease): _resolve_step(lease, step) for lease in leases}
    for lease in leases:
        if lease.lost:
            _refuse(
                LeaseLost(f"the lease of {lease.key!r} token {lease.token} was lost; not writing"),
                resource=names[0], grant=lease, step=steps[id(lease)],
                reason=RejectionReason.LEASE_LOST, using=alias,
            )
    refused: tuple[Fence, Lease, RejectionReason, CoordinationError] | None = None
    with _idle_bounded(alias, idle_timeout), transaction.atomic(using=alias):
        if idle_timeout is not None:
            _set_idle_timeout(alias, idle_timeout)
        rows = _locked_fences(names, _new_fence_keys(names, by_key), alias)
        if key_check is not None:
            # Under the row lock: the key read here is the one the write would meet.
            for row in rows:
                key_check(row.lock_key)
        for row in rows:
            guarding = by_key.get(row.lock_key)
            if guarding is None:
                error: CoordinationError = WrongLock(
                    f"fence {row.resource!r} is guarded by lock {row.lock_key!r}, "
                    f"not {' or '.join(repr(key) for key in by_key)}"
                )
                refused = (row, leases[0], RejectionReason.WRONG_LOCK, error)
                break
            lease = guarding
            refusal = _refusal(row.resource, lease.token, steps[id(lease)], row.token, row.step)
            if refusal is not None:
                refused = (row, lease, *refusal)
                break
        if refused is None:
            for lease in leases:
                guarded = [row for row in rows if row.lock_key == lease.key]
                if not guarded:
                    continue
                write_step = steps[id(lease)]
                Fence.objects.using(alias).filter(pk__in=[row.pk for row in guarded]).update(
                    token=lease.token, step=write_step, updated_at=DatabaseNow()
                )
                for row in guarded:
                    row.token, row.step = lease.token, write_step
                    signals.write_accepted.send(
                        sender=Fence, resource=row.resource, grant=lease, step=write_step
                    )
            yield rows[0] if single else rows
            return
    # Refused: the transaction above changed nothing but new, empty fence rows.
    row, lease, reason, error = refused
    _refuse(
        error, resource=row.resource, grant=lease, step=steps[id(lease)], reason=reason,
        watermark=(row.token, row.step), using=alias,
    )


def _idle_bound(seconds: float | None) -> float | None:
    """The idle bound of a fence() transaction: ``seconds``, else the setting."""
    value = app_settings.FENCE_IDLE_TIMEOUT if seconds is None else seconds
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < 10**6:
        raise InvalidInput(f"idle_timeout must be a number of seconds > 0, not {value!r}")
    return float(value)


def _set_idle_timeout(alias: str, seconds: float) -> None:
    """PostgreSQL: end this transaction's session once it idles ``seconds`` between
    statements (``SET LOCAL``: the transaction's alone, reset by its end)."""
    connection = connections[alias]
    if connection.vendor != "postgresql":
        return
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT set_config('idle_in_transaction_session_timeout', %s, true)",
            [f"{max(1, round(seconds * 1000))}ms"],
        )


@contextmanager
def _idle_bounded(alias: str, seconds: float | None) -> Iterator[None]:
    """Turn the server ending an idle fence transaction into ``LeaseLost``."""
    try:
        yield
    except DatabaseError as error:
        if seconds is None or not _ended_for_idling(error):
            raise
        connections[alias].close()  # the server closed it; Django's handle is unusable
        raise LeaseLost(
            f"the fence's transaction sat idle for more than {seconds:g} s (a paused or hung "
            "holder), so the database ended it: nothing in it was written"
        ) from error


def _ended_for_idling(error: BaseException) -> bool:
    """Whether ``error`` (or its cause) says the server ended an idle transaction's session.

    The server sends SQLSTATE 25P03 before it closes the connection; a client
    that wakes up later may instead only see the connection gone."""
    seen: BaseException | None = error
    while seen is not None:
        if getattr(seen, "sqlstate", None) == "25P03" or "idle-in-transaction" in str(seen):
            return True
        seen = seen.__cause__
    return False


def _new_fence_keys(names: list[str], by_key: Mapping[str, Lease]) -> Callable[[str], str]:
    """Which lock key guards a Fence row ``fence()`` creates: the only lease's, or
    the key named like the resource."""
    only = next(iter(by_key)) if len(by_key) == 1 else None

    def key_of(name: str) -> str:
        if only is not None:
            return only
        if name in by_key:
            return name
        raise InvalidInput(
            f"fence {name!r} does not exist yet and none of the grants' keys "
            f"({', '.join(sorted(by_key))}) is its name: create it first with its lock_key"
        )

    return key_of


def _locked_fences(names: list[str], key_of: Callable[[str], str], alias: str) -> list[Fence]:
    rows = Fence.objects.using(alias).select_for_update().filter(resource__in=names)
    found = list(rows.order_by("resource"))
    if len(found) < len(names):
        existing = {row.resource for row in found}
        Fence.objects.using(alias).bulk_create(
            [Fence(resource=name, lock_key=key_of(name)) for name in names if name not in existing],
            ignore_conflicts=True,
        )
        found = list(rows.order_by("resource"))
    return found


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
        records.bulk_create([IdempotencyRecord(key=key)], ignore_conflicts=True)
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


def record_rejection(
    *,
    resource: str,
    grant: Lease,
    step: int,
    reason: RejectionReason,
    watermark: tuple[int, int] | None = None,
    using: str | None = None,
) -> Rejection:
    """Record a refused write so that it survives the refused transaction.

    Outside a transaction it commits at once. Inside the caller's transaction
    (the same check as the grant point's) it is written through a second
    connection, so the caller's rollback cannot erase it; SQLite allows one
    writer, and the caller's transaction is it: there the record commits with
    the caller's transaction (the backend decides, see
    :meth:`~coordination.backends.base.GrantPoint.save_surviving_rollback`).
    """
    alias = using or app_settings.DATABASE
    rejection = Rejection(
        resource=resource[: Rejection._meta.get_field("resource").max_length],
        lock_key=grant.key,
        token=grant.token,
        step=step,
        watermark_token=watermark[0] if watermark else None,
        watermark_step=watermark[1] if watermark else None,
        reason=reason,
        holder=grant.holder,
    )
    get_backend(alias).save_surviving_rollback(rejection)
    # key=value for log search; the same fields under record.coordination for
    # JSON formatters (one attribute, so no clash with LogRecord's own names).
    logger.warning(
        "write refused %s",
        LogFields(
            reason=reason, resource=resource, key=grant.key, token=grant.token, step=step,
            holder=grant.holder, watermark_token=rejection.watermark_token,
            watermark_step=rejection.watermark_step,
        ),
        extra={
            "coordination": {
                "event": "write_refused", "reason": str(reason), "resource": resource,
                "key": grant.key, "token": grant.token, "step": step, "holder": grant.holder,
                "watermark_token": rejection.watermark_token,
                "watermark_step": rejection.watermark_step,
            }
        },
    )
    signals.write_rejected.send(sender=Rejection, rejection=rejection)
    return rejection


class WatermarkRaise(NamedTuple):
    """What :func:`raise_fence_to_lock` did to one fence: watermarks as (token, step)."""

    resource: str
    lock_key: str
    before: tuple[int, int]
    after: tuple[int, int]

    @property
    def raised(self) -> bool:
        return self.after > self.before


def raise_fence_to_lock(
    fence: Fence | str, *, step: int = 0, using: str | None = None
) -> WatermarkRaise:
    """Raise a fence's watermark to the last token its lock has issued; never lower it.

    For after a restore from backup (rule 8 of docs/rules.md): a restored watermark can be
    older than tokens already issued and used, and writes of those tokens would
    be accepted again. Afterwards every token below the lock's last one is
    refused as stale. Where the token floor (:class:`~coordination.models.TokenFloor`)
    is above the lock's counter, the floor counts as its last token: no grant
    is issued a token at or below it any more, and a key first granted after
    the lock database's backup has no counter to go by. The last token itself
    still writes steps above ``step`` (default 0: its holder may be mid-work);
    pass ``step=MAX_TOKEN`` to refuse it too, so that only a new grant can
    write. A watermark already at or above (last token, ``step``) is left as it
    is. The fence row is locked while deciding, as for a write. Raises
    ``Fence.DoesNotExist`` for an unknown resource.
    """
    resource = fence if isinstance(fence, str) else fence.resource
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= MAX_TOKEN:
        raise InvalidInput(f"step must be an integer from 0 to {MAX_TOKEN}")
    alias = using or app_settings.DATABASE
    with transaction.atomic(using=alias):
        row = Fence.objects.using(alias).select_for_update().get(resource=resource)
        issued = max(
            Lock.objects.using(alias).filter(key=row.lock_key).values_list("token", flat=True).first()
            or 0,
            TokenFloor.objects.using(alias).value(),
        )
        before = (row.token, row.step)
        after = max(before, (issued, step))
        if after > before:
            # updated_at stays: it is the time of the last accepted write.
            Fence.objects.using(alias).filter(pk=row.pk).update(token=after[0], step=after[1])
    if after > before:
        logger.warning(
            "fence raised %s",
            LogFields(
                resource=row.resource, key=row.lock_key, token_before=before[0],
                step_before=before[1], token=after[0], step=after[1],
            ),
        )
    if not isinstance(fence, str):
        fence.token, fence.step = after
    return WatermarkRaise(row.resource, row.lock_key, before, after)


# --- helpers ------------------------------------------------------------------


def _explain_refusal(
    error: IntegrityError, rows: models.QuerySet[Any, Any], values: Mapping[str, Any]
) -> CoordinationError | None:
    """The error to raise for an UPDATE of ``rows`` setting ``values`` that a watermark
    trigger refused, or None if ``error`` is not such a refusal.

    PostgreSQL's refusal names the row and both watermarks. SQLite's names only
    the table, so the rows are read again with the values the UPDATE would have
    set, to find the one refused.
    """
    model: Any = rows.model
    refusal = watermarks.refusal(error)
    # The watermark's table: a multi-table child keeps it in its parent's.
    if refusal is None or refusal.table != model._meta.get_field("fence").model._meta.db_table:
        return None
    label = model._meta.label_lower
    old: tuple[int, ...]
    new: tuple[int, ...]
    if refusal.old is None:
        found = _refused_row(rows, values, refusal.strict)
        if found is None:
            return None
        pk, old, new = found
    else:
        pk, old, new = refusal.pk, refusal.old, refusal.new or refusal.old
    if len(old) != 2 or len(new) != 2:
        return None
    resource = f"{label}:{pk}"
    if refusal.strict:
        return UnfencedWrite(resource, old[0], old[1])
    # Classified as a fenced write's refusal is: a lower token is stale, a
    # lower step of the same token a duplicate.
    explained = _refusal(resource, new[0], new[1], old[0], old[1])
    return None if explained is None else explained[1]


def _refused_row(
    rows: models.QuerySet[Any, Any], values: Mapping[str, Any], strict: bool
) -> tuple[Any, tuple[int, int], tuple[int, int]] | None:
    """(pk, watermark, the watermark the UPDATE would have set) of the first row the
    trigger refuses: one it would lower, or with ``strict`` one it would leave as is."""
    new: dict[str, Any] = {}
    for name in ("fence", "fence_step"):
        value = values.get(name, F(name))
        if not hasattr(value, "resolve_expression"):
            value = Value(value, output_field=models.BigIntegerField())
        new[f"_coordination_new_{name}"] = value
    with watermarks.readable_after_refusal(rows.db):
        try:
            found = list(
                rows.annotate(**new).values_list("pk", "fence", "fence_step", *new)
            )
        except DatabaseError:  # pragma: no cover  (the explanation is best effort)
            return None
    for pk, fence, step, new_fence, new_step in found:
        if (new_fence, new_step) < (fence, step) or (strict and (new_fence, new_step) == (fence, step)):
            return pk, (fence, step), (new_fence, new_step)
    return None


def _refusal(
    resource: str, token: int, step: int, current: int, current_step: int
) -> tuple[RejectionReason, CoordinationError] | None:
    """Why (token, step) is not above the watermark (current, current_step), if it is not."""
    if token < current:
        return RejectionReason.STALE, StaleToken(resource, token, current, current_step)
    if token == current and step <= current_step:
        return RejectionReason.DUPLICATE, DuplicateWrite(resource, token, step, current_step)
    return None


def _refuse(
    error: CoordinationError,
    *,
    resource: str,
    grant: Lease,
    step: int,
    reason: RejectionReason,
    watermark: tuple[int, int] | None = None,
    using: str,
) -> NoReturn:
    record_rejection(
        resource=resource, grant=grant, step=step, reason=reason, watermark=watermark, using=using
    )
    raise error


def _resolve_grant(grant: Lease | None) -> Lease:
    grant = grant if grant is not None else current_grant()
    if grant is None:
        raise NoGrant()
    token = grant.token
    if isinstance(token, bool) or not isinstance(token, int) or not 0 < token <= MAX_TOKEN:
        raise InvalidInput(f"token must be an integer from 1 to {MAX_TOKEN}")
    return grant


def _resolve_step(grant: Lease, step: int | None) -> int:
    if step is None:
        return grant.next_step()
    if isinstance(step, bool) or not isinstance(step, int) or not 0 < step <= MAX_TOKEN:
        raise InvalidInput(f"step must be an integer from 1 to {MAX_TOKEN}")
    return step
