"""Installing the grant point's functions (``migrate`` does it) and the room
fenced tables leave for updates in place."""

from __future__ import annotations

import logging
from collections.abc import Callable

from django.db import DatabaseError, models, transaction
from django.db.backends.base.base import BaseDatabaseWrapper

from ...models import Fence, Grant, Lock, Ticket, TokenFloor
from ..base import (
    format_sql,
)
from .functions import CREATE_FUNCTIONS, DROP_FUNCTIONS, INSUFFICIENT_PRIVILEGE, _sqlstate

logger = logging.getLogger("coordination.locks")


def install(connection: BaseDatabaseWrapper) -> None:
    """Create today's functions on ``connection`` for the app's tables (the latest
    migration that creates them runs the same SQL, frozen). They are dropped
    first, so a later version may change what they return. Reads no settings."""
    tables = {"lock": Lock, "grant": Grant, "ticket": Ticket, "floor": TokenFloor, "fence": Fence}
    with connection.cursor() as cursor:
        for statement in DROP_FUNCTIONS:
            cursor.execute(statement)
        for template in CREATE_FUNCTIONS:
            cursor.execute(format_sql(template, connection, tables=tables))


def install_if_permitted(connection: BaseDatabaseWrapper) -> bool:
    """:func:`install`, unless the database refuses the app the right to create
    functions: then nothing is created (False), and the grant point must be the
    ORM transaction (``COORDINATION["GRANT_POINT"] = "orm"``)."""
    return _permitted(connection, lambda: install(connection))


def _permitted(connection: BaseDatabaseWrapper, create: Callable[[], object]) -> bool:
    """Run ``create``; False if the database refused the app the right to create
    functions (migrations read no settings, so they cannot know the grant point)."""
    try:
        # A savepoint: the refused statement must not abort the migration's
        # own transaction.
        with transaction.atomic(using=connection.alias):
            create()
    except DatabaseError as error:
        if _sqlstate(error) != INSUFFICIENT_PRIVILEGE:
            raise
        logger.warning(
            "not allowed to create the grant point's functions (%s); set "
            "COORDINATION['GRANT_POINT'] = 'orm' for this database", error,
        )
        return False
    return True


def install_for_models(connection: BaseDatabaseWrapper) -> None:
    """:func:`install` (for schemas made without migrations, such as the benchmark's)."""
    install(connection)


# The lock table's rows are written on every acquire and every release, and a
# fence's row on every accepted write; no index covers a column those writes
# change. PostgreSQL can then keep the new version of a row on its own page and
# add no index entries (a heap-only-tuple, HOT, update), but only if the page has
# room. At the default fillfactor (100) pages fill up (a bulk load, or a table
# whose rows have all been written once), and an update of a row on a full page
# moves it: a write to another page and an insert into each of the lock table's
# three indexes, with their pages logged in full after a checkpoint. A fifth of
# each page left free keeps these updates in place; pages filled before the
# setting keep their layout until rewritten (VACUUM FULL, pg_repack).
UPDATE_IN_PLACE_FILLFACTOR = 80


def leave_room_for_updates(
    connection: BaseDatabaseWrapper, *tables: type[models.Model], fillfactor: int | None = None
) -> None:
    """Set the fillfactor of the tables of the models ``tables`` (the benchmark's
    schemas; migration 0015 froze what it ran): ``UPDATE_IN_PLACE_FILLFACTOR``, or PostgreSQL's
    default with ``fillfactor=100``. A storage parameter only: the ALTER takes a
    lock that blocks neither reads nor writes, and rewrites nothing."""
    value = UPDATE_IN_PLACE_FILLFACTOR if fillfactor is None else int(fillfactor)
    with connection.cursor() as cursor:
        for model in tables:
            table = connection.ops.quote_name(model._meta.db_table)
            cursor.execute(f"ALTER TABLE {table} SET (fillfactor = {value})")


