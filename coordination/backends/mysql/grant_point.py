"""The grant points on MariaDB: the ORM transaction, and one procedure call per
acquire and release over it."""

from __future__ import annotations

import datetime as dt
import functools
import math
import random
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from typing import Any, TypeVar
from weakref import WeakKeyDictionary

from django.core.exceptions import ImproperlyConfigured
from django.db import DatabaseError, OperationalError
from django.db.backends.base.base import BaseDatabaseWrapper

from ...exceptions import LeaseLost
from ...leases import Lease
from ...models import MAX_TOKEN, GrantEnd, hash_lease_id
from ..base import (
    IDLE_BOUND,
    Acquired,
    Ended,
    IdleBound,
    LockSnapshot,
    TakenOver,
    grant_refusal,
    lease_refusal,
    never_granted,
    new_lease_id,
    refuse_in_caller_transaction,
)
from ..orm import OrmGrantPoint
from .procedures import ACQUIRE, RELEASE

__all__ = ["MySQLGrantPoint", "MySQLOrmGrantPoint", "error_code"]

T = TypeVar("T")

# InnoDB ends one of two transactions that wait for each other's row locks and
# says "try restarting transaction". Racing inserts of a key whose row was just
# deleted (pruned) do this even under READ COMMITTED. The transaction it ended
# was rolled back whole: nothing was granted, so it is run again.
DEADLOCK = 1213
DEADLOCK_RETRIES = 5
# "PROCEDURE ... does not exist": migrate has not created them here.
NO_SUCH_PROCEDURE = 1305


def error_code(error: BaseException) -> int | None:
    """The server's error number of a (Django-wrapped) MySQLdb error, or None."""
    cause = error.__cause__ if error.__cause__ is not None else error
    args = getattr(cause, "args", ())
    return args[0] if args and isinstance(args[0], int) else None


def _retried_on_deadlock(method: Callable[..., T]) -> Callable[..., T]:
    @functools.wraps(method)
    def retrying(self: MySQLOrmGrantPoint, *args: Any, **kwargs: Any) -> T:
        for attempt in range(1, DEADLOCK_RETRIES):
            try:
                return method(self, *args, **kwargs)
            except OperationalError as error:
                if error.__cause__ is None or error_code(error) != DEADLOCK:
                    raise
            time.sleep(random.uniform(0.001, 0.005) * attempt)
        return method(self, *args, **kwargs)  # the last try: its deadlock is raised

    return retrying


class MySQLOrmGrantPoint(OrmGrantPoint):
    """The ORM grant point on MariaDB (``COORDINATION["GRANT_POINT"] = "orm"``, and
    every change but acquire and release of the procedure grant point); a
    transaction InnoDB ended as a deadlock's victim is run again (at most five times)."""

    name = "orm"

    @contextmanager
    def transaction(self) -> Iterator[BaseDatabaseWrapper]:
        """The grant point's transaction, bounded as on PostgreSQL: MariaDB ends the
        session of a client that idles more than ``IDLE_BOUND`` seconds inside it
        (its rows freed; the client gets ``GrantPointUnavailable``). The bound is a
        session variable, so it is set before the transaction and reset after it:
        the caller's own transactions on this connection keep the server's."""
        connection = self.connection
        refuse_in_caller_transaction(connection)
        if not getattr(connection, "mysql_is_mariadb", False):
            # MySQL has no such variable: no bound there.
            with super().transaction() as connection:
                yield connection
            return
        with connection.cursor() as cursor:
            cursor.execute(f"SET SESSION idle_transaction_timeout = {math.ceil(IDLE_BOUND)}")
        try:
            with super().transaction() as connection:
                yield connection
        finally:
            # A session the server ended has nothing to reset (Django closes it).
            with suppress(DatabaseError), connection.cursor() as cursor:
                cursor.execute("SET SESSION idle_transaction_timeout = DEFAULT")

    acquire = _retried_on_deadlock(OrmGrantPoint.acquire)
    acquire_many = _retried_on_deadlock(OrmGrantPoint.acquire_many)
    acquire_shared = _retried_on_deadlock(OrmGrantPoint.acquire_shared)
    renew_exclusive = _retried_on_deadlock(OrmGrantPoint.renew_exclusive)
    release_exclusive = _retried_on_deadlock(OrmGrantPoint.release_exclusive)
    renew_shared = _retried_on_deadlock(OrmGrantPoint.renew_shared)
    release_shared = _retried_on_deadlock(OrmGrantPoint.release_shared)
    revoke = _retried_on_deadlock(OrmGrantPoint.revoke)
    close_revoked_readers = _retried_on_deadlock(OrmGrantPoint.close_revoked_readers)


