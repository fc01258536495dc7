"""Grant-point backends: one per database alias, chosen once.

:func:`get_backend` returns the :class:`~coordination.backends.base.GrantPoint`
of an alias, picked by its database and ``COORDINATION["GRANT_POINT"]``:

============  =====================================  ====================================
database      ``None`` or ``"auto"`` (default)       ``"orm"``
============  =====================================  ====================================
PostgreSQL    PL/pgSQL functions (``postgresql``)    ORM ``select_for_update`` transaction
                                                     with LISTEN/NOTIFY wake-ups (``orm``)
SQLite        ORM transaction under BEGIN IMMEDIATE  the same
              (``sqlite``)
MariaDB,      stored procedures (``mysql``)          ORM ``select_for_update`` transaction
MySQL                                                (``orm``)
other         ORM ``select_for_update`` (``orm``)    the same
============  =====================================  ====================================

The choice is kept per alias until ``COORDINATION`` or ``DATABASES`` change
(``setting_changed``, as ``override_settings`` sends).

The rest of what a backend knows of its database is its
:class:`~coordination.backends.dialect.Dialect` (:func:`dialect_of`): the
module docstring of ``coordination.backends.dialect`` lists what a backend for
a new database implements. Migrations run their frozen SQL through
:func:`run_migration_sql`.
"""

from __future__ import annotations

from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.core.signals import setting_changed
from django.db import connections
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.backends.base.schema import BaseDatabaseSchemaEditor
from django.dispatch import receiver
from django.utils.module_loading import import_string

from ..conf import app_settings
from .base import GrantPoint
from .dialect import Dialect

__all__ = [
    "DIALECTS",
    "GRANT_POINTS",
    "Dialect",
    "GrantPoint",
    "dialect_for_settings",
    "dialect_of",
    "get_backend",
    "run_migration_sql",
]

GRANT_POINTS: tuple[str | None, ...] = (None, "auto", "orm")
"""The values ``COORDINATION["GRANT_POINT"]`` accepts."""

_backends: dict[str, GrantPoint] = {}


def get_backend(alias: str | None = None) -> GrantPoint:
    """The grant point of ``alias`` (default ``COORDINATION["DATABASE"]``).

    Raises ``ImproperlyConfigured`` for a ``GRANT_POINT`` value other than
    None, ``"auto"`` or ``"orm"`` (system check ``coordination.E005``).
    """
    alias = alias or app_settings.DATABASE
    backend = _backends.get(alias)
    if backend is None:
        backend = _backends.setdefault(alias, _select(alias))
    return backend


def _select(alias: str) -> GrantPoint:
    choice = app_settings.GRANT_POINT
    if choice not in GRANT_POINTS:
        raise ImproperlyConfigured(
            f"COORDINATION['GRANT_POINT'] is {choice!r}; use None or 'auto' (the database's "
            "own grant point) or 'orm' (the portable select_for_update transaction)."
        )
    return dialect_of(connections[alias]).grant_point(alias, portable=choice == "orm")


# --- the one place a database vendor picks code -------------------------------------

DIALECTS: dict[str | None, str] = {
    "postgresql": "coordination.backends.postgresql.PostgreSQLDialect",
    "sqlite": "coordination.backends.sqlite.SQLiteDialect",
    "mysql": "coordination.backends.mysql.MySQLDialect",
    None: "coordination.backends.orm.OrmDialect",
}
"""The dialect of each database vendor Django names; None: any other database."""

_dialects: dict[str | None, Dialect] = {}


def dialect_of(connection: BaseDatabaseWrapper) -> Dialect:
    """The dialect of ``connection``'s database (the portable one for an unknown
    database). Opens no connection."""
    return _dialect(connection.vendor)


def dialect_for_settings(config: dict[str, Any]) -> Dialect:
    """The dialect of a ``DATABASES`` entry, read from its ENGINE alone: for the
    system checks, which load no database driver."""
    engine = str(config.get("ENGINE", ""))
    vendor = next((vendor for word, vendor in _ENGINE_WORDS if word in engine), None)
    return _dialect(vendor)


# A word of an ENGINE path that names its vendor (PostGIS's and MySQL GIS's included).
_ENGINE_WORDS = (("postg", "postgresql"), ("sqlite", "sqlite"), ("mysql", "mysql"))


def _dialect(vendor: str | None) -> Dialect:
    dialect = _dialects.get(vendor)
    if dialect is None:
        path = DIALECTS.get(vendor, DIALECTS[None])
        dialect = _dialects.setdefault(vendor, import_string(path)())
    return dialect


def run_migration_sql(schema_editor: BaseDatabaseSchemaEditor, step: str) -> bool:
    """Run the SQL migration ``step`` froze for the migrated database, if any
    (a migration is history: editing today's SQL never changes an old one).
    True if it ran."""
    connection = schema_editor.connection
    return dialect_of(connection).run_migration_sql(connection, step)


@receiver(setting_changed)
def _forget_on_change(*, setting: str, **kwargs: Any) -> None:
    if setting in {"COORDINATION", "DATABASES"}:
        _backends.clear()
