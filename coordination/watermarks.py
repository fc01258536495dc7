"""Watermarks the database itself keeps from going backwards (rule 8 of docs/rules.md).

A fenced write only ever raises a watermark, but a row can be written by other
paths too: a stale instance's ``save()``, ``update()``, ``bulk_update()``, the
admin, raw SQL. So the database refuses the lowering itself, with a ``BEFORE
UPDATE`` trigger per table:

- ``<table>_watermark_not_lowered`` refuses an UPDATE that lowers the
  watermark, compared as a row: ``(fence, fence_step)`` of every concrete
  :class:`~coordination.fencing.FencedModel`, ``(token, step)`` of
  ``coordination_fence``, ``token`` of ``coordination_lock`` (the counter) and
  of ``coordination_tokenfloor`` (the token floor, below which no key is
  issued a token).
- ``<table>_watermark_must_rise``, only on a FencedModel with
  ``fence_strict = True``, refuses an UPDATE that leaves the watermark where it
  is: every write of such a table must go through ``fenced_update()`` or
  ``fenced_save()``, so no unfenced write slips through.

A deleted row must not come back below its watermark either: on every
FencedModel table two more triggers keep it in ``coordination_tombstone``
(:class:`~coordination.models.Tombstone`), by table and primary key:

- ``<table>_watermark_kept``, after a DELETE of a row whose watermark is above
  (0, 0), records the watermark there (raising a tombstone already there,
  never lowering it);
- ``<table>_watermark_restored`` starts a row inserted with a tombstone's
  primary key at (its token, the highest step), so every token up to the
  deleted row's is refused, and only a newer grant writes the row again.
  An insert that names a higher watermark keeps its own.

``TRUNCATE`` fires no DELETE trigger (PostgreSQL): it is how tests empty
tables, not a way to delete fenced rows. The app never deletes Fence rows, and
deletes a Lock row only by pruning, after raising the token floor above its
counter: neither has tombstones.

``migrate`` installs them: migrations 0007 and 0008 for the app's own tables, and a
``post_migrate`` receiver (:func:`install_after_migrate`) for every concrete
FencedModel table on the migrated database, the user's apps included. The
receiver runs after every ``migrate``: SQLite rebuilds a table on most schema
changes and drops its triggers, and a model switched to or from
``fence_strict`` gets its triggers replaced there. It changes only what
differs, so a second ``migrate`` touches nothing.

A refusal is an ``IntegrityError``. Its constraint name says which rule
refused it (:data:`NOT_LOWERED`, :data:`MUST_RISE`): on PostgreSQL in the
error's ``diag.constraint_name`` (SQLSTATE 23514, ``check_violation``), with
the table, primary key and both watermarks in the message and, as JSON, in
the detail; on SQLite at the start of the message. :func:`refusal` reads it;
the ORM paths of ``coordination.fencing`` turn it into ``StaleToken`` or
``UnfencedWrite``.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

from django.db import connections, models, router, transaction
from django.db.backends.utils import truncate_name

from coordination.exceptions import RETIRED_STEP

__all__ = [
    "HIGHEST_STEP",
    "KEPT",
    "MUST_RISE",
    "NOT_LOWERED",
    "RESTORED",
    "Refusal",
    "Watermark",
    "insert_returns_restored",
    "install",
    "install_after_migrate",
    "install_for_models",
    "missing",
    "refusal",
    "uninstall",
    "watermarks_of",
]

# The constraint names a refusal carries: which rule refused the UPDATE.
NOT_LOWERED = "coordination_watermark_not_lowered"
MUST_RISE = "coordination_watermark_must_rise"
# The tombstone triggers of a FencedModel table: the watermark of a deleted row
# kept, and restored to a row inserted again with its primary key.
KEPT = "coordination_watermark_kept"
RESTORED = "coordination_watermark_restored"

TOMBSTONES = "coordination_tombstone"
# A restored row's step: every write of the deleted row's token is refused.
HIGHEST_STEP = RETIRED_STEP

# --- PostgreSQL -----------------------------------------------------------------
#
# One function serves every trigger. It only runs when a trigger's WHEN clause
# has already decided to refuse, so it may take its time to say why: it reads
# the watermark and the primary key through to_jsonb(), named by the trigger's
# arguments (constraint, primary key column, watermark columns).
POSTGRESQL_FUNCTION = """
CREATE OR REPLACE FUNCTION coordination_refuse_watermark() RETURNS trigger
LANGUAGE plpgsql AS $fn$
DECLARE
    before jsonb := to_jsonb(OLD);
    after jsonb := to_jsonb(NEW);
    columns text[] := TG_ARGV[2:TG_NARGS - 1];
    old_mark jsonb;
    new_mark jsonb;
    old_shown text;
    new_shown text;
    shown text;
