"""The grant point's rows: locks and their counters, the token floor, the fair
queue's tickets, and the audit history of grants."""

from __future__ import annotations

import datetime as dt
from typing import TYPE_CHECKING, Any

from django.db import models
from django.db.models import Q
from django.db.models.functions import Now
from django.utils.translation import gettext_lazy as _

from ..keys import (
    HOLDER_MAX_LENGTH,
    KEY_MAX_LENGTH,
    _key_field_validator,
)

if TYPE_CHECKING:
    from ..leases import Lease


class DatabaseNow(Now):
    """The database server's clock when the statement runs.

    PostgreSQL's ``now()`` is frozen at transaction start; ``clock_timestamp()``
    is not, which matters after waiting for a row lock. Lease expiry is always
    decided with this clock, never with the app server's (rule 11 of docs/rules.md).
    """

    def as_postgresql(
        self, compiler: Any, connection: Any, **extra: Any
    ) -> tuple[str, tuple[Any, ...]]:
        return "clock_timestamp()", ()

    def as_mysql(self, compiler: Any, connection: Any, **extra: Any) -> tuple[str, tuple[Any, ...]]:
        # UTC whatever the session's time zone, to the microsecond.
        return "UTC_TIMESTAMP(6)", ()


class LockState(models.TextChoices):
    FREE = "free", _("free")
    HELD = "held", _("held")
    EXPIRED = "expired", _("expired, not released")


class LockQuerySet(models.QuerySet["Lock"]):
    """Locks filtered by state, decided with the database clock."""

    def held(self) -> LockQuerySet:
        return self.filter(holder__gt="", expires_at__gt=DatabaseNow())

    def expired(self) -> LockQuerySet:
        """Leases that ended by time but were never released or taken over."""
        return self.filter(holder__gt="", expires_at__lte=DatabaseNow())

    def free(self) -> LockQuerySet:
        return self.filter(holder="")

    def with_state(self) -> LockQuerySet:
        return self.annotate(
            state=models.Case(
                models.When(holder="", then=models.Value(LockState.FREE)),
                models.When(expires_at__gt=DatabaseNow(), then=models.Value(LockState.HELD)),
                default=models.Value(LockState.EXPIRED),
                output_field=models.CharField(),
            )
        )


class Lock(models.Model):
    """One lock key: its token counter and its current lease.

    ``token`` is the last token issued for the key. It only grows, one per grant,
    in the same transaction that records the grant.
    """

    key = models.CharField(max_length=KEY_MAX_LENGTH, unique=True, validators=[_key_field_validator])
    token = models.BigIntegerField(
        default=0, db_default=0, help_text=_("Last fencing token issued for this key.")
    )
    holder = models.CharField(max_length=HOLDER_MAX_LENGTH, blank=True, default="", db_default="")
    lease_hash = models.CharField(
        max_length=64, blank=True, default="", db_default="", editable=False
    )
    acquired_at = models.DateTimeField(null=True, blank=True)
    expires_at = models.DateTimeField(null=True, blank=True)
    # Lock-delay (Chubby, Consul): after the current lease expires or is
    # revoked, the lock stays ungrantable for this many seconds; set by the
    # acquire that took the lease. ``delay_until`` holds the end of a running
    # delay once the lease is gone (revoked, or released after it expired).
    lock_delay = models.FloatField(default=0.0, db_default=0.0)
    delay_until = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(db_default=Now(), editable=False)
    # PostgreSQL: until when a waiter may be LISTENing for this key's release.
    # A release notifies only while it is in the future, so releases nobody
    # waits for skip NOTIFY (whose commit lock serialises the whole server).
    wake_until = models.DateTimeField(null=True, blank=True, editable=False)

    objects = LockQuerySet.as_manager()

    class Meta:
        ordering = ["key"]
        permissions = [
            ("acquire_lock", "Can acquire, renew and release locks"),
            ("revoke_lock", "Can revoke a lock from its holder"),
        ]
        constraints = [
            models.CheckConstraint(condition=Q(token__gte=0), name="coordination_lock_token_gte_0"),
            models.CheckConstraint(
                condition=Q(holder="") | Q(expires_at__isnull=False, lease_hash__gt=""),
                name="coordination_lock_held_has_lease",
            ),
        ]

    def __str__(self) -> str:
        return self.key

    def state_at(self, now: dt.datetime) -> LockState:
        if not self.holder:
            return LockState.FREE
        assert self.expires_at is not None
        return LockState.HELD if self.expires_at > now else LockState.EXPIRED


class TokenFloorQuerySet(models.QuerySet["TokenFloor"]):
    """The token floor's one row (raised by :func:`coordination.restore.raise_floor_to`)."""

    def value(self) -> int:
        """The floor: 0 if its row is missing (a test database flushed, a schema made
        without migrations), as a missing Lock row is a counter at 0."""
        found = self.filter(pk=TokenFloor.ROW).values_list("token", flat=True).first()
        return found or 0


