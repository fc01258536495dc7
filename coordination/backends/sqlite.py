"""The grant point on SQLite: the ORM transaction, under BEGIN IMMEDIATE.

SQLite has no row locks (``select_for_update`` is a no-op there): the database
write lock is what serialises grants. With ``DATABASES[...]["OPTIONS"]
["transaction_mode"] = "IMMEDIATE"`` (system check ``coordination.W001``) each
grant-point transaction takes that lock when it begins, before it reads the
counter, so whoever holds it is the only one deciding, as a row lock does on
PostgreSQL. Waiters poll: SQLite cannot announce a release to another process.
"""

from __future__ import annotations

from django.db import models

from .orm import OrmGrantPoint

__all__ = ["SQLiteGrantPoint"]


class SQLiteGrantPoint(OrmGrantPoint):
    """The ORM grant point on SQLite."""

    name = "sqlite"

    def save_surviving_rollback(self, record: models.Model) -> None:
        """SQLite allows one writer, and the caller's transaction is it: a second
        connection would wait for that very transaction. The record commits with
        the caller's transaction (or at once outside one)."""
        record.save(using=self.alias)
