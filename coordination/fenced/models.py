"""Models whose rows are their own fences, and the watermark field that
``save()`` never lowers."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from functools import cache
from typing import Any, ClassVar, cast

from django.core.exceptions import FieldDoesNotExist
from django.db import IntegrityError, connections, models, router, transaction
from django.db.models import Q

from ..backends import triggers
from ..exceptions import InvalidInput, StaleInstance, shown_step
from ..leases import Lease
from ..logfields import LogFields
from ..models import UnfencedSave
from ..watermarks import WatermarkField
from .conditions import NotAbove
from .grants import resolve_grant, resolve_step
from .keys import lock_key_of
from .queryset import FencedQuerySet
from .rejections import explain_refusal
from .unfenced import active_override

# The resource side's documented logger, whichever of its modules logs.
logger = logging.getLogger("coordination.fencing")


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
            refused = explain_refusal(error, rows, {})
            if refused is None:
                raise
            raise refused from error

    def refresh_from_db(
        self, using: str | None = None, fields: Any = None, from_queryset: Any = None
    ) -> None:
        """Django's ``refresh_from_db()``; with ``fields``, the watermark is reloaded
        too. If it moved (a newer write changed the row since it was loaded), the
        fields not reloaded are forgotten, loaded afresh on first use: the next
        ``save()`` is checked against the row as it is now and writes no value
        the newer write replaced."""
        if fields is None:
            super().refresh_from_db(using=using, from_queryset=from_queryset)
            return
        asked = list(fields)
        before = self.carried_watermark()
        extra = [name for name in ("fence", "fence_step") if name not in asked]
        super().refresh_from_db(using=using, fields=[*asked, *extra], from_queryset=from_queryset)
        if self.carried_watermark() == before:
            return
        reloaded = {*asked, "fence", "fence_step"}
        for field in self._meta.concrete_fields:
            if not field.primary_key and field.name not in reloaded and field.attname not in reloaded:
                self.__dict__.pop(field.attname, None)

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
        guarded = base_qs.filter(NotAbove(token, step))
        updated = super()._do_update(
            guarded, using, pk_val, values, update_fields, forced_update, *args
        )
        if updated:
            return _returned(updated, base_qs.filter(pk=pk_val), args)
        current = base_qs.filter(pk=pk_val).values_list("fence", "fence_step").first()
        if current is None or current <= (token, step):
            return updated  # no row (or one inserted since): Django's own path
        resource = f"{self._meta.label_lower}:{pk_val}"
        override = active_override.get()
        if override is None:
            logger.warning(
                "save refused %s",
                LogFields(
                    reason="stale_instance", resource=resource, token=token, step=step,
                    watermark_token=current[0], watermark_step=shown_step(current[1]),
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
            return _returned(updated, base_qs.filter(pk=pk_val), args)
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
            triggers.insert_returns_restored(connection)
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
        _check_fields(type(self), fields)
        grant = resolve_grant(grant)
        write_step = resolve_step(grant, step)
        manager = type(self)._default_manager.using(self._state.db)
        manager.filter(pk=self.pk).fenced_update(
            grant, step=write_step, **{name: getattr(self, name) for name in fields}
        )
        self.fence, self.fence_step = grant.token, write_step


def _check_fields(model: type[models.Model], fields: Sequence[str]) -> None:
    """``fenced_save``'s ``fields`` name concrete fields of ``model`` (their names or
    attnames, ``customer`` or ``customer_id``), as ``save(update_fields=...)``
    asks, or ``InvalidInput`` names the others before anything is written."""
    if isinstance(fields, str):
        raise InvalidInput(
            f"fenced_save(fields=...) takes a list of field names, not a string: fields=[{fields!r}]"
        )
    known = {name for field in model._meta.concrete_fields for name in (field.name, field.attname)}
    unknown = [name for name in fields if name not in known]
    if unknown:
        raise InvalidInput(
            f"fenced_save(fields=...): {model._meta.label} has no concrete field named "
            f"{', '.join(map(repr, unknown))} (its fields: {', '.join(sorted(known))})"
        )


def _returned(updated: Any, row: models.QuerySet[Any], args: tuple[Any, ...]) -> Any:
    """What Django 6's ``save()`` reads back from the UPDATE (``RETURNING``), read
    from the row where the database cannot return it (MariaDB): without it the
    watermark columns, set to themselves, would be left unloaded, and the
    instance's next ``save()`` refused as stale."""
    returning_fields = args[0] if args else None
    if not returning_fields or any(len(found) for found in updated):
        return updated
    values = row.values_list(*(field.attname for field in returning_fields)).first()
    return [values] if values is not None else updated


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
