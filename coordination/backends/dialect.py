"""What a backend knows of its database beyond the grant point: its dialect.

:func:`coordination.backends.dialect_of` returns the :class:`Dialect` of a
connection; nothing outside ``coordination/backends/`` asks which database it
talks to. A backend for a new database implements every hook below (they are
abstract: a class that leaves one out cannot be instantiated, and
``tests/unit/test_backend_hooks.py`` fails), each with this guarantee:

- :meth:`Dialect.grant_point`: the grant point of an alias on this database
  (the portable ORM transaction when asked), keeping rules 3, 9 and 11 of
  docs/rules.md.
- :meth:`Dialect.watermark_triggers`: the triggers that make the database
  refuse a lower watermark or token counter whatever writes the row, and keep
  a deleted fenced row's watermark for its return (rule 8); or
  :exc:`WatermarksNotEnforced` where the database cannot, never silence.
- :meth:`Dialect.bound_idle_transaction`: a transaction whose client idles
  longer than the bound between statements is ended by the server (its rows
  freed), or nothing where the database has no such bound.
- :meth:`Dialect.ensure_token_floor_row`: the token floor's row exists
  (at 0 if it was missing) and never races a concurrent grant into a deadlock.
- :meth:`Dialect.create_missing`: a row is inserted unless one with its key
  exists, and callers racing to create then lock the same row queue on its
  row lock (never a deadlock).
- :meth:`Dialect.codepoint_order`: an ordering by codepoint, the order every
  caller takes row locks in (no two callers wait for each other in a cycle).
- :meth:`Dialect.check_settings`: the system-check messages the database's
  ``DATABASES`` entry deserves, read from settings alone (no connection).
- :meth:`Dialect.replication`: what the database says of its replicas, for
  the promotion-guard check; None where it has nothing to say.
- :meth:`Dialect.after_migrate` (optional): what the app's tables need after
  every ``migrate`` (MariaDB: binary collation).
- :attr:`Dialect.migration_sql`: the SQL each migration step ran on this
  database, frozen (a migration is history); :meth:`Dialect.run_migration_sql`
  runs one step's.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

from django.core.checks import CheckMessage
from django.core.exceptions import ImproperlyConfigured
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.models import Model, QuerySet

from ..watermarks import Refusal, refusal_in_message

if TYPE_CHECKING:
    from ..watermarks import WatermarkTriggers
    from .base import GrantPoint

__all__ = ["Dialect", "FrozenSQL", "Replication", "WatermarksNotEnforced"]


class WatermarksNotEnforced(ImproperlyConfigured):
    """The database has no backend that keeps watermarks from going down (rule 8)."""


class FrozenSQL(NamedTuple):
    """The statements one migration step runs on a database, as it ran them."""

    statements: tuple[str, ...]
    functions: bool = False
    """Whether they create the grant point's functions: a database that refuses
    the app that right goes on without them (the grant point must then be
    ``COORDINATION["GRANT_POINT"] = "orm"``)."""


class Replication(NamedTuple):
    """What the grant point's database says of its replicas."""

    replicas: int
    """How many stream from it."""
    synchronous: bool
    """Whether a commit waits for one of them."""
    guard_installed: bool
    """Whether the grant functions run the promotion guard."""
    guarded: bool
    """Whether the alias's grant point runs it (the functions do; the ORM one does not)."""


