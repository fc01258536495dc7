"""The grant point: lease locks that issue fencing tokens.

Every grant is one atomic state change of the lock's row. On PostgreSQL it is
one call of a PL/pgSQL function (:mod:`coordination.pgsql`) in its own
transaction: an ``INSERT ... ON CONFLICT (key) DO UPDATE ... WHERE <free>``
locks the row (creating it if missing), reads ``clock_timestamp()`` after the
lock is held, decides free or held and raises the token counter by one; the
same transaction closes the expired previous grant and records the new one.
On SQLite the
same decision is an ORM transaction under BEGIN IMMEDIATE (the database write
lock): create the row if missing, lock it, read the clock, decide, record.
Whoever holds the row lock is the only one deciding, so tokens of a key are
unique and strictly increasing in grant order, and two leases of a key never
overlap in database time. Renew and revoke lock the row with
``SELECT ... FOR UPDATE``.

A lease only says the holder *was* granted the lock: a paused holder does not
know its lease ended. Pass ``grant`` to the fenced writes of
:mod:`coordination.fencing`; they refuse a token once a newer one has written.
"""

from __future__ import annotations

import contextvars
import datetime as dt
import logging
import math
import random
import secrets
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Any, NamedTuple, TypeVar, cast

from django.db import connections, transaction
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.models import Model
from django.db.models.base import ModelState

from . import pgsql, signals
from .conf import app_settings
from .exceptions import InTransaction, InvalidInput, LeaseLost, LockHeld, TokenExhausted
from .models import (
    MAX_TOKEN,
    Grant,
    GrantEnd,
    Lock,
    LockState,
    Ticket,
    hash_lease_id,
    lease_matches,
    validate_holder,
    validate_key,
)

__all__ = [
    "acquire",
    "current_grant",
    "database_now",
    "grant_from_proof",
    "hold",
    "release",
    "renew",
    "revoke",
    "use_grant",
]

logger = logging.getLogger("coordination.locks")

_M = TypeVar("_M", bound=Model)

_current_grant: contextvars.ContextVar[Grant | None] = contextvars.ContextVar(
    "coordination_current_grant", default=None
)


def current_grant() -> Grant | None:
    """The grant of the enclosing ``hold()``, ``use_grant()`` or fenced task, if any."""
    return _current_grant.get()


@contextmanager
def use_grant(grant: Grant) -> Iterator[Grant]:
    """Make ``grant`` the one fenced writes use when none is passed, within the block."""
    reset = _current_grant.set(grant)
    try:
        yield grant
    finally:
        _current_grant.reset(reset)


def database_now(using: str | None = None) -> dt.datetime:
    """The database server's current time (aware, UTC): the only clock leases use."""
    connection = connections[using or app_settings.DATABASE]
    return _read_clock(connection)


def acquire(
    key: str,
    *,
    holder: str,
    ttl: float | None = None,
    wait: float = 0.0,
    fair: bool = False,
    lock_delay: float | None = None,
    using: str | None = None,
) -> Grant:
    """Grant the lock ``key`` to ``holder`` for ``ttl`` seconds of database time.

    Returns the :class:`~coordination.models.Grant` with ``.key``, ``.token`` (strictly
    greater than every earlier token of ``key``), ``.lease_id`` (the secret that
    ``renew`` and ``release`` need), ``.holder`` and ``.expires_at``.

    With ``wait`` > 0, blocks up to that many seconds, waking when the current
    lease ends, when it is released or revoked (PostgreSQL LISTEN/NOTIFY, a hint
    that is always re-checked), or after a back-off step with jitter. With
    ``fair=True`` the waiter takes a ticket in the key's queue and waiters are
    granted in ticket order; a waiter that gives up leaves the queue.
    ``lock_delay`` (default ``COORDINATION["LOCK_DELAY"]``) keeps the lock
    ungrantable for that many seconds if this lease expires or is revoked.

    Raises ``LockHeld`` (who holds it, until when, ``retry_after`` seconds) if still
    busy, ``InvalidInput`` for a bad key, holder, ttl, wait or lock_delay,
    ``TokenExhausted`` after token 2**63 - 1, and ``InTransaction`` inside
    ``transaction.atomic()``.
    """
    key = validate_key(key)
    holder = validate_holder(holder)
    lease = _validate_ttl(app_settings.DEFAULT_TTL if ttl is None else ttl)
    wait = _validate_seconds(wait, "wait", upper=float(app_settings.MAX_WAIT))
    delay = _validate_seconds(
        app_settings.LOCK_DELAY if lock_delay is None else lock_delay,
        "lock_delay", upper=float(app_settings.MAX_TTL),
    )
    alias = using or app_settings.DATABASE
    started = time.monotonic()
    if wait <= 0:
        grant = _grant(key, holder, lease, delay, None, alias, retry=True)
    else:
        grant = _wait_for_grant(key, holder, lease, delay, wait, fair, alias)
    if logger.isEnabledFor(logging.INFO):
        logger.info(
            "lock acquired key=%s token=%d holder=%s expires_at=%s",
            key, grant.token, holder, grant.expires_at.isoformat(),
        )
    taken_over: _TakenOver | None = getattr(grant, "taken_over", None)
    if taken_over is not None:
        signals.lock_expired.send(sender=Grant, key=key, **taken_over._asdict())
    signals.lock_acquired.send(sender=Grant, grant=grant, waited=time.monotonic() - started)
    return grant


