"""Fenced leader election: one leader per role, and a deposed leader's writes refused.

A *role* (``"celery-beat"``, ``"report-builder"``) is led by whoever holds the
lock ``election:<role>``. Campaigning is acquiring it; leading is holding the
lease, kept alive by a :class:`~coordination.keepalive.KeepAlive`
thread; the **term** is the lease's fencing token. Terms increase strictly with
every new leader (rule 3 of docs/rules.md), and the Grant rows of the role's
lock are the history of terms.

::

    from coordination import election

    with election.lead("report-builder", candidate="host-a", ttl=10, wait=60) as leadership:
        while not leadership.lost:
            with leadership.fence():        # refused once a newer term has written
                Report.objects.create(...)

What a leader election alone cannot do (rule 1 of docs/rules.md): a leader
that pauses (GC, VM migration, ``SIGSTOP``) longer than its lease does not know
it was deposed, and when it wakes up it still believes it leads. Its side
effects must therefore go through fences keyed by the role:
:meth:`Leadership.fence` checks the term against the role's watermark in the
same transaction as the write, so once a newer leader has written, anything
the old one writes with its old term is refused (``StaleToken``).

Failure modes, and what this module does about them:

- the leader process dies: its lease expires after ``ttl`` (plus
  ``lock_delay``); a standby's ``campaign(..., wait=...)`` wins then;
- the leader pauses past its lease: a standby takes over; the old leader's
  keep-alive fails when it wakes up (``LeaseLost``), its ``on_lost`` callbacks
  run, and its fenced writes are refused meanwhile;
- the database is unreachable: the keep-alive retries while the lease is
  certainly live, then marks the leadership lost (the lease may have expired);
- an operator revokes the role's lock (admin, ``locks.revoke``): the keep-alive
  finds the lease gone at its next renewal and the leadership is lost.

``on_lost`` callbacks run in the keep-alive thread; keep them short (set a
flag, log). A leadership that the holder ends itself (:meth:`Leadership.resign`)
does not call them.
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any

from django.db.models import QuerySet

from . import fencing, locks, signals
from .conf import app_settings
from .exceptions import LeaseLost
from .keepalive import KeepAlive
from .leases import Lease
from .models import Fence, Grant, Lock, validate_key

__all__ = [
    "ROLE_PREFIX",
    "Leader",
    "Leadership",
    "campaign",
    "lead",
    "leader",
    "role_key",
    "role_of",
    "terms",
]

logger = logging.getLogger("coordination.election")

ROLE_PREFIX = "election:"
"""Lock keys of roles start with this; the rest is the role's name."""

OnLost = Callable[["Leadership", BaseException | None], None]


def role_key(role: str) -> str:
    """The lock key (and default fence resource) of ``role``: ``election:<role>``.

    Raises ``InvalidInput`` for a role name that does not make a valid key.
    """
    return validate_key(ROLE_PREFIX + str(role), what="role")


@dataclass(frozen=True, slots=True)
class Leader:
    """Who leads a role now, as the database sees it.

    ``term`` is the leader's fencing token; ``since`` when its term began and
    ``expires_at`` when its lease ends unless renewed (database time).
    """

    role: str
    holder: str
    term: int
    since: dt.datetime
    expires_at: dt.datetime


