"""The fair queue's tickets: one row per waiter, kept by the grant point.

A waiter with ``fair=True`` takes a :class:`~coordination.models.Ticket` and
keeps it alive while it waits; a key (or a semaphore's queue) is granted only
to the waiter whose live ticket is first. Expiry is decided by the database
clock (rule 11 of docs/rules.md): a crashed waiter's ticket holds nobody up
once it has expired. These are ORM statements every database runs alike; they
live here, beside the grant point, so that nothing above the backends handles
the rows.
"""

from __future__ import annotations

import abc
import datetime as dt
from contextlib import AbstractContextManager
from typing import Any

from ..conf import app_settings
from ..exceptions import LockHeld
from ..models import DatabaseNow, Ticket
from .outcomes import Acquired

__all__ = ["FairQueue"]


class FairQueue(abc.ABC):
    """The tickets of the fair queue: the base of :class:`~coordination.backends.base.GrantPoint`,
    which gives it the five calls below."""

    alias: str

    @abc.abstractmethod
    def now(self) -> dt.datetime: ...

    @abc.abstractmethod
    def wake(self, key: str) -> None: ...

    @abc.abstractmethod
    def transaction(self) -> AbstractContextManager[Any]: ...

    @abc.abstractmethod
    def guard_promotion(self) -> None: ...

    @abc.abstractmethod
    def grant_in_transaction(
        self, key: str, holder: str, ttl: float, lock_delay: float, ticket: int | None
    ) -> Acquired: ...

    def take_ticket(self, queue: str, holder: str) -> int:
        """A ticket at the back of ``queue``, live for ``TICKET_TTL`` seconds; expired
        tickets of the queue are cleared away first."""
        now = self.now()
        tickets = Ticket.objects.using(self.alias)
        tickets.filter(lock_key=queue, expires_at__lte=now).delete()
        expires_at = now + dt.timedelta(seconds=app_settings.TICKET_TTL)
        return tickets.create(lock_key=queue, holder=holder, expires_at=expires_at).pk

    def keep_ticket(self, ticket: int) -> bool:
        """Extend ``ticket`` by ``TICKET_TTL`` seconds; False if it is gone (expired
        and cleared by another waiter, or deleted)."""
        expires_at = self.now() + dt.timedelta(seconds=app_settings.TICKET_TTL)
        return bool(Ticket.objects.using(self.alias).filter(pk=ticket).update(expires_at=expires_at))

    def leave_queue(self, queue: str, ticket: int) -> None:
        """Give ``ticket`` up, and let the next waiter of ``queue`` know it may be first."""
        Ticket.objects.using(self.alias).filter(pk=ticket).delete()
        self.wake(queue)

    def waiting_ahead(self, queue: str, ticket: int | None) -> int:
        """How many live tickets of ``queue`` are ahead of ``ticket`` (all, without one)."""
        ahead = Ticket.objects.using(self.alias).filter(lock_key=queue, expires_at__gt=DatabaseNow())
        if ticket is not None:
            ahead = ahead.filter(id__lt=ticket)
        return ahead.count()

    def refuse_behind_waiters(self, queue: str, ticket: int | None, what: str) -> None:
        """Raise ``LockHeld`` naming how many ``what`` waiters are queued first, if
        any live ticket of ``queue`` is ahead of ``ticket``."""
        ahead = self.waiting_ahead(queue, ticket)
        if ahead:
            raise LockHeld(
                queue, f"{ahead} {what} waiter(s) queued first", self.now(),
                float(app_settings.POLL_INTERVAL),
            )

    def grant_in_turn(
        self, key: str, holder: str, ttl: float, delay: float, queue: str, ticket: int
    ) -> Acquired:
        """Grant ``key`` to the holder of ``ticket`` if no live ticket of ``queue`` is
        ahead of it, consuming the ticket in the same transaction of the grant
        point's own, so a waiter never holds both. ``LockHeld`` if a ticket is
        ahead (for ``queue``) or ``key`` is held."""
        with self.transaction():
            # The promotion guard first, before any row lock (as acquire_many).
            self.guard_promotion()
            self.refuse_behind_waiters(queue, ticket, "permit")
            acquired = self.grant_in_transaction(key, holder, ttl, delay, None)
            tickets = Ticket.objects.using(self.alias).filter(lock_key=queue)
            tickets.filter(pk=ticket).delete()
            if tickets.exists():
                self.wake(queue)  # at commit: the next waiter is first now
        return acquired