class _TakenOver(NamedTuple):
    """The lease an acquire found expired and closed (unknown fields are None)."""

    token: int | None
    holder: str | None
    acquired_at: dt.datetime | None
    expired_at: dt.datetime | None


def _wait_for_grant(
    key: str, holder: str, lease: float, delay: float, wait: float, fair: bool, alias: str
) -> Grant:
    deadline = time.monotonic() + wait
    backoff = float(app_settings.POLL_INTERVAL)
    ceiling = float(app_settings.MAX_POLL_INTERVAL)
    # Free at once is the common case: no wake-up connection, no ticket.
    with suppress(LockHeld):
        return _grant(key, holder, lease, delay, None, alias, retry=True)
    with _Waiter(key, holder, alias, fair=fair, wait=wait) as waiter:
        while True:
            try:
                grant = _grant(key, holder, lease, delay, waiter.ticket, alias, retry=True)
            except LockHeld as held:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise
                if waiter.woken_by_notify:
                    # Woken by release or revoke: sleep to the lease's end, the
                    # ceiling as a safety net for a lost notification.
                    pause = min(held.retry_after + 0.002, remaining, ceiling)
                else:
                    # Polling: until the lease ends or the back-off step, whichever
                    # is first; jitter spreads contending waiters.
                    pause = min(
                        backoff * random.uniform(0.5, 1.0), held.retry_after + 0.002, remaining
                    )
                    backoff = min(backoff * 2, ceiling)
                waiter.sleep(max(pause, 0.001))
                continue
            waiter.ticket = None  # consumed by the grant
            return grant


def renew(grant: Grant, *, ttl: float | None = None, using: str | None = None) -> Grant:
    """Extend ``grant``'s lease to ``ttl`` seconds from now (database time).

    Only the current holder can renew: the lease must not have expired, been
    released, revoked or taken over, and ``grant.lease_id`` must match. Otherwise
    raises ``LeaseLost`` and marks the grant lost. Returns the same grant with
    ``expires_at`` moved.
    """
    lease = _validate_ttl(app_settings.DEFAULT_TTL if ttl is None else ttl)
    alias = using or app_settings.DATABASE
    try:
        with _grant_transaction(alias) as connection:
            lock = _locked_row(grant.key, alias, create=False)
            now = _read_clock(connection)
            _check_holds(lock, grant, now)
            expires_at = now + dt.timedelta(seconds=lease)
            Lock.objects.using(alias).filter(pk=lock.pk).update(expires_at=expires_at)
            Grant.objects.using(alias).filter(lock_id=lock.pk, token=grant.token).update(
                expires_at=expires_at
            )
    except LeaseLost as lost:
        grant.mark_lost()
        logger.warning("lease lost key=%s token=%d: %s", grant.key, grant.token, lost.detail)
        signals.lock_lost.send(sender=Grant, grant=grant, error=lost)
        raise
    grant.expires_at = expires_at
    signals.lock_renewed.send(sender=Grant, grant=grant)
    return grant