class TokenFloor(models.Model):
    """The token floor: no key is issued a token at or below it (rule 8 of docs/rules.md).

    One row. Every grant point issues a key's next token as ``max(counter, floor)
    + 1``, so a key the database has never seen starts at ``floor + 1``. After a
    restore from backup the database has no row for a key first granted after
    the backup; its counter would start again at 1 and reissue tokens its fences
    may have accepted. Raising the floor (``coordination_restore_guard --bump N``,
    :func:`coordination.restore.raise_floor`) covers those keys too. It never
    goes down: a database trigger refuses an UPDATE that lowers it
    (:mod:`coordination.watermarks`). A missing row counts as 0.
    """

    ROW = 1

    id = models.PositiveSmallIntegerField(primary_key=True, default=ROW, editable=False)
    token = models.BigIntegerField(
        default=0, db_default=0,
        help_text=_("No key is issued a token at or below this one."),
    )
    raised_at = models.DateTimeField(null=True, blank=True, editable=False)
    # The PostgreSQL timeline the grant point last granted on: a grant that finds
    # another one runs the promotion guard first (migration 0012). Null: none yet.
    timeline = models.IntegerField(null=True, blank=True, editable=False)

    objects = TokenFloorQuerySet.as_manager()

    class Meta:
        verbose_name = _("token floor")
        constraints = [
            models.CheckConstraint(condition=Q(id=1), name="coordination_tokenfloor_one_row"),
            models.CheckConstraint(
                condition=Q(token__gte=0), name="coordination_tokenfloor_token_gte_0"
            ),
        ]

    def __str__(self) -> str:
        return f"token floor {self.token}"


class Ticket(models.Model):
    """A waiter's place in the fair queue of a lock key (``acquire(..., fair=True)``).

    Waiters are granted in ticket order. A waiter keeps its ticket alive while it
    waits; the ticket of one that crashed expires and stops holding the queue.
    """

    lock_key = models.CharField(max_length=KEY_MAX_LENGTH)
    holder = models.CharField(max_length=HOLDER_MAX_LENGTH)
    created_at = models.DateTimeField(db_default=Now())
    expires_at = models.DateTimeField()

    class Meta:
        ordering = ["id"]
        indexes = [models.Index(fields=["lock_key", "id"], name="coordination_ticket_queue")]

    def __str__(self) -> str:
        return f"{self.lock_key} #{self.pk} ({self.holder})"


class GrantEnd(models.TextChoices):
    RELEASED = "released", _("released")
    EXPIRED = "expired", _("expired")
    REVOKED = "revoked", _("revoked")


class GrantMode(models.TextChoices):
    """How a grant holds its lock: alone (a writer, every plain acquire), or
    together with other shared holders (readers: :mod:`coordination.shared`)."""

    EXCLUSIVE = "exclusive", _("exclusive")
    SHARED = "shared", _("shared")


class GrantQuerySet(models.QuerySet["Grant"]):
    def live(self) -> GrantQuerySet:
        """Grants not ended and not yet past their lease, by the database clock."""
        return self.filter(ended_at__isnull=True, expires_at__gt=DatabaseNow())

    def ended(self) -> GrantQuerySet:
        return self.filter(ended_at__isnull=False)

    def of(self, grant: Lease) -> GrantQuerySet:
        """The row recording ``grant`` (its key and token)."""
        return self.filter(lock__key=grant.key, token=grant.token)


class Grant(models.Model):
    """One successful acquire: the audit history of a lock.

    The holder keeps a :class:`~coordination.leases.Lease` (what
    :func:`coordination.locks.acquire` returns, with the secret ``lease_id``);
    this row records the same grant, with only the secret's hash.
    """

    # No index of its own: the unique (lock, token) constraint's index starts
    # with lock_id and serves every lookup by lock, one index less per grant.
    lock = models.ForeignKey(
        Lock, on_delete=models.PROTECT, related_name="grants", db_index=False
    )
    token = models.BigIntegerField()
    holder = models.CharField(max_length=HOLDER_MAX_LENGTH)
    lease_hash = models.CharField(max_length=64, editable=False)
    acquired_at = models.DateTimeField()
    expires_at = models.DateTimeField()
    ended_at = models.DateTimeField(null=True, blank=True)
    end_reason = models.CharField(
        max_length=16, choices=GrantEnd.choices, blank=True, default="", db_default=""
    )
    # db_default: the grant point's SQL functions insert exclusive grants
    # without naming the column.
    mode = models.CharField(
        max_length=9, choices=GrantMode.choices, default=GrantMode.EXCLUSIVE,
        db_default=GrantMode.EXCLUSIVE, editable=False,
    )

    objects = GrantQuerySet.as_manager()

    class Meta:
        ordering = ["-acquired_at", "-token"]
        constraints = [
            models.UniqueConstraint(fields=["lock", "token"], name="coordination_grant_unique_token"),
            models.CheckConstraint(condition=Q(token__gt=0), name="coordination_grant_token_gt_0"),
            models.CheckConstraint(
                condition=Q(ended_at__isnull=True, end_reason="")
                | Q(ended_at__isnull=False, end_reason__gt=""),
                name="coordination_grant_end_has_reason",
            ),
        ]
        indexes = [models.Index(fields=["acquired_at"], name="coordination_grant_acquired")]

    def __str__(self) -> str:
        return f"{self.key}#{self.token} ({self.holder})"

    @property
    def key(self) -> str:
        return self.lock.key