class Leadership:
    """A won campaign: the lease of the role's lock, kept alive until resigned or lost.

    - ``term``: the lease's fencing token, strictly greater than every earlier
      term of the role;
    - ``lost``: True once the keep-alive found the lease gone (expired, revoked,
      taken over) or could not renew it in time, and after :meth:`resign`.
      A leader should check it before each side effect, and must put the side
      effect behind :meth:`fence`, because a paused leader cannot check in time;
    - :meth:`wait_lost` blocks until the leadership is lost (a standby loop).
    """

    def __init__(
        self,
        role: str,
        grant: Lease,
        *,
        ttl: float,
        keepalive: bool = True,
        on_lost: OnLost | None = None,
        using: str | None = None,
    ) -> None:
        self.role = role
        self.lease = grant
        self.ttl = ttl
        self.using = using
        self._callbacks: list[OnLost] = [] if on_lost is None else [on_lost]
        self._lost = threading.Event()
        self._resigned = False
        self._callbacks_lock = threading.Lock()
        self._called = False
        signals.lock_lost.connect(self._on_lock_lost, sender=Grant, weak=False)
        self._keeper = KeepAlive(grant, ttl=ttl, using=using).start() if keepalive else None

    def __repr__(self) -> str:
        state = "resigned" if self._resigned else "lost" if self.lost else "leading"
        return f"<Leadership {self.role!r} term {self.term} {self.lease.holder!r} {state}>"

    @property
    def key(self) -> str:
        return self.lease.key

    @property
    def term(self) -> int:
        return self.lease.token

    @property
    def holder(self) -> str:
        return self.lease.holder

    @property
    def lost(self) -> bool:
        return self._lost.is_set() or self.lease.lost or self._resigned

    def wait_lost(self, timeout: float | None = None) -> bool:
        """Block until the leadership is lost or resigned (True), or ``timeout`` passes."""
        if self.lost:
            return True
        return self._lost.wait(timeout)

    def add_on_lost(self, callback: OnLost) -> None:
        """Call ``callback(leadership, error)`` once when the leadership is lost (at
        once if it is lost already; never after :meth:`resign`)."""
        with self._callbacks_lock:
            self._callbacks.append(callback)
            called = self._called
        if self._resigned:
            return
        if called:
            callback(self, None)
        elif self.lost:
            self._notify(None)

    def check(self) -> None:
        """Raise ``LeaseLost`` if this leadership is known to be lost.

        Passing says only that the holder has not *noticed* a loss: a paused
        leader passes it on waking up. Fence the side effect (:meth:`fence`).
        """
        if self.lost:
            raise LeaseLost(
                f"leadership of {self.role!r} term {self.term} is lost"
                + (" (resigned)" if self._resigned else "")
            )

    def fence(
        self, resource: str | None = None, *, step: int | None = None
    ) -> AbstractContextManager[Fence]:
        """A transaction in which the leader's writes count only while its term is current.

        Locks the Fence ``resource`` (default: the role's key; any resource
        given must be guarded by the role's key alone), checks this term
        against its watermark and raises it, then runs the block in the same
        transaction. Raises ``StaleToken`` once a newer term has written,
        ``LeaseLost`` once this leadership is known lost, before the block
        runs. Each call is a new step of the term (or ``step``), so one leader
        may write many times.

        On PostgreSQL the transaction may sit idle (between its statements) for
        at most the lease's ``ttl``: a leader paused inside the block would
        otherwise keep the role's Fence row locked, and every newer leader's
        fenced writes waiting, until it woke up. The server ends the paused
        leader's transaction instead (nothing in it is written) and its next
        statement raises ``LeaseLost``.
        """
        return fencing.fence(
            resource or self.key, self.lease, step=step, using=self.using, idle_timeout=self.ttl
        )

    def resign(self) -> None:
        """Stop leading: stop the keep-alive and release the lease, so a standby wins
        at once (no lock-delay: a release is not an expiry). Never raises; a lease
        already lost is logged. ``on_lost`` callbacks are not called."""
        if self._resigned:
            return
        self._resigned = True
        signals.lock_lost.disconnect(self._on_lock_lost, sender=Grant)
        if self._keeper is not None:
            self._keeper.stop()
        try:
            locks.release(self.lease, using=self.using)
        except LeaseLost as error:
            logger.warning("leadership of %r term %d ended before resigning: %s",
                           self.role, self.term, error.detail)
        except Exception:
            logger.exception("could not release leadership of %r term %d; it expires at %s",
                             self.role, self.term, self.lease.expires_at.isoformat())
        else:
            logger.info("resigned leadership of %r term %d", self.role, self.term)
        # A resigned leader's fenced writes are refused (and recorded) like a lost one's.
        self.lease.mark_lost()
        self._lost.set()

    def __enter__(self) -> Leadership:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.resign()

    # --- loss -----------------------------------------------------------------

    def _on_lock_lost(self, sender: Any = None, grant: Any = None, error: Any = None,
                      **kwargs: Any) -> None:
        if grant is self.lease:
            self._notify(error)

    def _notify(self, error: BaseException | None) -> None:
        self._lost.set()
        with self._callbacks_lock:
            if self._called:
                return
            self._called = True
        signals.lock_lost.disconnect(self._on_lock_lost, sender=Grant)
        logger.warning("leadership of %r term %d lost: %s", self.role, self.term, error)
        with self._callbacks_lock:
            callbacks = list(self._callbacks)
        for callback in callbacks:
            try:
                callback(self, error)
            except Exception:
                logger.exception("on_lost callback of %r failed", self.role)