def release(grant: Grant, *, using: str | None = None) -> Grant:
    """End ``grant``'s lease; the lock is free at once. Returns the ended grant.

    Only the current holder's lease is released, never a newer holder's. Raises
    ``LeaseLost`` if the grant is no longer the current lease; if it merely
    expired and nobody took the lock since, the lock is freed and its grant
    recorded as expired before ``LeaseLost`` is raised, so the caller learns that
    its work ran past its lease.
    """
    alias = using or app_settings.DATABASE
    connection = connections[alias]
    if connection.vendor == "postgresql":
        reason, ended_at, expired_at = _release_by_function(grant, connection)
    else:
        reason, ended_at, expired_at = _release_in_transaction(grant, alias)
    grant.ended_at, grant.end_reason = ended_at, reason
    if expired_at is not None:
        grant.mark_lost()
        signals.lock_expired.send(
            sender=Grant, key=grant.key, token=grant.token, holder=grant.holder,
            acquired_at=grant.acquired_at, expired_at=expired_at,
        )
        raise LeaseLost(
            f"lease of {grant.key!r} token {grant.token} expired at "
            f"{expired_at.isoformat()} before release; the lock is now free"
        )
    logger.info("lock released key=%s token=%d", grant.key, grant.token)
    signals.lock_released.send(sender=Grant, grant=grant, reason=reason)
    return grant


def _release_in_transaction(
    grant: Grant, alias: str
) -> tuple[GrantEnd, dt.datetime, dt.datetime | None]:
    with _grant_transaction(alias) as connection:
        lock = _locked_row(grant.key, alias, create=False)
        now = _read_clock(connection)
        expired_at: dt.datetime | None = None
        try:
            _check_holds(lock, grant, now)
            reason, ended_at = GrantEnd.RELEASED, now
        except LeaseLost:
            if not _is_current_lease(lock, grant) or lock.expires_at is None:
                raise
            expired_at = lock.expires_at
            reason, ended_at = GrantEnd.EXPIRED, expired_at
        _end_current(lock, reason, ended_at, alias)
    return reason, ended_at, expired_at


def revoke(key: str, *, using: str | None = None) -> Grant | None:
    """Operator take-over: end the current lease of ``key`` (held or expired).

    The holder's renew and release fail from now on with ``LeaseLost``, and the
    next acquire gets a higher token, whose first write fences the revoked
    holder out. Returns the revoked grant, or None if the lock was free.
    """
    key = validate_key(key)
    alias = using or app_settings.DATABASE
    with _grant_transaction(alias) as connection:
        try:
            lock = _locked_row(key, alias, create=False)
        except LeaseLost:
            return None
        if not lock.holder:
            return None
        now = _read_clock(connection)
        _end_current(lock, GrantEnd.REVOKED, now, alias)
        _notify(connection, key)
    logger.warning("lock revoked key=%s token=%d holder=%s", key, lock.token, lock.holder)
    grant = Grant.objects.using(alias).filter(lock_id=lock.pk, token=lock.token).first()
    if grant is not None:
        grant.lock = lock
        signals.lock_released.send(sender=Grant, grant=grant, reason=GrantEnd.REVOKED)
    return grant


@contextmanager
def hold(
    key: str,
    *,
    holder: str,
    ttl: float | None = None,
    wait: float = 0.0,
    using: str | None = None,
) -> Iterator[Grant]:
    """Acquire ``key``, make the grant current for fenced writes, release on exit.

    If the block succeeded but the lease was lost meanwhile, release raises
    ``LeaseLost`` so the caller learns its work ran unprotected by the lease (the
    fenced writes inside it were still checked).
    """
    grant = acquire(key, holder=holder, ttl=ttl, wait=wait, using=using)
    try:
        with use_grant(grant):
            yield grant
    except BaseException:
        with suppress(LeaseLost):
            release(grant, using=using)
        raise
    release(grant, using=using)


