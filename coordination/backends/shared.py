"""Shared (read) grants: many readers of a key at once, writers exclusive.

Readers and the writers of a key share its one lock row and its one token
counter, so the grant point's invariants hold unchanged (rule 3 of
docs/rules.md): every grant, shared or exclusive, takes the next token of the
key in the transaction that holds the key's row lock and records the grant.
A writer granted after a reader therefore holds a greater token than that
reader, and a fence that accepted the writer refuses the reader's late write.

While readers hold a key, its row carries their group as one lease: ``holder``
says how many readers hold it, ``expires_at`` is the end of the last reader's
lease, and ``lease_hash`` is :data:`SHARED_LEASE_HASH`, which no lease secret
hashes to (a hash is 64 hex digits). So the exclusive grant (the PL/pgSQL
function, or the ORM transaction) sees a held lock and refuses writers until
the last reader's lease ends, by its own unchanged rule: the writers' rules
are the seed's. Each reader's own lease lives in its Grant row (``mode``
``"shared"``), which renew and release check against the lease's secret.

Every method of :class:`SharedLeases` is one transaction of the grant point's own
(:meth:`GrantPoint.transaction`, ``InTransaction`` inside the caller's) that
locks the key's row with ``SELECT ... FOR UPDATE`` (the row lock the SQL
functions take; on SQLite the database write lock) and reads the database
clock and the token floor after it: the ORM code of
:mod:`coordination.backends.orm`, on every backend.
"""

from __future__ import annotations

import abc
import datetime as dt

from django.db.models import Count, F, Max

from ..exceptions import LeaseLost
from ..leases import Lease
from ..models import (
    Grant,
    GrantEnd,
    GrantMode,
    Lock,
    Ticket,
    TokenFloor,
    hash_lease_id,
    lease_matches,
)
from .base import (
    Acquired,
    Ended,
    GrantPoint,
    LockSnapshot,
    TakenOver,
    grant_refusal,
    never_granted,
    new_lease_id,
    next_token,
)

__all__ = ["SHARED_LEASE_HASH", "SharedLeases", "shared_holders"]

SHARED_LEASE_HASH = "shared"
"""The ``lease_hash`` of a lock row held by readers: never the hash of a secret."""


def shared_holders(count: int) -> str:
    """The ``holder`` a lock row shows while ``count`` readers hold it."""
    return f"{count} shared holder{'s' if count != 1 else ''}"


def held_by_readers(lock: Lock | LockSnapshot) -> bool:
    """Whether the lock row carries a group of readers (live or expired)."""
    return bool(lock.holder) and lock.lease_hash == SHARED_LEASE_HASH