BEGIN
    SELECT jsonb_agg(before -> u.c ORDER BY u.n), jsonb_agg(after -> u.c ORDER BY u.n)
    INTO old_mark, new_mark FROM unnest(columns) WITH ORDINALITY AS u(c, n);
    -- Shown as the comparison reads them: 5, or the row (2, 1).
    old_shown := CASE WHEN TG_NARGS = 3 THEN old_mark ->> 0
        ELSE translate(old_mark::text, '[]', '()') END;
    new_shown := CASE WHEN TG_NARGS = 3 THEN new_mark ->> 0
        ELSE translate(new_mark::text, '[]', '()') END;
    shown := format('%s: UPDATE of %s pk %s', TG_ARGV[0], TG_TABLE_NAME, before ->> TG_ARGV[1]);
    RAISE EXCEPTION USING
        ERRCODE = 'check_violation',
        CONSTRAINT = TG_ARGV[0],
        SCHEMA = TG_TABLE_SCHEMA,
        TABLE = TG_TABLE_NAME,
        MESSAGE = CASE WHEN TG_ARGV[0] = 'coordination_watermark_must_rise' THEN format(
            '%s leaves the watermark (%s) at %s; the table is fenced strictly, so every '
            'UPDATE must raise it (fenced_update or fenced_save)',
            shown, array_to_string(columns, ', '), old_shown)
        ELSE format(
            '%s would lower the watermark (%s) from %s to %s; watermarks never go backwards '
            '(rule 8 of docs/rules.md)',
            shown, array_to_string(columns, ', '), old_shown, new_shown)
        END,
        DETAIL = jsonb_build_object(
            'table', TG_TABLE_NAME, 'pk', before -> TG_ARGV[1], 'columns', to_jsonb(columns),
            'old', old_mark, 'new', new_mark
        )::text;
END
$fn$
"""
POSTGRESQL_TRIGGER = (
    "CREATE TRIGGER {name} BEFORE UPDATE{of} ON {table} FOR EACH ROW "
    "WHEN ({condition}) EXECUTE FUNCTION coordination_refuse_watermark({arguments})"
)

# The tombstone functions take the primary key column and the two watermark
# columns as arguments, and read them through to_jsonb(): one function for
# every table. A row's primary key is kept as jsonb renders it as text, the
# same on delete and on insert.
POSTGRESQL_KEEP_FUNCTION = f"""
CREATE OR REPLACE FUNCTION coordination_keep_watermark() RETURNS trigger
LANGUAGE plpgsql AS $fn$
DECLARE
    before jsonb := to_jsonb(OLD);
BEGIN
    INSERT INTO {TOMBSTONES} AS kept (table_name, row_pk, fence, fence_step, deleted_at)
    VALUES (TG_TABLE_NAME, before ->> TG_ARGV[0], (before ->> TG_ARGV[1])::bigint,
            (before ->> TG_ARGV[2])::bigint, now())
    ON CONFLICT (table_name, row_pk) DO UPDATE
    SET fence = EXCLUDED.fence, fence_step = EXCLUDED.fence_step, deleted_at = EXCLUDED.deleted_at
    WHERE (EXCLUDED.fence, EXCLUDED.fence_step) > (kept.fence, kept.fence_step);
    RETURN NULL;
END
$fn$
"""
# BEFORE INSERT: the row is written with the restored watermark, which an
# INSERT ... RETURNING reads back.
POSTGRESQL_RESTORE_FUNCTION = f"""
CREATE OR REPLACE FUNCTION coordination_restore_watermark() RETURNS trigger
LANGUAGE plpgsql AS $fn$
DECLARE
    after jsonb := to_jsonb(NEW);
    kept bigint;