def grant_from_proof(
    key: str, token: int, lease_id: str, *, using: str | None = None
) -> Grant:
    """Rebuild a grant from its proof (key, token, lease_id), as REST clients present it.

    Raises ``LeaseLost`` unless ``lease_id`` is the secret of the grant ``token`` of
    ``key`` (compared in constant time) and that grant was not revoked. Whether a
    newer token has written is for the fence to decide.
    """
    key = validate_key(key)
    alias = using or app_settings.DATABASE
    found = (
        Grant.objects.using(alias)
        .select_related("lock")
        .filter(lock__key=key, token=token)
        .first()
    )
    if found is None or not lease_matches(found.lease_hash, lease_id):
        raise LeaseLost(f"no grant of {key!r} with token {token} matches this lease_id")
    if found.end_reason == GrantEnd.REVOKED:
        raise LeaseLost(f"grant {token} of {key!r} was revoked")
    found.lease_id = lease_id
    return found


# --- waiting: wake-ups and the fair queue ------------------------------------

WAKE_UP_CHANNEL = "coordination_lock"
"""PostgreSQL NOTIFY channel of releases and revocations; the payload is the key."""


def _notify(connection: BaseDatabaseWrapper, key: str) -> None:
    if connection.vendor == "postgresql" and app_settings.WAKE_UPS:
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_notify(%s, %s)", [WAKE_UP_CHANNEL, key])


def _listen(alias: str) -> Any:
    """A connection of its own LISTENing for releases and revocations, or None."""
    import psycopg

    params = connections[alias].get_connection_params()
    for django_only in ("cursor_factory", "context", "server_side_binding"):
        params.pop(django_only, None)
    try:
        listening = psycopg.connect(**params, autocommit=True)
        listening.execute(f"LISTEN {WAKE_UP_CHANNEL}")
    except Exception as error:
        logger.warning("cannot LISTEN for wake-ups, polling instead: %s", error)
        return None
    return listening


class _Waiter:
    """A waiting acquire: its wake-up connection and its fair-queue ticket.

    On PostgreSQL the waiter LISTENs on a connection of its own, opened before
    its next attempt, so that a release committed after an attempt has read the
    lock always wakes it (notifications queue on the connection until read). A
    notification is only a hint to try again: the grant point decides.
    """

    def __init__(
        self, key: str, holder: str, alias: str, *, fair: bool, wait: float = 0.0
    ) -> None:
        self.key, self.holder, self.alias, self.fair = key, holder, alias, fair
        self.ticket: int | None = None
        self.listening: Any = None
        self.registered = False
        self._wake_until = time.monotonic() + wait
        self._heartbeat_at = 0.0

    @property
    def woken_by_notify(self) -> bool:
        return self.listening is not None and self.registered

    def __enter__(self) -> _Waiter:
        if connections[self.alias].vendor == "postgresql" and app_settings.WAKE_UPS:
            self.listening = _listen(self.alias)
            self._register()
        if self.fair:
            self._take_ticket()
        return self

    def _register(self) -> None:
        """Ask releases of the key to notify, until this waiter gives up (and a
        second more). Until it has (no lock row yet), the waiter polls."""
        seconds = max(self._wake_until - time.monotonic(), 0.0) + 1.0
        try:
            found = _execute(
                connections[self.alias], _WAKE_ME_SQL, {"key": self.key, "seconds": seconds}
            )
        except Exception as error:
            logger.warning("cannot ask for wake-ups, polling instead: %s", error)
            found = None
        self.registered = found is not None

    def __exit__(self, *exc_info: object) -> None:
        if self.listening is not None:
            with suppress(Exception):
                self.listening.close()
        if self.ticket is not None:
            # Gave up (or failed): leave the queue at once, and let the next
            # waiter know it may be first now.
            with suppress(Exception):
                Ticket.objects.using(self.alias).filter(pk=self.ticket).delete()
                _notify(connections[self.alias], self.key)

    def sleep(self, pause: float) -> None:
        if self.fair:
            # Keep the ticket alive: wake up in time to renew it.
            pause = min(pause, float(app_settings.TICKET_TTL) / 3)
        if self.listening is not None and self.registered:
            self._wait_for_notification(pause)
        else:
            time.sleep(pause)
            if self.listening is not None:
                self._register()  # before the next attempt, so its release notifies
        if self.fair and time.monotonic() >= self._heartbeat_at:
            self._heartbeat()

    def _wait_for_notification(self, pause: float) -> None:
        deadline = time.monotonic() + pause
        try:
            while (left := deadline - time.monotonic()) > 0:
                for note in self.listening.notifies(timeout=left, stop_after=1):
                    if note.payload == self.key:
                        return
        except Exception as error:
            # The hint is lost, not the lock: poll from here on.
            logger.warning("wake-up connection lost, polling instead: %s", error)
            with suppress(Exception):
                self.listening.close()
            self.listening = None

    def _take_ticket(self) -> None:
        now = database_now(self.alias)
        tickets = Ticket.objects.using(self.alias)
        # Tickets of crashed waiters hold nobody up once expired; clear them away.
        tickets.filter(lock_key=self.key, expires_at__lte=now).delete()
        expires_at = now + dt.timedelta(seconds=app_settings.TICKET_TTL)
        ticket = tickets.create(
            lock_key=self.key, holder=self.holder, expires_at=expires_at
        )
        self.ticket = ticket.pk
        self._heartbeat_at = time.monotonic() + float(app_settings.TICKET_TTL) / 3

    def _heartbeat(self) -> None:
        assert self.ticket is not None
        expires_at = database_now(self.alias) + dt.timedelta(seconds=app_settings.TICKET_TTL)
        kept = Ticket.objects.using(self.alias).filter(pk=self.ticket).update(expires_at=expires_at)
        if not kept:
            # Expired and removed by nobody, or deleted: queue again, at the back.
            self._take_ticket()
        self._heartbeat_at = time.monotonic() + float(app_settings.TICKET_TTL) / 3