def _utc(value: dt.datetime | None) -> dt.datetime | None:
    # The procedures read UTC_TIMESTAMP(6) and the app's naive UTC columns.
    return None if value is None else value.replace(tzinfo=dt.UTC)


class MySQLGrantPoint(MySQLOrmGrantPoint):
    """The default on MariaDB: acquire and release are one stored-procedure call each
    (:mod:`.procedures`); the rest is the ORM transaction."""

    name = "mysql"

    def __init__(self, alias: str, dialect: IdleBound) -> None:
        super().__init__(alias, dialect)
        self._cursors: WeakKeyDictionary[BaseDatabaseWrapper, Any] = WeakKeyDictionary()

    def call(self, sql: str, params: tuple[object, ...]) -> tuple[Any, ...]:
        """One ``CALL`` on the connection's MySQLdb handle: the procedure's one row.
        A missing procedure says what to do."""
        connection = self.connection
        try:
            with connection.wrap_database_errors:
                if connection.connection is None:
                    connection.ensure_connection()
                raw = connection.connection
                cursor = self._cursors.get(connection)
                if cursor is None or cursor.connection is not raw:
                    # Kept with the Django connection object, for the MySQLdb
                    # connection it has now (a reconnect makes a new one).
                    cursor = self._cursors[connection] = raw.cursor()
                try:
                    cursor.execute(sql, params)
                    row = cursor.fetchone()
                    while cursor.nextset():  # the CALL's own status
                        pass
                except BaseException:
                    del self._cursors[connection]
                    with suppress(Exception):
                        cursor.close()
                    raise
        except DatabaseError as error:
            if error_code(error) != NO_SUCH_PROCEDURE:
                raise
            raise ImproperlyConfigured(
                f"the grant point's procedures are missing in database {self.alias!r} "
                f"({error}). Run migrate; if the app may not create procedures there, set "
                "COORDINATION['GRANT_POINT'] = 'orm'."
            ) from error
        assert row is not None
        return tuple(row)

    @_retried_on_deadlock
    def acquire(
        self, key: str, holder: str, ttl: float, lock_delay: float, ticket: int | None
    ) -> Acquired:
        # One call: the procedure's transaction is the grant's own.
        refuse_in_caller_transaction(self.connection)
        lease_id = new_lease_id()
        lease_hash = hash_lease_id(lease_id)
        # Without a ticket every live ticket of the key is ahead: no barging past
        # fair waiters.
        place = MAX_TOKEN if ticket is None else ticket
        params = (key, holder, lease_hash, float(ttl), float(lock_delay), place, MAX_TOKEN)
        while True:
            (
                granted, _lock_id, token, current_holder, acquired_at, expires_at, now,
                current_delay, delay_until, ahead, _grant_id, prev_token, prev_holder,
                prev_acquired_at, prev_expires_at, floor,
            ) = self.call(ACQUIRE, params)
            if granted:
                break
            # Why: held, lock-delay, the queue, or out of tokens (decided under the
            # row lock; if the rule finds none, the clock moved past a boundary).
            refusal = grant_refusal(
                LockSnapshot(
                    key, token or 0, current_holder or "", "", _utc(expires_at),
                    current_delay or 0.0, _utc(delay_until),
                ),
                _utc(now), ahead, floor,  # type: ignore[arg-type]
            )
            if refusal is not None:
                raise refusal
        lease = Lease(
            key=key, token=token, lease_id=lease_id, holder=holder,
            acquired_at=acquired_at.replace(tzinfo=dt.UTC),
            expires_at=expires_at.replace(tzinfo=dt.UTC),
        )
        taken_over = (
            None if prev_expires_at is None
            else TakenOver(prev_token, prev_holder, _utc(prev_acquired_at), _utc(prev_expires_at))
        )
        return Acquired(lease, taken_over)

    @_retried_on_deadlock
    def release_exclusive(self, grant: Lease) -> Ended:
        refuse_in_caller_transaction(self.connection)
        released, now, ended_at, end_reason, lock_id, token, holder, lease_hash, expires_at = (
            self.call(RELEASE, (grant.key, grant.token, hash_lease_id(grant.lease_id)))
        )
        if not released:
            # Not the current lease: say precisely why, as the ORM path does.
            if lock_id is None:
                raise never_granted(grant.key)
            snapshot = LockSnapshot(
                grant.key, token, holder, lease_hash, _utc(expires_at), 0.0, None
            )
            raise lease_refusal(snapshot, grant, _utc(now)) or LeaseLost(  # type: ignore[arg-type]
                f"lease of {grant.key!r} token {grant.token} is not current"
            )
        ended = _utc(ended_at)
        assert ended is not None
        if end_reason == GrantEnd.EXPIRED:
            return Ended(GrantEnd.EXPIRED, ended, ended)
        return Ended(GrantEnd.RELEASED, ended, None)
