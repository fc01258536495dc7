"""The portable grant point: an ORM transaction holding the lock's row.

Each change is a transaction of its own that locks the key's row with
``SELECT ... FOR UPDATE`` (creating the row first if an acquire finds none:
``INSERT ... ON CONFLICT DO NOTHING``, so racing first acquirers of a key queue
on the same row lock), reads the database clock after the row lock is held,
reads the token floor, applies the grant rule of :mod:`coordination.backends.base`
and writes the lock and its grant history before committing. Whoever holds the row lock is the only
one deciding, so tokens of a key are unique and strictly increasing in grant
order, and two leases of a key never overlap in database time.

Selected with ``COORDINATION["GRANT_POINT"] = "orm"`` (for a PostgreSQL database
where the app may not create functions); SQLite runs it under BEGIN IMMEDIATE
(:mod:`coordination.backends.sqlite`).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from typing import Any

from django.core.checks import CheckMessage, Error
from django.db import connections
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.models import F, Model, QuerySet

from ..leases import Lease
from ..models import Grant, GrantEnd, GrantMode, Lock, Ticket, TokenFloor, hash_lease_id
from ..watermarks import WatermarkTriggers
from . import dialect_of
from .base import (
    Acquired,
    Ended,
    GrantPoint,
    LockSnapshot,
    TakenOver,
    grant_refusal,
    is_current_lease,
    lease_refusal,
    never_granted,
    new_lease_id,
    next_token,
)
from .dialect import Dialect, Replication, WatermarksNotEnforced
from .shared import SharedLeases

__all__ = ["OrmDialect", "OrmGrantPoint"]


class OrmGrantPoint(SharedLeases):
    """The grant point as ORM transactions with ``select_for_update`` (any database);
    readers' shared leases from :class:`~coordination.backends.shared.SharedLeases`."""

    name = "orm"

    def acquire(
        self, key: str, holder: str, ttl: float, lock_delay: float, ticket: int | None
    ) -> Acquired:
        with self.transaction():
            return self.grant_in_transaction(key, holder, ttl, lock_delay, ticket)

    def grant_in_transaction(
        self, key: str, holder: str, ttl: float, lock_delay: float, ticket: int | None
    ) -> Acquired:
        alias = self.alias
        lock = self._locked_row(key, create=True)
        assert lock is not None
        now = self.now()
        # Read after the row lock (on SQLite: the write lock), in the grant's
        # own transaction: a floor raised before this acquire began is seen.
        floor = TokenFloor.objects.using(alias).value()
        snapshot = LockSnapshot.of(lock)
        refusal = grant_refusal(snapshot, now, self._tickets_ahead(key, ticket, now), floor)
        if refusal is not None:
            raise refusal
        taken_over = None
        if lock.holder:
            # The previous lease ran out without a release: close it as expired.
            assert lock.expires_at is not None
            taken_over = TakenOver(lock.token, lock.holder, lock.acquired_at, lock.expires_at)
            self._end_current(lock, GrantEnd.EXPIRED, lock.expires_at)
        lease_id = new_lease_id()
        lease_hash = hash_lease_id(lease_id)
        token = next_token(snapshot, floor)
        expires_at = now + dt.timedelta(seconds=ttl)
        Lock.objects.using(alias).filter(pk=lock.pk).update(
            token=token, holder=holder, lease_hash=lease_hash,
            acquired_at=now, expires_at=expires_at, lock_delay=lock_delay, delay_until=None,
        )
        Grant.objects.using(alias).create(
            lock_id=lock.pk, token=token, holder=holder, lease_hash=lease_hash,
            acquired_at=now, expires_at=expires_at,
        )
        if ticket is not None:
            Ticket.objects.using(alias).filter(pk=ticket).delete()
        lease = Lease(
            key=key, token=token, lease_id=lease_id, holder=holder,
            acquired_at=now, expires_at=expires_at,
        )
        return Acquired(lease, taken_over)

    def renew_exclusive(self, grant: Lease, ttl: float) -> dt.datetime:
        alias = self.alias
        with self.transaction():
            lock = self._locked_row(grant.key)
            if lock is None:
                raise never_granted(grant.key)
            now = self.now()
            refusal = lease_refusal(LockSnapshot.of(lock), grant, now)
            if refusal is not None:
                raise refusal
            expires_at = now + dt.timedelta(seconds=ttl)
            Lock.objects.using(alias).filter(pk=lock.pk).update(expires_at=expires_at)
            Grant.objects.using(alias).filter(lock_id=lock.pk, token=grant.token).update(
                expires_at=expires_at
            )
        return expires_at

    def release_exclusive(self, grant: Lease) -> Ended:
        with self.transaction():
            lock = self._locked_row(grant.key)
            if lock is None:
                raise never_granted(grant.key)
            now = self.now()
            snapshot = LockSnapshot.of(lock)
            refusal = lease_refusal(snapshot, grant, now)
            expired_at: dt.datetime | None = None
            if refusal is None:
                reason, ended_at = GrantEnd.RELEASED, now
            elif is_current_lease(snapshot, grant) and lock.expires_at is not None:
                # It ran out and nobody took the lock since: free it, as expired.
                expired_at = lock.expires_at
                reason, ended_at = GrantEnd.EXPIRED, expired_at
            else:
                raise refusal
            self._end_current(lock, reason, ended_at)
            # Announce only while a waiter said it waits (on the row this
            # transaction locked), as the PostgreSQL function does.
            if lock.wake_until is not None and lock.wake_until > now:
                self.wake(grant.key)
        return Ended(reason, ended_at, expired_at)

    def revoke(self, key: str) -> Grant | None:
        with self.transaction():
            lock = self._locked_row(key)
            if lock is None or not lock.holder:
                return None
            self._end_current(lock, GrantEnd.REVOKED, self.now())
            self.wake(key)
        revoked = (
            Grant.objects.using(self.alias).select_related("lock")
            .filter(lock_id=lock.pk, token=lock.token).first()
        )
        if revoked is not None and revoked.mode == GrantMode.SHARED:
            # The readers' group ended with its newest reader's row; the other
            # readers of the group are closed as revoked too.
            self.close_revoked_readers(revoked)
        return revoked

    # --- the row and its history ----------------------------------------------

    def _locked_row(self, key: str, *, create: bool = False) -> Lock | None:
        return locked_row(self.alias, key, create=create)

    def _tickets_ahead(self, key: str, ticket: int | None, now: dt.datetime) -> int:
        """Live tickets in the fair queue of ``key`` before ``ticket`` (all, without one:
        no barging past fair waiters)."""
        queue = Ticket.objects.using(self.alias).filter(lock_key=key, expires_at__gt=now)
        if ticket is not None:
            queue = queue.filter(id__lt=ticket)
        return queue.count()

    def _end_current(self, lock: Lock, reason: GrantEnd, ended_at: dt.datetime) -> None:
        """Close the lock's current grant and free the row, keeping its token counter."""
        alias = self.alias
        # An expired grant ends at its own expires_at (moved with the lock's by
        # renew), as the PostgreSQL functions close it.
        end: F | dt.datetime = F("expires_at") if reason == GrantEnd.EXPIRED else ended_at
        Grant.objects.using(alias).filter(lock_id=lock.pk, token=lock.token, ended_at=None).update(
            ended_at=end, end_reason=reason
        )
        # Lock-delay runs from the end of a lease that expired or was revoked; a
        # clean release frees the lock at once.
        delay_until = (
            ended_at + dt.timedelta(seconds=lock.lock_delay)
            if reason != GrantEnd.RELEASED and lock.lock_delay
            else None
        )
        Lock.objects.using(alias).filter(pk=lock.pk).update(
            holder="", lease_hash="", acquired_at=None, expires_at=None, delay_until=delay_until
        )