# --- the transaction on one lock row ---------------------------------------


@contextmanager
def _grant_transaction(alias: str) -> Iterator[BaseDatabaseWrapper]:
    """A transaction of its own: a grant must be durable when acquire() returns.

    Inside an outer transaction a rollback would un-issue a token the caller may
    already have used, and the next acquire would issue it again.
    """
    atomic = transaction.atomic(using=alias, durable=True)
    try:
        atomic.__enter__()
    except RuntimeError:
        raise InTransaction() from None
    try:
        yield connections[alias]
    except BaseException as error:
        atomic.__exit__(type(error), error, error.__traceback__)
        raise
    atomic.__exit__(None, None, None)


def _locked_row(key: str, alias: str, *, create: bool) -> Lock:
    rows = Lock.objects.using(alias).select_for_update()
    try:
        return rows.get(key=key)
    except Lock.DoesNotExist:
        if not create:
            raise LeaseLost(f"lock {key!r} has never been granted") from None
    # ON CONFLICT DO NOTHING: racing first acquirers of a new key both get past
    # here without an error, then queue on the same row lock.
    Lock.objects.using(alias).bulk_create([Lock(key=key)], ignore_conflicts=True)
    return rows.get(key=key)


def _read_clock(connection: BaseDatabaseWrapper) -> dt.datetime:
    # Read after the row lock is held, so waiting for the lock cannot make the
    # decision (or the new lease's start) use a time from before the wait.
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute("SELECT clock_timestamp()")
            (now,) = cursor.fetchone()
            return cast(dt.datetime, now).astimezone(dt.UTC)
        cursor.execute("SELECT STRFTIME('%Y-%m-%d %H:%M:%f', 'NOW')")
        (text,) = cursor.fetchone()
        return dt.datetime.fromisoformat(text).replace(tzinfo=dt.UTC)


def _grant(
    key: str, holder: str, lease: float, delay: float, ticket: int | None, alias: str,
    *, retry: bool,
) -> Grant:
    connection = connections[alias]
    while True:
        try:
            if connection.vendor == "postgresql":
                return _grant_by_function(key, holder, lease, delay, ticket, connection)
            return _grant_in_transaction(key, holder, lease, delay, ticket, alias)
        except _Retry:
            if not retry:  # pragma: no cover
                raise
            continue