class Dialect(abc.ABC):
    """The database-specific hooks of a backend (see the module docstring)."""

    name: ClassVar[str]
    """The backend module's name: ``"postgresql"``, ``"sqlite"`` or ``"orm"`` (any other)."""

    migration_sql: ClassVar[Mapping[str, FrozenSQL]] = {}
    """Frozen SQL by migration step (``"0006_grant_point_functions"``, and
    ``"<migration>.backwards"`` for a reversal); a step not here runs nothing."""

    json_max_depth: ClassVar[int | None] = None
    """The levels of arrays and objects a JSON value may nest in this database's
    JSON columns; None: more than anyone needs."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__}>"

    @abc.abstractmethod
    def grant_point(self, alias: str, *, portable: bool) -> GrantPoint:
        """The grant point of ``alias``; ``portable``: the ORM transaction."""

    @abc.abstractmethod
    def watermark_triggers(self, connection: BaseDatabaseWrapper) -> WatermarkTriggers:
        """The watermark triggers of ``connection``; raises ``WatermarksNotEnforced``
        where the database has none."""

    @abc.abstractmethod
    def bound_idle_transaction(self, connection: BaseDatabaseWrapper, seconds: float) -> None:
        """Inside a transaction: let the server end it (and free its rows) once its
        client idles ``seconds`` between statements. For that transaction only."""

    @abc.abstractmethod
    def ensure_token_floor_row(self, alias: str) -> None:
        """Make the token floor's row (at 0) if it is missing; leave it alone if not."""

    @abc.abstractmethod
    def create_missing(self, rows: QuerySet[Any], new: list[Model], unique: str) -> None:
        """Insert each of ``new`` into ``rows``' table unless a row with the same
        ``unique`` field exists; the caller then locks the rows with
        ``select_for_update``."""

    def insert_without_flush_wait(self, connection: BaseDatabaseWrapper, record: Model) -> None:
        """Insert ``record`` (its database defaults filled by the server) in one
        statement. In autocommit a database that can commits it without waiting
        for its WAL flush: for bookkeeping a server crash may lose, never for what
        a guarantee rests on. Inside the caller's transaction, a plain insert that
        commits with it."""
        record.save(using=connection.alias, force_insert=True)

    @abc.abstractmethod
    def codepoint_order(self, field: str) -> Any:
        """An expression ordering ``field`` by codepoint, as Python sorts strings."""

    @abc.abstractmethod
    def check_settings(self, alias: str, config: Mapping[str, Any]) -> list[CheckMessage]:
        """System-check messages for the grant point's ``DATABASES[alias]``."""

    @abc.abstractmethod
    def replication(self, connection: BaseDatabaseWrapper) -> Replication | None:
        """The database's replicas as it reports them, or None (no such notion).
        Raises ``DatabaseError`` if the database cannot be asked."""

    # --- reading a database's errors (portable defaults; a backend refines them) ---

    def connection_lost(self, connection: BaseDatabaseWrapper, error: BaseException) -> bool:
        """Whether ``error`` means ``connection`` is gone (the outcome of the call is
        unknown), not a statement's own error (a deadlock, a timeout: nothing was
        granted). By default every such error of an open connection counts as lost."""
        raw = connection.connection
        return raw is None or bool(getattr(raw, "closed", False)) or self._lost(error)

    def _lost(self, error: BaseException) -> bool:
        return True

    def ended_for_idling(self, error: BaseException) -> bool:
        """Whether the server ended ``error``'s session for idling in a transaction
        (:meth:`bound_idle_transaction`). Never, where the database has no bound."""
        return False

    def watermark_refusal(self, error: BaseException) -> Refusal | None:
        """What a watermark trigger refused, if ``error`` is such a refusal: by
        default read from the error's message, which the triggers of every
        backend start with the rule and the table."""
        return refusal_in_message(error)

    def after_migrate(self, connection: BaseDatabaseWrapper) -> list[str]:
        """Bring the app's tables on ``connection`` to what this database needs, after
        every ``migrate``; returns the tables changed. Nothing by default."""
        return []

    def run_migration_sql(self, connection: BaseDatabaseWrapper, step: str) -> bool:
        """Run the frozen SQL of migration ``step`` on ``connection``, if it has any.

        False if there is none, or if it creates the grant point's functions and
        the database refused the app that right (the migration goes on).
        """
        frozen = self.migration_sql.get(step)
        if frozen is None:
            return False
        with connection.cursor() as cursor:
            for statement in frozen.statements:
                cursor.execute(statement)
        return True
