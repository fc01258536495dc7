"""Installing the watermark triggers: the rules of :mod:`coordination.watermarks`,
made into each database's triggers by its backend (:class:`WatermarkTriggers`).

:func:`install_after_migrate` runs after every ``migrate`` (a ``post_migrate``
receiver); :func:`install` and :func:`uninstall` are what migration 0007 calls;
:func:`missing` is what the system check reports.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from contextlib import nullcontext
from dataclasses import replace
from typing import Any

from django.apps import apps
from django.db import connections, models, router, transaction
from django.db.migrations.recorder import MigrationRecorder

from ..watermarks import (
    ALL_RULES,
    TOMBSTONES,
    Watermark,
    WatermarkTriggers,
    fingerprint,
    rows_are_fences,
    watermarks_of,
)
from . import dialect_of
from .dialect import WatermarksNotEnforced

__all__ = [
    "insert_returns_restored",
    "install",
    "install_after_migrate",
    "install_for_models",
    "missing",
    "uninstall",
]


def install(connection: Any, watermarks: Iterable[Watermark]) -> list[str]:
    """Create, replace or drop triggers on ``connection`` until they are exactly these.

    For each watermark: its rules' triggers exist as this version defines them,
    and a strict trigger of a table that is no longer strict is dropped. A
    trigger already as defined is left alone, so a second call changes nothing
    and takes no lock. Runs in one transaction. Returns the names of the
    triggers created or dropped.

    Raises ``WatermarksNotEnforced`` (an ``ImproperlyConfigured``) for a database
    whose backend has no watermark triggers, if there is a watermark to guard:
    the rule would otherwise go unenforced without a word.
    """
    watermarks = list(watermarks)
    if not watermarks:
        return []
    backend = _backend(connection)
    changed: list[str] = []
    with _ddl_transaction(connection), connection.cursor() as cursor:
        for watermark in watermarks:
            existing = backend.existing(cursor, watermark.table)
            for rule in ALL_RULES:
                name = backend.trigger_name(watermark, rule)
                wanted = backend.trigger(watermark, rule) if rule in watermark.rules() else None
                found = existing.get(name)
                if found is not None and (wanted is None or found != fingerprint(wanted)):
                    backend.drop(cursor, watermark, name)
                    changed.append(name)
                if wanted is not None and found != fingerprint(wanted):
                    backend.create(cursor, watermark, name, wanted)
                    changed.append(name)
    return sorted(set(changed))


def uninstall(connection: Any, watermarks: Iterable[Watermark]) -> None:
    """Drop the triggers of these watermarks (migration 0007 reversed); nothing
    where the database has none."""
    if not _enforced(connection):
        return
    backend = _backend(connection)
    with _ddl_transaction(connection), connection.cursor() as cursor:
        for watermark in watermarks:
            for rule in ALL_RULES:
                backend.drop(cursor, watermark, backend.trigger_name(watermark, rule))


def _ddl_transaction(connection: Any) -> Any:
    """One transaction where DDL is transactional; none where each DDL statement
    commits by itself (MariaDB), which would end the caller's savepoints."""
    if connection.features.can_rollback_ddl:
        return transaction.atomic(using=connection.alias)
    return nullcontext()


def missing(connection: Any, watermarks: Iterable[Watermark]) -> list[Watermark]:
    """The watermarks of existing tables whose triggers are absent or not as defined
    (all of them where the database has no watermark triggers)."""
    enforced = _enforced(connection)
    absent = []
    with connection.cursor() as cursor:
        tables = set(connection.introspection.table_names(cursor))
        for watermark in watermarks:
            if watermark.table not in tables:
                continue
            if not enforced:
                absent.append(watermark)
                continue
            backend = _backend(connection)
            watermark = _tombstones_if(watermark, tables)
            existing = backend.existing(cursor, watermark.table)
            if any(
                existing.get(backend.trigger_name(watermark, rule))
                != fingerprint(backend.trigger(watermark, rule))
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
    them off). Says what it changed at verbosity 1 and above. Raises
    ``WatermarksNotEnforced`` where a table has a watermark and the database no
    triggers (:func:`install`).
    """
    connection = connections[using]
    dialect_of(connection).after_migrate(connection)
    own = ("coordination", "0007_watermark_triggers") in MigrationRecorder(
        connection
    ).applied_migrations()
    candidates = [
        model for model in apps.get_models()
        if router.allow_migrate_model(using, model)
        and (rows_are_fences(model) or (own and model._meta.app_label == "coordination"))
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
    return _enforced(connection) and _backend(connection).restores_before_insert


def _backend(connection: Any) -> WatermarkTriggers:
    """The watermark triggers of ``connection``'s database (its backend's); raises
    ``WatermarksNotEnforced`` where the database has none."""
    return dialect_of(connection).watermark_triggers(connection)


def _enforced(connection: Any) -> bool:
    try:
        dialect_of(connection).watermark_triggers(connection)
    except WatermarksNotEnforced:
        return False
    return True


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