def _grant_in_transaction(
    key: str, holder: str, lease: float, delay: float, ticket: int | None, alias: str
) -> Grant:
    with _grant_transaction(alias) as connection:
        lock = _locked_row(key, alias, create=True)
        now = _read_clock(connection)
        ahead = _tickets_ahead(key, ticket, now, alias)
        _refuse_unless_grantable(lock, now, ahead)
        taken_over = None
        if lock.holder:
            # The previous lease ran out without a release: close it as expired.
            assert lock.expires_at is not None
            taken_over = _TakenOver(lock.token, lock.holder, lock.acquired_at, lock.expires_at)
            _end_current(lock, GrantEnd.EXPIRED, lock.expires_at, alias)
        lease_id = secrets.token_urlsafe(32)
        lease_hash = hash_lease_id(lease_id)
        token = lock.token + 1
        expires_at = now + dt.timedelta(seconds=lease)
        Lock.objects.using(alias).filter(pk=lock.pk).update(
            token=token, holder=holder, lease_hash=lease_hash,
            acquired_at=now, expires_at=expires_at, lock_delay=delay, delay_until=None,
        )
        lock.token, lock.holder, lock.lease_hash = token, holder, lease_hash
        lock.acquired_at, lock.expires_at = now, expires_at
        lock.lock_delay, lock.delay_until = delay, None
        grant = Grant.objects.using(alias).create(
            lock=lock, token=token, holder=holder, lease_hash=lease_hash,
            acquired_at=now, expires_at=expires_at,
        )
        if ticket is not None:
            Ticket.objects.using(alias).filter(pk=ticket).delete()
    grant.lease_id = lease_id
    grant.taken_over = taken_over  # type: ignore[attr-defined]
    return grant


def _tickets_ahead(key: str, ticket: int | None, now: dt.datetime, alias: str) -> int:
    """Live tickets in the fair queue of ``key`` before ``ticket`` (all, without one)."""
    queue = Ticket.objects.using(alias).filter(lock_key=key, expires_at__gt=now)
    if ticket is not None:
        queue = queue.filter(id__lt=ticket)
    return queue.count()


def _refuse_unless_grantable(lock: Lock, now: dt.datetime, ahead: int) -> None:
    """Raise LockHeld or TokenExhausted unless ``lock`` can be granted at ``now``.

    Held: the lease runs, or it ended by expiry or revocation less than its
    lock-delay ago, or fair waiters queue ahead of this one.
    """
    key = lock.key
    if lock.state_at(now) is LockState.HELD:
        assert lock.expires_at is not None
        raise LockHeld(key, lock.holder, lock.expires_at, (lock.expires_at - now).total_seconds())
    if lock.holder and lock.lock_delay:
        assert lock.expires_at is not None
        until = lock.expires_at + dt.timedelta(seconds=lock.lock_delay)
        if until > now:
            raise LockHeld(
                key, f"{lock.holder} (lock-delay after expiry)", until,
                (until - now).total_seconds(),
            )
    if not lock.holder and lock.delay_until is not None and lock.delay_until > now:
        raise LockHeld(
            key, "lock-delay after an expired or revoked lease", lock.delay_until,
            (lock.delay_until - now).total_seconds(),
        )
    if ahead:
        raise LockHeld(
            key, f"{ahead} fair waiter(s) queued first", now,
            float(app_settings.POLL_INTERVAL),
        )
    if lock.token >= MAX_TOKEN:
        raise TokenExhausted(
            f"lock {key!r} has issued token {lock.token}, the largest 64-bit token; "
            "tokens never wrap: retire this key"
        )


# --- PostgreSQL: one function call per grant and per release ----------------
#
# The same decision as the transaction above, in one round trip: the functions
# of coordination.pgsql (installed by migration 0006) lock the key's row with
# an upsert, read clock_timestamp() after the row lock is held, and record the
# grant in the same transaction. The server caches the plans of the statements
# inside them per connection.

_ACQUIRE_CALL = f"SELECT * FROM {pgsql.ACQUIRE_FUNCTION}(%s, %s, %s, %s, %s, %s, %s)"
_RELEASE_CALL = f"SELECT * FROM {pgsql.RELEASE_FUNCTION}(%s, %s, %s, %s, %s)"

# A waiter says until when it may wait, before its next attempt; a release
# notifies only while someone may be waiting. The row lock orders this with
# the release's update: either the release sees it, or it committed first and
# the attempt after this sees the lock free.
_WAKE_ME_SQL = """
UPDATE {lock} SET wake_until = GREATEST(wake_until,
    clock_timestamp() + make_interval(secs => %(seconds)s))
WHERE key = %(key)s
RETURNING 1
"""