BEGIN
    SELECT t.fence INTO kept FROM {TOMBSTONES} t
    WHERE t.table_name = TG_TABLE_NAME AND t.row_pk = after ->> TG_ARGV[0];
    IF kept IS NOT NULL AND ((after ->> TG_ARGV[1])::bigint, (after ->> TG_ARGV[2])::bigint)
            < (kept, {HIGHEST_STEP}) THEN
        NEW := jsonb_populate_record(
            NEW, jsonb_build_object(TG_ARGV[1], kept, TG_ARGV[2], {HIGHEST_STEP})
        );
    END IF;
    RETURN NEW;
END
$fn$
"""
POSTGRESQL_KEEP_TRIGGER = (
    "CREATE TRIGGER {name} AFTER DELETE ON {table} FOR EACH ROW "
    "WHEN ({old} > (0, 0)) EXECUTE FUNCTION coordination_keep_watermark({arguments})"
)
POSTGRESQL_RESTORE_TRIGGER = (
    "CREATE TRIGGER {name} BEFORE INSERT ON {table} FOR EACH ROW "
    "EXECUTE FUNCTION coordination_restore_watermark({arguments})"
)
_POSTGRESQL_FUNCTIONS = {
    NOT_LOWERED: ("coordination_refuse_watermark", POSTGRESQL_FUNCTION),
    MUST_RISE: ("coordination_refuse_watermark", POSTGRESQL_FUNCTION),
    KEPT: ("coordination_keep_watermark", POSTGRESQL_KEEP_FUNCTION),
    RESTORED: ("coordination_restore_watermark", POSTGRESQL_RESTORE_FUNCTION),
}

# --- SQLite -----------------------------------------------------------------------
#
# RAISE(ABORT) undoes the whole statement (every row it changed) and keeps the
# transaction. Before SQLite 3.47 its message must be a literal, so it names
# the table but not the row: the ORM reads the row's watermark afterwards.
SQLITE_TRIGGER = (
    "CREATE TRIGGER {name} BEFORE UPDATE{of} ON {table} FOR EACH ROW "
    "WHEN {condition} BEGIN SELECT RAISE(ABORT, {message}); END"
)
SQLITE_NOT_LOWERED = (
    "{constraint}: UPDATE of {table} would lower the watermark ({columns}); "
    "watermarks never go backwards (rule 8 of docs/rules.md)"
)
SQLITE_MUST_RISE = (
    "{constraint}: UPDATE of {table} leaves the watermark ({columns}) where it is; the table "
    "is fenced strictly, so every UPDATE must raise it (fenced_update or fenced_save)"
)

# SQLite cannot change the row a BEFORE INSERT trigger sees: the restored
# watermark is written by an UPDATE right after the insert, in the same
# statement (so the UPDATE triggers check it too).
SQLITE_KEEP_TRIGGER = (
    "CREATE TRIGGER {name} AFTER DELETE ON {table} FOR EACH ROW WHEN {old} > (0, 0) BEGIN "
    f"INSERT INTO {TOMBSTONES} (table_name, row_pk, fence, fence_step, deleted_at) "
    "VALUES ({table_literal}, CAST(OLD.{pk} AS TEXT), {old_values}, "
    "STRFTIME('%Y-%m-%d %H:%M:%f', 'NOW')) "
    "ON CONFLICT (table_name, row_pk) DO UPDATE SET fence = excluded.fence, "
    "fence_step = excluded.fence_step, deleted_at = excluded.deleted_at "
    f"WHERE (excluded.fence, excluded.fence_step) > ({TOMBSTONES}.fence, {TOMBSTONES}.fence_step); "
    "END"
)
SQLITE_RESTORE_TRIGGER = (
    "CREATE TRIGGER {name} AFTER INSERT ON {table} FOR EACH ROW WHEN EXISTS ({kept}) BEGIN "
    "UPDATE {table} SET {columns} = ({kept_mark}) "
    "WHERE {pk} = NEW.{pk} AND {columns} < ({kept_mark}); END"
)

_MESSAGE = re.compile(rf"({NOT_LOWERED}|{MUST_RISE}): UPDATE of (\S+)")
# The rules whose triggers refuse an UPDATE; every rule, in the order installed.
_RULES = (NOT_LOWERED, MUST_RISE)
_ALL_RULES = (NOT_LOWERED, MUST_RISE, KEPT, RESTORED)


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


def watermarks_of(candidates: Iterable[type[models.Model]]) -> list[Watermark]:
    """The watermarks among these models: Lock, TokenFloor, Fence and concrete
    FencedModels (one per table)."""
    from .fencing import FencedModel
    from .models import Fence, Lock, TokenFloor

    found: dict[str, Watermark] = {}
    for model in candidates:
        meta = model._meta
        if meta.abstract or meta.proxy or not meta.managed:
            continue
        if issubclass(model, (Lock, TokenFloor)):
            fields: tuple[str, ...] = ("token",)
        elif issubclass(model, Fence):
            fields = ("token", "step")
        elif issubclass(model, FencedModel):
            fields = ("fence", "fence_step")
        else:
            continue
        # A multi-table child keeps its watermark in its parent's table.
        owner: Any = meta.get_field(fields[0]).model
        if owner._meta.db_table not in found:
            strict = bool(getattr(owner, "fence_strict", False))
            found[owner._meta.db_table] = Watermark.of(
                owner, *fields, strict=strict, tombstones=issubclass(model, FencedModel)
            )
    return list(found.values())


def install(connection: Any, watermarks: Iterable[Watermark]) -> list[str]:
    """Create, replace or drop triggers on ``connection`` until they are exactly these.

    For each watermark: its rules' triggers exist as this version defines them,
    and a strict trigger of a table that is no longer strict is dropped. A
    trigger already as defined is left alone, so a second call changes nothing
    and takes no lock. Runs in one transaction. Returns the names of the
    triggers created or dropped. Other databases than PostgreSQL and SQLite are
    left as they are.
    """
    backend = _backend(connection)
    if backend is None:
        return []
    changed: list[str] = []
    with transaction.atomic(using=connection.alias), connection.cursor() as cursor:
        for watermark in watermarks:
            existing = backend.existing(cursor, watermark.table)
            for rule in _ALL_RULES:
                name = backend.trigger_name(watermark, rule)
                wanted = backend.trigger(watermark, rule) if rule in watermark.rules() else None
                found = existing.get(name)
                if found is not None and (wanted is None or found != _fingerprint(wanted)):
                    backend.drop(cursor, watermark, name)
                    changed.append(name)
                if wanted is not None and found != _fingerprint(wanted):
                    backend.create(cursor, watermark, name, wanted)
                    changed.append(name)
    return sorted(set(changed))


def uninstall(connection: Any, watermarks: Iterable[Watermark]) -> None:
    """Drop the triggers of these watermarks (migration 0007 reversed)."""
    backend = _backend(connection)
    if backend is None:
        return
    with transaction.atomic(using=connection.alias), connection.cursor() as cursor:
        for watermark in watermarks:
            for rule in _ALL_RULES:
                backend.drop(cursor, watermark, backend.trigger_name(watermark, rule))


def missing(connection: Any, watermarks: Iterable[Watermark]) -> list[Watermark]:
    """The watermarks of existing tables whose triggers are absent or not as defined."""
    backend = _backend(connection)
    if backend is None:
        return []
    absent = []
    with connection.cursor() as cursor:
        tables = set(connection.introspection.table_names(cursor))
        for watermark in watermarks:
            if watermark.table not in tables:
                continue
            watermark = _tombstones_if(watermark, tables)
            existing = backend.existing(cursor, watermark.table)
            if any(
                existing.get(backend.trigger_name(watermark, rule))
                != _fingerprint(backend.trigger(watermark, rule))
                for rule in watermark.rules()
            ):
                absent.append(watermark)
    return absent


def install_for_models(
    connection: Any, candidates: Iterable[type[models.Model]] | None = None
) -> list[str]:
    """:func:`install` for the watermarks of ``candidates`` (default: every installed
    model routed to this database) whose tables and columns exist on ``connection``.

    Also for schemas made without migrations, such as the benchmark's.
    """
    from django.apps import apps

    if candidates is None:
        candidates = [
            model for model in apps.get_models()
            if router.allow_migrate_model(connection.alias, model)
        ]
    return install(connection, _present(connection, watermarks_of(candidates)))


def install_after_migrate(
    sender: Any, *, using: str = "default", verbosity: int = 1, **kwargs: Any
) -> None:
    """``post_migrate`` receiver: (re)install the triggers of the migrated database.

    Every concrete FencedModel routed to it, and the app's Lock and Fence once
    migration 0007 is applied there (so that migrating back below 0007 leaves
    them off). Says what it changed at verbosity 1 and above.
    """
    from django.apps import apps
    from django.db.migrations.recorder import MigrationRecorder

    from .fencing import FencedModel

    connection = connections[using]
    if _backend(connection) is None:
        return
    own = ("coordination", "0007_watermark_triggers") in MigrationRecorder(
        connection
    ).applied_migrations()
    candidates = [
        model for model in apps.get_models()
        if router.allow_migrate_model(using, model)
        and (issubclass(model, FencedModel) or (own and model._meta.app_label == "coordination"))
    ]
    changed = install_for_models(connection, candidates)
    if changed and verbosity >= 1:
        out = kwargs.get("stdout") or sys.stdout
        out.write(f"  Watermark triggers installed or replaced: {', '.join(changed)}\n")


def insert_returns_restored(connection: Any) -> bool:
    """Whether an ``INSERT ... RETURNING`` on ``connection`` returns the watermark the
    tombstone trigger started the row at: yes where the trigger changes the row
    before it is written (PostgreSQL), no where it updates it afterwards
    (SQLite: the caller reads the row again)."""
    backend = _backend(connection)
    return backend is not None and backend.restores_before_insert


def refusal(error: BaseException) -> Refusal | None:
    """What a watermark trigger refused, if ``error`` is such a refusal; else None."""
    diag = getattr(error.__cause__, "diag", None)
    constraint = getattr(diag, "constraint_name", None)
    if constraint in _RULES:
        try:
            detail = json.loads(getattr(diag, "message_detail", None) or "")
            return Refusal(
                constraint, str(detail["table"]), detail["pk"],
                tuple(int(value) for value in detail["old"]),
                tuple(int(value) for value in detail["new"]),
            )
        except (ValueError, KeyError, TypeError):
            return Refusal(constraint, str(getattr(diag, "table_name", "") or ""))
    found = _MESSAGE.match(str(error))
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


# --- one class per vendor -----------------------------------------------------------


class _Backend:
    restores_before_insert = False

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
        raise NotImplementedError

    def existing(self, cursor: Any, table: str) -> dict[str, str]:
        """Each watermark trigger on ``table``: name -> fingerprint of its definition."""
        raise NotImplementedError

    def create(self, cursor: Any, watermark: Watermark, name: str, sql: str) -> None:
        raise NotImplementedError

    def drop(self, cursor: Any, watermark: Watermark, name: str) -> None:
        raise NotImplementedError


class _PostgreSQL(_Backend):
    restores_before_insert = True

    # The fingerprint of a trigger's definition is kept as its comment: the
    # server only keeps a normalised form of the statement.
    def trigger(self, watermark: Watermark, rule: str) -> str:
        if rule in (KEPT, RESTORED):
            template = POSTGRESQL_KEEP_TRIGGER if rule == KEPT else POSTGRESQL_RESTORE_TRIGGER
            return template.format(
                name=self.quote(self.trigger_name(watermark, rule)),
                table=self.quote(watermark.table), old=self.row("OLD", watermark),
                arguments=", ".join(
                    _literal(value) for value in (watermark.pk_column, *watermark.columns)
                ),
            )
        arguments = ", ".join(
            _literal(value) for value in (rule, watermark.pk_column, *watermark.columns)
        )
        return POSTGRESQL_TRIGGER.format(
            name=self.quote(self.trigger_name(watermark, rule)), of=self.of(watermark, rule),
            table=self.quote(watermark.table), condition=self.condition(watermark, rule),
            arguments=arguments,
        )

    def existing(self, cursor: Any, table: str) -> dict[str, str]:
        cursor.execute(
            "SELECT t.tgname, coalesce(obj_description(t.oid, 'pg_trigger'), '') FROM pg_trigger t"
            " WHERE t.tgrelid = to_regclass(%s) AND NOT t.tgisinternal",
            [self.quote(table)],
        )
        return dict(cursor.fetchall())

    def create(self, cursor: Any, watermark: Watermark, name: str, sql: str) -> None:
        rule = next(rule for rule in _ALL_RULES if self.trigger_name(watermark, rule) == name)
        function, definition = _POSTGRESQL_FUNCTIONS[rule]
        cursor.execute(
            f"SELECT coalesce(obj_description(to_regprocedure('{function}()'), 'pg_proc'), '')"
        )
        if cursor.fetchone()[0] != _fingerprint(definition):
            cursor.execute(definition)
            cursor.execute(
                f"COMMENT ON FUNCTION {function}() IS " + _literal(_fingerprint(definition))
            )
        cursor.execute(sql)
        cursor.execute(
            f"COMMENT ON TRIGGER {self.quote(name)} ON {self.quote(watermark.table)} IS "
            + _literal(_fingerprint(sql))
        )

    def drop(self, cursor: Any, watermark: Watermark, name: str) -> None:
        cursor.execute(f"DROP TRIGGER IF EXISTS {self.quote(name)} ON {self.quote(watermark.table)}")


class _SQLite(_Backend):
    # SQLite keeps each trigger's statement as it was written: that is its fingerprint.
    def trigger(self, watermark: Watermark, rule: str) -> str:
        name, table = self.quote(self.trigger_name(watermark, rule)), self.quote(watermark.table)
        pk = self.quote(watermark.pk_column)
        if rule == KEPT:
            return SQLITE_KEEP_TRIGGER.format(
                name=name, table=table, old=self.row("OLD", watermark), pk=pk,
                table_literal=_literal(watermark.table),
                old_values=", ".join(f"OLD.{self.quote(column)}" for column in watermark.columns),
            )
        if rule == RESTORED:
            where = (
                f"FROM {TOMBSTONES} WHERE table_name = {_literal(watermark.table)} "
                f"AND row_pk = CAST(NEW.{pk} AS TEXT)"
            )
            return SQLITE_RESTORE_TRIGGER.format(
                name=name, table=table, pk=pk, columns=self.row("", watermark),
                kept=f"SELECT 1 {where}", kept_mark=f"SELECT fence, {HIGHEST_STEP} {where}",
            )
        template = SQLITE_NOT_LOWERED if rule == NOT_LOWERED else SQLITE_MUST_RISE
        message = template.format(
            constraint=rule, table=watermark.table, columns=", ".join(watermark.columns)
        )
        return SQLITE_TRIGGER.format(
            name=self.quote(self.trigger_name(watermark, rule)), of=self.of(watermark, rule),
            table=self.quote(watermark.table), condition=self.condition(watermark, rule),
            message=_literal(message),
        )

    def existing(self, cursor: Any, table: str) -> dict[str, str]:
        cursor.execute(
            "SELECT name, sql FROM sqlite_master WHERE type = 'trigger' AND tbl_name = %s", [table]
        )
        return {name: _fingerprint(sql) for name, sql in cursor.fetchall()}

    def create(self, cursor: Any, watermark: Watermark, name: str, sql: str) -> None:
        cursor.execute(sql)

    def drop(self, cursor: Any, watermark: Watermark, name: str) -> None:
        cursor.execute(f"DROP TRIGGER IF EXISTS {self.quote(name)}")


_BACKENDS: dict[str, type[_Backend]] = {"postgresql": _PostgreSQL, "sqlite": _SQLite}


def _backend(connection: Any) -> _Backend | None:
    backend = _BACKENDS.get(connection.vendor)
    return None if backend is None else backend(connection)


def _present(connection: Any, watermarks: list[Watermark]) -> list[Watermark]:
    """The watermarks whose table and columns exist on ``connection`` (a model whose
    migrations have not run there yet has nothing to guard)."""
    if not watermarks:
        return []
    present = []
    with connection.cursor() as cursor:
        tables = set(connection.introspection.table_names(cursor))
        for watermark in watermarks:
            if watermark.table not in tables:
                continue
            description = connection.introspection.get_table_description(cursor, watermark.table)
            if {watermark.pk_column, *watermark.columns} <= {column.name for column in description}:
                present.append(_tombstones_if(watermark, tables))
    return present


def _tombstones_if(watermark: Watermark, tables: set[str]) -> Watermark:
    """``watermark`` without its tombstone triggers where the tombstone table does not
    exist (migration 0016 not applied, or reversed): they would fail every
    DELETE and INSERT of the table."""
    if watermark.tombstones and TOMBSTONES not in tables:
        return replace(watermark, tombstones=False)
    return watermark


def _fingerprint(sql: str) -> str:
    return "coordination " + hashlib.sha256(sql.encode()).hexdigest()[:16]


def _literal(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"