def campaign(
    role: str,
    *,
    candidate: str,
    ttl: float | None = None,
    wait: float = 0.0,
    lock_delay: float | None = None,
    keepalive: bool = True,
    on_lost: OnLost | None = None,
    using: str | None = None,
) -> Leadership:
    """Become the leader of ``role``, or raise ``LockHeld`` naming the current leader.

    ``wait`` = 0 tries once; ``wait`` > 0 blocks up to that many seconds,
    woken when the leader resigns or its lease ends. The won lease lasts ``ttl``
    seconds (default ``COORDINATION["DEFAULT_TTL"]``) and is renewed every
    ``ttl / 3`` by a keep-alive thread (unless ``keepalive=False``: then the
    caller renews ``leadership.lease`` itself). ``lock_delay`` keeps the role
    unwinnable for that many seconds after this leadership expires or is
    revoked, so a leader that merely paused has time to notice before another
    acts. ``on_lost(leadership, error)`` is called once, from the keep-alive
    thread, if the leadership is lost.
    """
    key = role_key(role)
    seconds = float(app_settings.DEFAULT_TTL if ttl is None else ttl)
    lease = locks.acquire(
        key, holder=candidate, ttl=seconds, wait=wait, lock_delay=lock_delay, using=using
    )
    logger.info("elected leader of %r term %d: %s", role, lease.token, candidate)
    return Leadership(role, lease, ttl=seconds, keepalive=keepalive, on_lost=on_lost, using=using)


@contextmanager
def lead(
    role: str,
    *,
    candidate: str,
    ttl: float | None = None,
    wait: float = 0.0,
    lock_delay: float | None = None,
    on_lost: OnLost | None = None,
    using: str | None = None,
) -> Iterator[Leadership]:
    """``campaign()``, then resign when the block exits, whatever happens in it.

    The lease is the current grant for fenced writes in the block
    (``locks.use_grant``), so ``fenced_update()`` and ``fence()`` use the term.
    """
    leadership = campaign(
        role, candidate=candidate, ttl=ttl, wait=wait, lock_delay=lock_delay,
        on_lost=on_lost, using=using,
    )
    try:
        with locks.use_grant(leadership.lease):
            yield leadership
    finally:
        leadership.resign()


def leader(role: str, *, using: str | None = None) -> Leader | None:
    """The current leader of ``role``, or None if nobody holds a live lease
    (by the database's clock). A leader that paused past its lease is not it."""
    key = role_key(role)
    alias = using or app_settings.DATABASE
    row = Lock.objects.using(alias).held().filter(key=key).first()
    if row is None or row.acquired_at is None or row.expires_at is None:
        return None
    return Leader(role=role, holder=row.holder, term=row.token, since=row.acquired_at,
                  expires_at=row.expires_at)


def terms(role: str, *, using: str | None = None) -> QuerySet[Grant]:
    """The history of ``role``'s terms, newest first: its lock's Grant rows
    (``token`` is the term, ``holder`` the leader, ``acquired_at`` to
    ``ended_at`` or ``expires_at`` its time in office, ``end_reason`` how it ended)."""
    alias = using or app_settings.DATABASE
    return Grant.objects.using(alias).filter(lock__key=role_key(role)).order_by("-token")


def role_of(key: str) -> str | None:
    """The role whose lock is ``key``, or None for a key that is not a role's."""
    return key[len(ROLE_PREFIX):] if key.startswith(ROLE_PREFIX) else None