def _sql(template: str, connection: BaseDatabaseWrapper) -> str:
    key = (template, connection.vendor)
    text = _SQL_TEXT.get(key)
    if text is None:
        quote = connection.ops.quote_name
        text = _SQL_TEXT[key] = template.format(
            lock=quote(Lock._meta.db_table),
            grant=quote(Grant._meta.db_table),
            ticket=quote(Ticket._meta.db_table),
        )
    return text


_SQL_TEXT: dict[tuple[str, str], str] = {}


def _execute(
    connection: BaseDatabaseWrapper, template: str, params: dict[str, object] | tuple[object, ...]
) -> Any:
    """Run one grant-point statement and return its first row (or None).

    Prepared once per connection (saving the parse and plan of the call; the
    functions' own plans are cached either way) when
    ``COORDINATION["PREPARED_STATEMENTS"]`` is True, or when it is None (the
    default) and the connection prepares its own statements (Django's
    ``OPTIONS["prepare_threshold"]``). Django leaves preparation off by default
    for transaction-pooling proxies that cannot keep prepared statements.
    """
    with connection.wrap_database_errors:
        cursor = _cursor(connection)
        raw = cursor.connection
        prepare = app_settings.PREPARED_STATEMENTS
        if prepare is None:
            prepare = raw.prepare_threshold is not None
        if not prepare:
            cursor.execute(_sql(template, connection), params, prepare=False)
            return cursor.fetchone()
        threshold, raw.prepare_threshold = raw.prepare_threshold, 0
        try:
            cursor.execute(_sql(template, connection), params, prepare=True)
        finally:
            raw.prepare_threshold = threshold
        return cursor.fetchone()


def _cursor(connection: BaseDatabaseWrapper) -> Any:
    """A psycopg cursor of the connection's own, kept for the grant point's calls
    (server-side binding, unlike Django's cursors) until the connection changes."""
    import psycopg

    raw = connection.connection
    if raw is None:
        connection.ensure_connection()
        raw = connection.connection
    cursor = getattr(connection, "_coordination_cursor", None)
    if cursor is None or cursor.connection is not raw:
        cursor = psycopg.Cursor(raw)
        connection._coordination_cursor = cursor  # type: ignore[attr-defined]
    return cursor


def _refuse_in_caller_transaction(connection: BaseDatabaseWrapper) -> None:
    # The same rule as the durable atomic block of the ORM path: a grant must
    # commit when the grant point returns (the test case's own block excepted).
    if any(not getattr(block, "_from_testcase", False) for block in connection.atomic_blocks):
        raise InTransaction()


def _grant_by_function(
    key: str, holder: str, lease: float, delay: float, ticket: int | None,
    connection: BaseDatabaseWrapper,
) -> Grant:
    _refuse_in_caller_transaction(connection)
    lease_id = secrets.token_urlsafe(32)
    lease_hash = hash_lease_id(lease_id)
    # Without a ticket every live ticket of the key is ahead: no barging past
    # fair waiters.
    place = MAX_TOKEN if ticket is None else ticket
    row = _execute(
        connection, _ACQUIRE_CALL, (key, holder, lease_hash, lease, delay, place, MAX_TOKEN)
    )
    (
        granted, lock_id, token, current_holder, acquired_at, expires_at, now,
        lock_delay, delay_until, ahead, grant_id, prev_holder, prev_acquired_at, prev_expires_at,
    ) = row
    if not granted:
        # Why: held, lock-delay, the queue, or out of tokens. If none of these
        # holds any more (freed since the upsert), the caller tries again.
        state = Lock(
            key=key, token=token or 0, holder=current_holder or "", expires_at=expires_at,
            lock_delay=lock_delay or 0.0, delay_until=delay_until,
        )
        _refuse_unless_grantable(state, now, ahead)
        raise _Retry()
    alias = connection.alias
    lock = _loaded(Lock, alias, {
        "id": lock_id, "key": key, "token": token, "holder": holder, "lease_hash": lease_hash,
        "acquired_at": acquired_at, "expires_at": expires_at, "lock_delay": delay,
        "delay_until": None, "created_at": None, "wake_until": None,
    })
    grant = _loaded(Grant, alias, {
        "id": grant_id, "lock_id": lock_id, "token": token, "holder": holder,
        "lease_hash": lease_hash, "acquired_at": acquired_at, "expires_at": expires_at,
        "ended_at": None, "end_reason": "",
    })
    grant._state.fields_cache["lock"] = lock
    grant.lease_id = lease_id
    grant.taken_over = (  # type: ignore[attr-defined]
        None if prev_expires_at is None
        else _TakenOver(token - 1, prev_holder, prev_acquired_at, prev_expires_at)
    )
    return grant


