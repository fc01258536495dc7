"""Watermarks the database itself keeps from going backwards (rule 8 of docs/rules.md).

Guarantee: on a table with a watermark (``(fence, fence_step)`` of every
concrete :class:`~coordination.fencing.FencedModel`, ``(token, step)`` of
``coordination_fence``, ``token`` of ``coordination_lock`` and of
``coordination_tokenfloor``) the database refuses an UPDATE that lowers it,
whatever sends it; a ``fence_strict`` table also refuses one that leaves it
where it is; a FencedModel row deleted and inserted again with its primary key
starts at its old watermark (a tombstone in ``coordination_tombstone``). The
triggers are each backend's (``Dialect.watermark_triggers``); ``migrate``
installs them (migrations 0007 and 0008, and
:func:`coordination.backends.triggers.install_after_migrate` after every
``migrate``, which changes only what differs).

Failure modes: a refusal is an ``IntegrityError`` whose constraint name says
which rule refused (:data:`NOT_LOWERED`, :data:`MUST_RISE`; :func:`refusal`
reads it). ``TRUNCATE`` fires no DELETE trigger and keeps no tombstone. A
database whose backend has no triggers raises ``WatermarksNotEnforced`` on
installing them (:mod:`coordination.backends.triggers`). How the rules read for users: docs/rules.md and
docs/operations-tools.md.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from django.core.exceptions import FieldDoesNotExist
from django.db import connections, models, transaction
from django.db.backends.utils import truncate_name
from django.db.models import F

from coordination.exceptions import RETIRED_STEP

from .models import Fence, Lock, TokenFloor

__all__ = [
    "HIGHEST_STEP",
    "KEPT",
    "MUST_RISE",
    "NOT_LOWERED",
    "RESTORED",
    "Refusal",
    "Watermark",
    "WatermarkField",
    "WatermarkTriggers",
    "refusal_in_message",
    "rows_are_fences",
    "watermarks_of",
]

# The constraint names a refusal carries: which rule refused the UPDATE.
NOT_LOWERED = "coordination_watermark_not_lowered"
MUST_RISE = "coordination_watermark_must_rise"
# A refusal's message where the trigger cannot format one from the row
# (SQLite's RAISE takes a literal, MariaDB's SIGNAL a fixed string): it names
# the table, and the ORM reads the row's watermark afterwards.
NOT_LOWERED_MESSAGE = (
    "{constraint}: UPDATE of {table} would lower the watermark ({columns}); "
    "watermarks never go backwards (rule 8 of docs/rules.md)"
)
MUST_RISE_MESSAGE = (
    "{constraint}: UPDATE of {table} leaves the watermark ({columns}) where it is; the table "
    "is fenced strictly, so every UPDATE must raise it (fenced_update or fenced_save)"
)
# The tombstone triggers of a FencedModel table: the watermark of a deleted row
# kept, and restored to a row inserted again with its primary key.
KEPT = "coordination_watermark_kept"
RESTORED = "coordination_watermark_restored"

TOMBSTONES = "coordination_tombstone"
# A restored row's step: every write of the deleted row's token is refused.
HIGHEST_STEP = RETIRED_STEP

_MESSAGE = re.compile(rf"({NOT_LOWERED}|{MUST_RISE}): UPDATE of (\S+)")
# The rules whose triggers refuse an UPDATE; every rule, in the order installed.
_RULES = (NOT_LOWERED, MUST_RISE)
ALL_RULES = (NOT_LOWERED, MUST_RISE, KEPT, RESTORED)


@dataclass(frozen=True)
class Watermark:
    """A table whose watermark (one or more columns, compared as a row) never goes back."""

    table: str
    pk_column: str
    columns: tuple[str, ...]
    strict: bool = False
    tombstones: bool = False
    """Whether a deleted row's watermark is kept for a row inserted again (FencedModels)."""

    @classmethod
    def of(
        cls, model: type[models.Model], *fields: str, strict: bool = False,
        tombstones: bool = False,
    ) -> Watermark:
        """The watermark of ``model`` (a current or a migration's historical model)."""
        meta = model._meta
        return cls(
            table=meta.db_table,
            pk_column=str(meta.pk.column),
            columns=tuple(str(meta.get_field(name).column) for name in fields),  # type: ignore[union-attr]
            strict=strict,
            tombstones=tombstones,
        )

    def rules(self) -> tuple[str, ...]:
        refusals = _RULES if self.strict else (NOT_LOWERED,)
        return (*refusals, KEPT, RESTORED) if self.tombstones else refusals


@dataclass(frozen=True)
class Refusal:
    """An UPDATE a watermark trigger refused, as far as the error tells.

    ``pk``, ``old`` and ``new`` are known on PostgreSQL; SQLite's message names
    only the rule and the table.
    """

    constraint: str
    table: str
    pk: Any = None
    old: tuple[int, ...] | None = None
    new: tuple[int, ...] | None = None

    @property
    def strict(self) -> bool:
        return self.constraint == MUST_RISE


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


def rows_are_fences(model: type[models.Model]) -> bool:
    """Whether ``model``'s rows are their own fences: its ``fence`` and ``fence_step``
    are watermark columns (a :class:`~coordination.fencing.FencedModel`)."""
    meta = model._meta
    try:
        return all(isinstance(meta.get_field(name), WatermarkField) for name in ("fence", "fence_step"))
    except FieldDoesNotExist:
        return False