def locked_row(alias: str, key: str, *, create: bool = False) -> Lock | None:
    """The lock's row, locked until the transaction ends; created if missing
    and ``create``, else None if missing."""
    rows = Lock.objects.using(alias).select_for_update()
    while True:
        try:
            return rows.get(key=key)
        except Lock.DoesNotExist:
            if not create:
                return None
        # Racing first acquirers of a new key all get past here without an error,
        # then queue on the same row lock. The row that made the insert a no-op
        # may be pruned before it is locked (coordination.pruning): then look
        # again, and make it again.
        dialect_of(connections[alias]).create_missing(Lock.objects.using(alias), [Lock(key=key)], "key")


# --- the dialect of a database without a backend of its own ---------------------------


class OrmDialect(Dialect):
    """A database with no backend of its own: the portable grant point, and no
    watermark triggers (system check ``coordination.E001`` says so, and
    installing them raises ``WatermarksNotEnforced``)."""

    name = "orm"

    def grant_point(self, alias: str, *, portable: bool) -> GrantPoint:
        return OrmGrantPoint(alias, self)

    def watermark_triggers(self, connection: BaseDatabaseWrapper) -> WatermarkTriggers:
        raise WatermarksNotEnforced(
            f"database {connection.alias!r} ({connection.display_name}) has no watermark "
            "triggers in coordination: nothing there would refuse an UPDATE that lowers a "
            "watermark or a token counter (rule 8 of docs/rules.md). Keep the lock and "
            "fenced tables on PostgreSQL, MariaDB or SQLite, or add a backend for this database "
            "(coordination/backends/dialect.py lists what it implements)."
        )

    def bound_idle_transaction(self, connection: BaseDatabaseWrapper, seconds: float) -> None:
        return None  # no server-side bound: a paused client keeps its rows locked

    def ensure_token_floor_row(self, alias: str) -> None:
        TokenFloor.objects.using(alias).bulk_create(
            [TokenFloor(pk=TokenFloor.ROW)], ignore_conflicts=True
        )

    def create_missing(self, rows: QuerySet[Any], new: list[Model], unique: str) -> None:
        # ON CONFLICT DO NOTHING: racing creators all get past here without an
        # error, then queue on the same row lock.
        rows.bulk_create(new, ignore_conflicts=True)

    def codepoint_order(self, field: str) -> Any:
        return F(field)

    def check_settings(self, alias: str, config: Mapping[str, Any]) -> list[CheckMessage]:
        engine = str(config.get("ENGINE", ""))
        return [
            Error(
                f"Database {alias!r} uses {engine}; coordination supports PostgreSQL, MariaDB "
                "and SQLite. "
                "Elsewhere its grants would run on the portable ORM grant point, but nothing "
                "in the database would keep watermarks and token counters from going down.",
                hint="Point COORDINATION['DATABASE'] at a PostgreSQL or MariaDB database.",
                id="coordination.E001",
            )
        ]

    def replication(self, connection: BaseDatabaseWrapper) -> Replication | None:
        return None