class SharedLeases(GrantPoint):
    """Shared (read) leases for a grant point: the ORM transactions of this
    module, the same on every backend (the exclusive grant stays the backend's
    own). A backend that mixes this in provides :meth:`_locked_row`."""

    @abc.abstractmethod
    def _locked_row(self, key: str, *, create: bool = False) -> Lock | None:
        """The key's row, locked until the transaction ends (created if ``create``)."""

    def acquire_shared(
        self, key: str, holder: str, ttl: float, lock_delay: float, ticket: int | None = None
    ) -> Acquired:
        """Grant ``key`` to ``holder`` as one more reader for ``ttl`` seconds.

        Grantable when the key is free, held by readers whose group lease is live,
        or held by a lease (a writer's or the readers') that has expired with its
        lock-delay over; and, as for writers, when no fair waiter's live ticket is
        ahead (``ticket``: the reader's own place in the key's queue, which the
        grant consumes; without one every live ticket is ahead, so a writer queued
        fairly is never overtaken by readers) and a token is left. Otherwise
        raises the ``LockHeld`` or ``TokenExhausted`` of
        :func:`~coordination.backends.base.grant_refusal`. The reader gets the
        key's next token; the group's lease is extended to cover its own.
        """
        alias = self.alias
        with self.transaction():
            self.guard_promotion()  # first, as the acquire function runs it: same lock order
            lock = self._locked_row(key, create=True)
            assert lock is not None
            now = self.now()
            floor = TokenFloor.objects.using(alias).value()
            snapshot = LockSnapshot.of(lock)
            live_group = held_by_readers(lock) and lock.expires_at is not None and lock.expires_at > now
            # Joining a live group: only the fair queue and the token limit can refuse.
            rule_sees = snapshot._replace(holder="", delay_until=None) if live_group else snapshot
            queue = Ticket.objects.using(alias).filter(lock_key=key, expires_at__gt=now)
            ahead = (queue if ticket is None else queue.filter(id__lt=ticket)).count()
            refusal = grant_refusal(rule_sees, now, ahead, floor)
            if refusal is not None:
                raise refusal
            taken_over = None
            if lock.holder and not live_group:
                assert lock.expires_at is not None
                taken_over = TakenOver(lock.token, lock.holder, lock.acquired_at, lock.expires_at)
            open_grants = Grant.objects.using(alias).filter(lock_id=lock.pk, ended_at=None)
            # Leases that ran out without a release (the writer's taken over, readers'
            # gone): closed as expired at their own end, as the exclusive grant does.
            open_grants.filter(expires_at__lte=now).update(
                ended_at=F("expires_at"), end_reason=GrantEnd.EXPIRED
            )
            if not live_group:
                # Readers of an earlier group still open, their time left: the group
                # was revoked and its readers were not all closed then (revoke closes
                # them in a second transaction). Closed now, so none of them ever
                # joins this new group.
                open_grants.filter(mode=GrantMode.SHARED).update(
                    ended_at=now, end_reason=GrantEnd.REVOKED
                )
            lease_id = new_lease_id()
            token = next_token(snapshot, floor)
            expires_at = now + dt.timedelta(seconds=ttl)
            Grant.objects.using(alias).create(
                lock_id=lock.pk, token=token, holder=holder, lease_hash=hash_lease_id(lease_id),
                acquired_at=now, expires_at=expires_at, mode=GrantMode.SHARED,
            )
            readers, group_end = _live_readers(self, lock, now)  # this reader included
            Lock.objects.using(alias).filter(pk=lock.pk).update(
                token=token, holder=shared_holders(readers), lease_hash=SHARED_LEASE_HASH,
                acquired_at=lock.acquired_at if live_group else now,
                expires_at=group_end,
                lock_delay=lock_delay, delay_until=None,
            )
            if ticket is not None:
                Ticket.objects.using(alias).filter(pk=ticket).delete()
                if Ticket.objects.using(alias).filter(lock_key=key).exists():
                    # At commit: the next waiter is first now (another reader may
                    # join this group at once).
                    self.wake(key)
        lease = Lease(
            key=key, token=token, lease_id=lease_id, holder=holder, acquired_at=now,
            expires_at=expires_at, mode=GrantMode.SHARED.value,
        )
        return Acquired(lease, taken_over)


    def renew_shared(self, grant: Lease, ttl: float) -> dt.datetime:
        """Move the live reader ``grant``'s end to ``ttl`` seconds from now, and the
        group's with it. Raises ``LeaseLost`` if the reader's lease is not live:
        released, expired, or its group ended (revoked, or taken over by a writer
        after every reader's lease ran out)."""
        alias = self.alias
        with self.transaction():
            lock, now, own, refusal = _reader_state(self, grant)
            if refusal is not None:
                raise refusal
            assert own is not None  # no refusal: the reader's own row was found
            expires_at = now + dt.timedelta(seconds=ttl)
            Grant.objects.using(alias).filter(pk=own.pk).update(expires_at=expires_at)
            # The group's lease ends with its last reader's, this one's new end
            # included: a shorter renewal can end it earlier.
            readers, group_end = _live_readers(self, lock, now)
            Lock.objects.using(alias).filter(pk=lock.pk).update(
                holder=shared_holders(readers), expires_at=group_end
            )
        return expires_at


    def release_shared(self, grant: Lease) -> Ended:
        """End the reader ``grant``; the last reader's release frees the lock (and
        wakes its waiters). Never ends another reader's lease or a writer's.

        Raises ``LeaseLost`` if the lease is not live; its Grant row, if still
        open, is closed first (as expired at its own end, or as revoked when its
        group was revoked before it ran out), and a group with no live reader
        left is freed, so the caller learns that its work ran past its lease.
        """
        alias = self.alias
        with self.transaction():
            lock, now, own, refusal = _reader_state(self, grant)
            if own is None or own.ended_at is not None or not lease_matches(own.lease_hash, grant.lease_id):
                assert refusal is not None
                raise refusal
            expired_at: dt.datetime | None = None
            if refusal is None:
                reason, ended_at = GrantEnd.RELEASED, now
            elif own.expires_at <= now:
                expired_at = own.expires_at
                reason, ended_at = GrantEnd.EXPIRED, own.expires_at
            else:  # the group was revoked while this lease ran
                reason, ended_at = GrantEnd.REVOKED, now
            Grant.objects.using(alias).filter(pk=own.pk).update(ended_at=ended_at, end_reason=reason)
            if held_by_readers(lock):
                readers, group_end = _live_readers(self, lock, now)
                if readers:
                    Lock.objects.using(alias).filter(pk=lock.pk).update(
                        holder=shared_holders(readers), expires_at=group_end
                    )
                else:
                    # Lock-delay runs from the end of a group that expired, as from
                    # an exclusive lease's; a clean release frees the lock at once.
                    delay_until = (
                        lock.expires_at + dt.timedelta(seconds=lock.lock_delay)
                        if reason != GrantEnd.RELEASED and lock.lock_delay and lock.expires_at
                        else None
                    )
                    Lock.objects.using(alias).filter(pk=lock.pk).update(
                        holder="", lease_hash="", acquired_at=None, expires_at=None,
                        delay_until=delay_until,
                    )
                    if lock.wake_until is not None and lock.wake_until > now:
                        self.wake(grant.key)
        if reason == GrantEnd.REVOKED:
            assert refusal is not None
            raise refusal
        return Ended(reason, ended_at, expired_at)


    def close_revoked_readers(self, revoked: Grant) -> None:
        """Close, as revoked, the readers' rows still open in the group that ``revoked``
        (its newest reader's row) ended. Readers granted since have greater tokens
        and are not touched; a reader whose row stays open is refused anyway
        (:func:`_reader_refusal`) and closed by the next group's first grant."""
        with self.transaction():
            Grant.objects.using(self.alias).filter(
                lock_id=revoked.lock_id, mode=GrantMode.SHARED, ended_at=None,
                token__lt=revoked.token, expires_at__gt=revoked.ended_at,
            ).update(ended_at=revoked.ended_at, end_reason=GrantEnd.REVOKED)


