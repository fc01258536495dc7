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
    LockSnapshot,
    TakenOver,
    grant_refusal,
    lease_refusal,
    never_granted,
    new_lease_id,
    refuse_in_caller_transaction,
)
from ..orm import OrmGrantPoint
from .procedures import ACQUIRE_PROCEDURE, RELEASE_PROCEDURE

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


# The start of each call's statement; its values follow, in parentheses.
_CALLS = {
    procedure: f"CALL {procedure}(".encode() for procedure in (ACQUIRE_PROCEDURE, RELEASE_PROCEDURE)
}


def _literal(raw: Any, value: Any) -> bytes:
    """``value`` as an SQL literal on the MySQLdb connection ``raw``: what its
    ``literal()`` writes, for the calls' own types without its dispatch."""
    kind = type(value)
    if kind is str:
        return raw.string_literal(value.encode(raw.encoding))  # type: ignore[no-any-return]
    if kind is int:
        return b"%d" % value
    if kind is float and math.isfinite(value):
        return repr(value).encode()  # the shortest text that reads back as the same double
    return raw.literal(value)  # type: ignore[no-any-return]


class MySQLGrantPoint(MySQLOrmGrantPoint):
    """The default on MariaDB: acquire and release are one stored-procedure call each
    (:mod:`.procedures`); the rest is the ORM transaction."""

    name = "mysql"

    def call(self, procedure: str, params: tuple[object, ...]) -> tuple[Any, ...]:
        """One ``CALL`` of ``procedure`` (:data:`ACQUIRE_PROCEDURE` or
        :data:`RELEASE_PROCEDURE`) with ``params``: the row it returns."""
        return self._call(self.connection, procedure, params)

    def _call(
        self, connection: BaseDatabaseWrapper, procedure: str, params: tuple[object, ...]
    ) -> tuple[Any, ...]:
        # Sent on the connection's MySQLdb handle, not through a cursor: one
        # query, its one row read with the connection's converters, then the
        # CALL's own status. Errors are Django's, as a cursor raises them; a
        # missing procedure says what to do.
        try:
            with connection.wrap_database_errors:
                if connection.connection is None:
                    connection.ensure_connection()
                raw = connection.connection
                raw.query(
                    _CALLS[procedure] + b",".join([_literal(raw, value) for value in params]) + b")"
                )
                rows = raw.store_result().fetch_row()
                while raw.next_result() == 0:  # the CALL's status: nothing to read
                    raw.store_result()
        except DatabaseError as error:
            if error_code(error) != NO_SUCH_PROCEDURE:
                raise
            raise ImproperlyConfigured(
                f"the grant point's procedures are missing in database {self.alias!r} "
                f"({error}). Run migrate; if the app may not create procedures there, set "
                "COORDINATION['GRANT_POINT'] = 'orm'."
            ) from error
        (row,) = rows
        return row  # type: ignore[no-any-return]

    @_retried_on_deadlock
    def acquire(
        self, key: str, holder: str, ttl: float, lock_delay: float, ticket: int | None
    ) -> Acquired:
        # One call: the procedure's transaction is the grant's own.
        connection = self.connection
        refuse_in_caller_transaction(connection)
        lease_id = new_lease_id()
        # Without a ticket every live ticket of the key is ahead: no barging past
        # fair waiters.
        place = MAX_TOKEN if ticket is None else ticket
        params = (
            key, holder, hash_lease_id(lease_id), float(ttl), float(lock_delay), place, MAX_TOKEN
        )
        while True:
            row = self._call(connection, ACQUIRE_PROCEDURE, params)
            if row[0]:
                break
            # Why: held, lock-delay, the queue, or out of tokens (decided under the
            # row lock; if the rule finds none, the clock moved past a boundary).
            _, token, current_holder, expires_at, now, current_delay, delay_until, ahead, floor = row
            refusal = grant_refusal(
                LockSnapshot(
                    key, token, current_holder, "", _utc(expires_at), current_delay,
                    _utc(delay_until),
                ),
                now.replace(tzinfo=dt.UTC), ahead, floor,
            )
            if refusal is not None:
                raise refusal
        lease = Lease(
            key=key, token=row[1], lease_id=lease_id, holder=holder,
            acquired_at=row[2].replace(tzinfo=dt.UTC), expires_at=row[3].replace(tzinfo=dt.UTC),
        )
        if len(row) == 4:
            return Acquired(lease, None)
        # It took over a lease that ran out without a release.
        _, _, _, _, prev_token, prev_holder, prev_acquired_at, prev_expires_at = row
        return Acquired(lease, TakenOver(
            prev_token, prev_holder, _utc(prev_acquired_at), _utc(prev_expires_at)
        ))

    @_retried_on_deadlock
    def release_exclusive(self, grant: Lease) -> Ended:
        connection = self.connection
        refuse_in_caller_transaction(connection)
        row = self._call(
            connection, RELEASE_PROCEDURE, (grant.key, grant.token, hash_lease_id(grant.lease_id))
        )
        if not row[0]:
            # Not the current lease: say precisely why, as the ORM path does.
            _, now, lock_id, token, holder, lease_hash, expires_at = row
            if lock_id is None:
                raise never_granted(grant.key)
            snapshot = LockSnapshot(
                grant.key, token, holder, lease_hash, _utc(expires_at), 0.0, None
            )
            raise lease_refusal(snapshot, grant, now.replace(tzinfo=dt.UTC)) or LeaseLost(
                f"lease of {grant.key!r} token {grant.token} is not current"
            )
        _, ended_at, expired = row
        ended = ended_at.replace(tzinfo=dt.UTC)
        if expired:
            return Ended(GrantEnd.EXPIRED, ended, ended)
        return Ended(GrantEnd.RELEASED, ended, None)