def watermarks_of(candidates: Iterable[type[models.Model]]) -> list[Watermark]:
    """The watermarks among these models: Lock, TokenFloor, Fence and concrete
    FencedModels (one per table)."""
    found: dict[str, Watermark] = {}
    for model in candidates:
        meta = model._meta
        if meta.abstract or meta.proxy or not meta.managed:
            continue
        if issubclass(model, (Lock, TokenFloor)):
            fields: tuple[str, ...] = ("token",)
        elif issubclass(model, Fence):
            fields = ("token", "step")
        elif rows_are_fences(model):
            fields = ("fence", "fence_step")
        else:
            continue
        # A multi-table child keeps its watermark in its parent's table.
        owner: Any = meta.get_field(fields[0]).model
        if owner._meta.db_table not in found:
            strict = bool(getattr(owner, "fence_strict", False))
            found[owner._meta.db_table] = Watermark.of(
                owner, *fields, strict=strict, tombstones=rows_are_fences(model)
            )
    return list(found.values())


def refusal_in_message(error: BaseException) -> Refusal | None:
    """What a watermark trigger refused, read from ``error``'s message (which each
    backend's trigger starts with the rule and the table); None if it is no
    refusal. The backends read more where their errors carry it
    (``Dialect.watermark_refusal``)."""
    # A driver whose error is (errno, message) keeps the message second.
    args: tuple[Any, ...] = getattr(error, "args", ())
    found = _MESSAGE.match(str(args[1]) if len(args) == 2 else str(error))
    if found is None:
        return None
    return Refusal(found.group(1), found.group(2))


@contextmanager
def readable_after_refusal(using: str) -> Iterator[None]:
    """Let the caller read the database right after a refused UPDATE, to say why.

    Needed on SQLite, whose refusal does not carry the row's watermark: its
    RAISE(ABORT) undid the statement and left the transaction usable, but
    Django marked an enclosing atomic block for rollback. The mark is lifted for
    the read and set again, so the caller's transaction still rolls back.
    (A refused transaction on PostgreSQL cannot be read, and need not be.)
    """
    connection = connections[using]
    marked = connection.in_atomic_block and connection.needs_rollback
    if marked:
        transaction.set_rollback(False, using=using)
    try:
        yield
    finally:
        if marked:
            transaction.set_rollback(True, using=using)


# --- what a backend implements -------------------------------------------------------


class WatermarkTriggers:
    """A database's watermark triggers: the DDL of each rule's trigger, and what the
    database holds now. One subclass per backend (``coordination.backends``);
    the helpers here are the SQL every database shares."""

    restores_before_insert = False
    """Whether the tombstone trigger changes an inserted row before it is written,
    so that ``INSERT ... RETURNING`` reads the restored watermark."""

    def __init__(self, connection: Any) -> None:
        self.connection = connection
        self.quote = connection.ops.quote_name

    def trigger_name(self, watermark: Watermark, rule: str) -> str:
        name = f"{watermark.table}_watermark_{rule.removeprefix('coordination_watermark_')}"
        return truncate_name(name, self.connection.ops.max_name_length())

    def condition(self, watermark: Watermark, rule: str) -> str:
        new, old = (
            ", ".join(f"{row}.{self.quote(column)}" for column in watermark.columns)
            for row in ("NEW", "OLD")
        )
        if len(watermark.columns) > 1:
            new, old = f"({new})", f"({old})"
        return f"{new} {'<' if rule == NOT_LOWERED else '='} {old}"

    def of(self, watermark: Watermark, rule: str) -> str:
        # The lowering can only come from an UPDATE that sets a watermark column;
        # a strict table refuses any UPDATE, whatever it sets.
        if rule == MUST_RISE:
            return ""
        return " OF " + ", ".join(self.quote(column) for column in watermark.columns)

    def row(self, prefix: str, watermark: Watermark) -> str:
        """The watermark columns of ``prefix`` (NEW, OLD or a table) as a row value."""
        dot = f"{prefix}." if prefix else ""
        return "(" + ", ".join(f"{dot}{self.quote(column)}" for column in watermark.columns) + ")"

    def trigger(self, watermark: Watermark, rule: str) -> str:
        """The statement that creates ``rule``'s trigger on ``watermark``'s table."""
        raise NotImplementedError

    def existing(self, cursor: Any, table: str) -> dict[str, str]:
        """Each watermark trigger on ``table``: name -> fingerprint of its definition."""
        raise NotImplementedError

    def create(self, cursor: Any, watermark: Watermark, name: str, sql: str) -> None:
        """Run ``sql`` (a :meth:`trigger`), with whatever the trigger needs first,
        and keep its fingerprint where :meth:`existing` finds it."""
        raise NotImplementedError

    def drop(self, cursor: Any, watermark: Watermark, name: str) -> None:
        """Drop the trigger ``name`` if it exists."""
        raise NotImplementedError


def fingerprint(sql: str) -> str:
    """What identifies a trigger's definition: kept with it, compared by :func:`install`."""
    return "coordination " + hashlib.sha256(sql.encode()).hexdigest()[:16]


def sql_literal(value: str) -> str:
    """``value`` as an SQL string literal."""
    return "'" + value.replace("'", "''") + "'"