def _reader_state(
    point: SharedLeases, grant: Lease
) -> tuple[Lock, dt.datetime, Grant | None, LeaseLost | None]:
    """Inside the grant point's transaction: the reader's key row (locked), the
    database time, the reader's own Grant row, and why the reader is not live
    (None if it is)."""
    lock = point._locked_row(grant.key)
    if lock is None:
        raise never_granted(grant.key)
    now = point.now()
    own = _own_grant(point, lock, grant)
    return lock, now, own, _reader_refusal(lock, own, grant, now)


def _own_grant(point: SharedLeases, lock: Lock, grant: Lease) -> Grant | None:
    return (
        Grant.objects.using(point.alias)
        .filter(lock_id=lock.pk, token=grant.token, mode=GrantMode.SHARED)
        .first()
    )


def _live_readers(point: SharedLeases, lock: Lock, now: dt.datetime) -> tuple[int, dt.datetime | None]:
    """How many readers of ``lock`` hold a live lease, and when the last one ends."""
    found = (
        Grant.objects.using(point.alias)
        .filter(lock_id=lock.pk, mode=GrantMode.SHARED, ended_at=None, expires_at__gt=now)
        .aggregate(count=Count("pk"), end=Max("expires_at"))
    )
    return int(found["count"]), found["end"]


def _reader_refusal(
    lock: Lock, own: Grant | None, grant: Lease, now: dt.datetime
) -> LeaseLost | None:
    """Why the reader ``grant`` is not live at database time ``now``, or None if it is."""
    key = lock.key
    if own is None or not lease_matches(own.lease_hash, grant.lease_id):
        return LeaseLost(f"no shared lease of {key!r} has token {grant.token} and this lease_id")
    if own.ended_at is not None:
        return LeaseLost(
            f"the shared lease of {key!r} token {grant.token} ended ({own.end_reason})"
        )
    if own.expires_at <= now:
        return LeaseLost(
            f"shared lease of {key!r} token {grant.token} expired at "
            f"{own.expires_at.isoformat()} (database time)"
        )
    if not held_by_readers(lock):
        return LeaseLost(
            f"the readers of {key!r} lost the lock (revoked): "
            f"{lock.holder or 'nobody'} holds it now"
        )
    return None