def _loaded(model: type[_M], alias: str, values: dict[str, Any]) -> _M:
    """An instance of the row the grant point just wrote, built as unpickling
    builds one: every field from ``values``, marked as loaded from ``alias``.

    Model.__init__ (its per-field loop and the pre_init/post_init signals,
    which nothing listens to for these models) would be about a third of the
    grant point's own Python per acquire.
    """
    instance = model.__new__(model)
    instance.__dict__.update(values)
    state = instance._state = ModelState()
    state.adding, state.db = False, alias
    return instance


class _Retry(Exception):
    """The lock changed between the upsert and the look at why it refused."""


def _release_by_function(
    grant: Grant, connection: BaseDatabaseWrapper
) -> tuple[GrantEnd, dt.datetime, dt.datetime | None]:
    _refuse_in_caller_transaction(connection)
    row = _execute(connection, _RELEASE_CALL, (
        grant.key, grant.token, hash_lease_id(grant.lease_id or ""),
        bool(app_settings.WAKE_UPS), WAKE_UP_CHANNEL,
    ))
    released, now, ended_at, end_reason, lock_id, token, holder, lease_hash, expires_at = row
    if not released:
        # Not the current lease: say precisely why, as the ORM path does.
        if lock_id is None:
            raise LeaseLost(f"lock {grant.key!r} has never been granted")
        lock = Lock(
            id=lock_id, key=grant.key, token=token, holder=holder,
            lease_hash=lease_hash, expires_at=expires_at,
        )
        _check_holds(lock, grant, now)
        raise LeaseLost(f"lease of {grant.key!r} token {grant.token} is not current")
    if end_reason == GrantEnd.EXPIRED:
        return GrantEnd.EXPIRED, ended_at, ended_at
    return GrantEnd.RELEASED, ended_at or now, None


def _is_current_lease(lock: Lock, grant: Grant) -> bool:
    return (
        bool(lock.holder)
        and lock.token == grant.token
        and lease_matches(lock.lease_hash, grant.lease_id)
    )


def _check_holds(lock: Lock, grant: Grant, now: dt.datetime) -> None:
    if not lock.holder:
        raise LeaseLost(
            f"lock {lock.key!r} is free: the lease of token {grant.token} was released "
            "or revoked"
        )
    if lock.token != grant.token:
        raise LeaseLost(
            f"lock {lock.key!r} was taken over: token {lock.token} ({lock.holder}) is "
            f"current, not {grant.token}"
        )
    if not lease_matches(lock.lease_hash, grant.lease_id):
        raise LeaseLost(f"lease_id does not match the lease of {lock.key!r} token {grant.token}")
    assert lock.expires_at is not None
    if lock.expires_at <= now:
        raise LeaseLost(
            f"lease of {lock.key!r} token {grant.token} expired at "
            f"{lock.expires_at.isoformat()} (database time)"
        )


def _end_current(lock: Lock, reason: GrantEnd, ended_at: dt.datetime, alias: str) -> None:
    """Close the lock's current grant and free the row, keeping its token counter."""
    Grant.objects.using(alias).filter(lock_id=lock.pk, token=lock.token, ended_at=None).update(
        ended_at=ended_at, end_reason=reason
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


def _validate_ttl(ttl: object) -> float:
    return _validate_seconds(
        ttl,
        "ttl",
        lower=float(app_settings.MIN_TTL),
        upper=float(app_settings.MAX_TTL),
    )


def _validate_seconds(
    value: object, name: str, *, lower: float = 0.0, upper: float
) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidInput(f"{name} must be a number of seconds, not {type(value).__name__}")
    seconds = float(value)
    if not math.isfinite(seconds):
        raise InvalidInput(f"{name} must be a finite number of seconds")
    if seconds < lower or seconds > upper or (name == "ttl" and seconds <= 0):
        raise InvalidInput(f"{name} must be between {lower:g} and {upper:g} seconds, not {seconds:g}")
    return seconds
