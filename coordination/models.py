"""What the grant point and the fences store.

The database enforces what the code assumes: counters and watermarks are
BIGINT NOT NULL DEFAULT 0 with ``>= 0`` checks, a grant's token is unique per
lock, keys are validated. Fence rows are never deleted by the app: their
watermarks are what keeps old tokens from becoming valid again. A Lock row is
deleted only by pruning (:mod:`coordination.pruning`), once unused for long,
in the transaction that raises the token floor above its counter.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import hmac
import re
from typing import TYPE_CHECKING, Any

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import models, transaction
from django.db.models import Q
from django.db.models.functions import Coalesce, Concat, Now
from django.utils.translation import gettext_lazy as _

from .conf import app_settings
from .exceptions import InvalidInput

if TYPE_CHECKING:
    from .leases import Lease

KEY_MAX_LENGTH = 200
HOLDER_MAX_LENGTH = 200
MAX_TOKEN = 2**63 - 1
KEY_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@-]*")
KEY_RULE = (
    f"1 to {KEY_MAX_LENGTH} characters: letters, digits and . _ : @ -, "
    "starting with a letter or digit"
)


def validate_key(key: object, *, what: str = "key") -> str:
    """Return ``key`` if it is a valid lock key or resource name, else raise InvalidInput."""
    if not isinstance(key, str) or not key:
        raise InvalidInput(f"{what} must be a non-empty string ({KEY_RULE})")
    if len(key) > KEY_MAX_LENGTH:
        raise InvalidInput(f"{what} is {len(key)} characters long; at most {KEY_MAX_LENGTH}")
    if not KEY_PATTERN.fullmatch(key):
        raise InvalidInput(f"{what} {key!r} has forbidden characters ({KEY_RULE})")
    return key


PATTERN_WILDCARD = "*"
PATTERN_RULE = (
    "a lock key (that key only), a key's beginning followed by * (billing:* is every key "
    "starting with billing:), or * alone (every key); * only at the end"
)


def validate_key_pattern(pattern: object) -> str:
    """Return ``pattern`` if it is a valid access-rule key pattern, else raise InvalidInput.

    The syntax (docs/access-rules.md): an exact key, a prefix followed by ``*``,
    or ``*`` alone. The prefix follows the key rule; ``*`` appears only last.
    """
    if not isinstance(pattern, str) or not pattern:
        raise InvalidInput(f"a key pattern must be {PATTERN_RULE}")
    if pattern == PATTERN_WILDCARD:
        return pattern
    prefix = pattern.removesuffix(PATTERN_WILDCARD)
    if PATTERN_WILDCARD in prefix:
        raise InvalidInput(f"key pattern {pattern!r}: * may only end a pattern ({PATTERN_RULE})")
    if len(pattern) > KEY_MAX_LENGTH:
        raise InvalidInput(
            f"key pattern is {len(pattern)} characters long; at most {KEY_MAX_LENGTH}"
        )
    if not KEY_PATTERN.fullmatch(prefix):
        raise InvalidInput(
            f"key pattern {pattern!r} has forbidden characters: before the * it follows the "
            f"key rule ({KEY_RULE})"
        )
    return pattern


def key_matches(pattern: str, key: str) -> bool:
    """Whether ``key`` is one of the keys ``pattern`` names; case-sensitive, as keys are."""
    if pattern.endswith(PATTERN_WILDCARD):
        return key.startswith(pattern[:-1])
    return key == pattern


def validate_holder(holder: object) -> str:
    """Return ``holder`` if it is 1..200 printable characters, else raise InvalidInput."""
    if not isinstance(holder, str) or not holder.strip():
        raise InvalidInput("holder must be a non-empty string naming who takes the lock")
    if len(holder) > HOLDER_MAX_LENGTH:
        raise InvalidInput(f"holder is {len(holder)} characters long; at most 200")
    if not holder.isprintable():
        raise InvalidInput("holder must not contain control characters")
    return holder


def _key_field_validator(value: str) -> None:
    try:
        validate_key(value)
    except InvalidInput as error:
        raise ValidationError(str(error), code="invalid") from None


def _pattern_field_validator(value: str) -> None:
    try:
        validate_key_pattern(value)
    except InvalidInput as error:
        raise ValidationError(str(error), code="invalid") from None


def hash_lease_id(lease_id: str) -> str:
    """The stored form of a lease secret: only its SHA-256 is kept."""
    return hashlib.sha256(lease_id.encode()).hexdigest()


def lease_matches(lease_hash: str, lease_id: object) -> bool:
    """Whether ``lease_id`` is the secret behind ``lease_hash``, in constant time."""
    if not isinstance(lease_id, str) or not lease_hash:
        return False
    return hmac.compare_digest(lease_hash, hash_lease_id(lease_id))


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

    def of(self, lease: Lease) -> GrantQuerySet:
        """The row recording ``lease`` (its key and token)."""
        return self.filter(lock__key=lease.key, token=lease.token)


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


class Fence(models.Model):
    """A named resource guarded by one lock key, with its watermark.

    The watermark is the highest (token, step) the resource has accepted. A write
    is accepted only if its pair is above it; see :func:`coordination.fencing.fence`.
    """

    resource = models.CharField(
        max_length=KEY_MAX_LENGTH, unique=True, validators=[_key_field_validator]
    )
    lock_key = models.CharField(max_length=KEY_MAX_LENGTH, validators=[_key_field_validator])
    token = models.BigIntegerField(default=0, db_default=0)
    step = models.BigIntegerField(default=0, db_default=0)
    updated_at = models.DateTimeField(db_default=Now())

    class Meta:
        ordering = ["resource"]
        permissions = [("raise_fence", "Can raise a fence's watermark to its lock's last token")]
        constraints = [
            models.CheckConstraint(condition=Q(token__gte=0), name="coordination_fence_token_gte_0"),
            models.CheckConstraint(condition=Q(step__gte=0), name="coordination_fence_step_gte_0"),
        ]
        indexes = [models.Index(fields=["lock_key"], name="coordination_fence_lock_key")]

    def __str__(self) -> str:
        return self.resource


class RejectionReason(models.TextChoices):
    STALE = "stale_token", _("stale token")
    DUPLICATE = "duplicate_write", _("duplicate write")
    WRONG_LOCK = "wrong_lock", _("wrong lock")
    LEASE_LOST = "lease_lost", _("lease lost")


class Rejection(models.Model):
    """A refused write, recorded outside the refused transaction."""

    resource = models.CharField(max_length=KEY_MAX_LENGTH + 100)
    lock_key = models.CharField(max_length=KEY_MAX_LENGTH)
    token = models.BigIntegerField()
    step = models.BigIntegerField(default=0)
    watermark_token = models.BigIntegerField(null=True, blank=True)
    watermark_step = models.BigIntegerField(null=True, blank=True)
    reason = models.CharField(max_length=32, choices=RejectionReason.choices)
    holder = models.CharField(max_length=HOLDER_MAX_LENGTH, blank=True, default="")
    created_at = models.DateTimeField(db_default=Now())

    class Meta:
        ordering = ["-created_at", "-id"]
        indexes = [
            models.Index(fields=["created_at"], name="coordination_rejection_at"),
            models.Index(fields=["resource", "created_at"], name="coordination_rejection_res"),
        ]

    def __str__(self) -> str:
        return f"{self.reason}: {self.lock_key}#{self.token} on {self.resource}"


class AcceptedWrite(models.Model):
    """An accepted fenced write, kept when ``COORDINATION["RECORD_WRITES"]`` is on.

    Written in the writer's transaction by a ``write_accepted`` receiver, so it
    exists exactly when the write committed. The admin timeline marks these.
    """

    resource = models.CharField(max_length=KEY_MAX_LENGTH + 100)
    lock_key = models.CharField(max_length=KEY_MAX_LENGTH)
    token = models.BigIntegerField()
    step = models.BigIntegerField(default=0)
    holder = models.CharField(max_length=HOLDER_MAX_LENGTH, blank=True, default="")
    created_at = models.DateTimeField(db_default=Now())

    class Meta:
        ordering = ["-created_at", "-id"]
        indexes = [
            models.Index(fields=["created_at"], name="coordination_accepted_at"),
            models.Index(fields=["lock_key", "created_at"], name="coordination_accepted_key"),
        ]

    def __str__(self) -> str:
        return f"{self.lock_key}#{self.token} step {self.step} on {self.resource}"


class IdempotencyRecord(models.Model):
    """The stored result of an operation, returned again for a retry with the same key."""

    key = models.CharField(max_length=255, unique=True)
    result = models.JSONField(null=True, blank=True)
    completed = models.BooleanField(default=False, db_default=False)
    created_at = models.DateTimeField(db_default=Now())

    class Meta:
        ordering = ["-created_at"]
        indexes = [models.Index(fields=["created_at"], name="coordination_idem_at")]

    def __str__(self) -> str:
        return self.key




class Tombstone(models.Model):
    """The watermark of a deleted FencedModel row, kept so that the row cannot come
    back below it (rule 8 of docs/rules.md).

    A database trigger on every FencedModel table writes it when a row whose
    watermark is above (0, 0) is deleted, by any path (``delete()``, the admin,
    raw SQL), raising a tombstone already there, never lowering it. Another
    trigger starts a row inserted with the same table and primary key at
    (that token, the highest step), so every token up to the deleted row's
    is refused. The triggers are :mod:`coordination.watermarks`'; ``row_pk`` is
    the primary key as the database renders it as text. Tombstones are kept: any
    one may be all that stops a paused holder of an old token.
    """

    table_name = models.CharField(max_length=255)
    row_pk = models.CharField(max_length=255)
    fence = models.BigIntegerField()
    fence_step = models.BigIntegerField()
    deleted_at = models.DateTimeField(db_default=Now())

    class Meta:
        ordering = ["-deleted_at", "-id"]
        constraints = [
            models.UniqueConstraint(
                fields=["table_name", "row_pk"], name="coordination_tombstone_row"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.table_name} pk {self.row_pk} deleted at ({self.fence}, {self.fence_step})"


class UnfencedSave(models.Model):
    """A save of a stale FencedModel instance let through by ``coordination.unfenced()``.

    Written in the same transaction as the save, so it exists exactly when the
    save committed. ``lock_key`` is the key guarding the row (its
    ``fence_lock``), by which the admin keeps to access rules; ``token``/``step``
    is the watermark the instance carried, ``watermark_token``/``watermark_step``
    the row's, which the save kept.
    """

    resource = models.CharField(max_length=KEY_MAX_LENGTH + 100)
    lock_key = models.CharField(max_length=KEY_MAX_LENGTH)
    token = models.BigIntegerField()
    step = models.BigIntegerField()
    watermark_token = models.BigIntegerField()
    watermark_step = models.BigIntegerField()
    reason = models.TextField()
    by = models.CharField(max_length=HOLDER_MAX_LENGTH)
    created_at = models.DateTimeField(db_default=Now())

    class Meta:
        ordering = ["-created_at", "-id"]
        indexes = [models.Index(fields=["created_at"], name="coordination_unfenced_at")]

    def __str__(self) -> str:
        return f"unfenced save of {self.resource} by {self.by}: {self.reason}"


class Document(models.Model):
    """A JSON document in the fenced document store (the REST fencing proxy).

    Its watermark is the :class:`Fence` named ``document:<name>``, advanced in the
    same transaction as the write, for downstreams that cannot check tokens.
    """

    name = models.CharField(max_length=KEY_MAX_LENGTH, unique=True, validators=[_key_field_validator])
    fence = models.OneToOneField(Fence, on_delete=models.PROTECT, related_name="document")
    data = models.JSONField(null=True, blank=True)
    updated_at = models.DateTimeField(db_default=Now())

    class Meta:
        ordering = ["name"]
        permissions = [
            ("write_document", "Can write documents through the fenced store"),
            ("rebind_document", "Can re-bind a document to another lock key"),
        ]

    def __str__(self) -> str:
        return self.name


class AccessAction(models.TextChoices):
    """What an access rule allows on the keys it names (docs/access-rules.md)."""

    ACQUIRE = "acquire", _("acquire, renew and release")
    WRITE = "write", _("write documents")
    READ = "read", _("read")
    REVOKE = "revoke", _("revoke leases, raise fences")


class AccessRule(models.Model):
    """Which lock keys a user, or a group's members, may use, and for what.

    Rules only ever narrow: the Django permission of an action is still needed,
    and superusers are not bound by rules. Whether rules are enforced at all is
    ``COORDINATION["ACCESS_RULES"]``; :mod:`coordination.access` evaluates them.
    """

    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, null=True, blank=True,
        related_name="+", help_text=_("Who the rule is for: a user, or a group (not both)."),
    )
    group = models.ForeignKey(
        "auth.Group", on_delete=models.CASCADE, null=True, blank=True, related_name="+",
        help_text=_("Every member of this group."),
    )
    pattern = models.CharField(
        _("keys"), max_length=KEY_MAX_LENGTH, validators=[_pattern_field_validator],
        help_text=_(
            "billing:7 (that key only), billing:* (every key starting with billing:) "
            "or * (every key)."
        ),
    )
    acquire = models.BooleanField(
        default=False, db_default=False, help_text=_("Acquire, renew and release the keys.")
    )
    write = models.BooleanField(
        default=False, db_default=False,
        help_text=_("Write documents with grants of the keys (and so bind new documents to them)."),
    )
    read = models.BooleanField(
        default=False, db_default=False,
        help_text=_("See the keys' locks, grants, fences, documents and refused writes."),
    )
    revoke = models.BooleanField(
        default=False, db_default=False,
        help_text=_("Revoke the keys' leases and raise their fences in the admin."),
    )
    created_at = models.DateTimeField(db_default=Now(), editable=False)

    class Meta:
        ordering = ["pattern", "id"]
        verbose_name = _("access rule")
        constraints = [
            models.CheckConstraint(
                condition=Q(user__isnull=False, group__isnull=True)
                | Q(user__isnull=True, group__isnull=False),
                name="coordination_accessrule_user_or_group",
                violation_error_message=_("An access rule is for a user or a group: one, not both."),
            ),
            models.CheckConstraint(
                condition=Q(acquire=True) | Q(write=True) | Q(read=True) | Q(revoke=True),
                name="coordination_accessrule_some_action",
                violation_error_message=_("An access rule allows at least one action."),
            ),
        ]

    def __str__(self) -> str:
        who = f"user {self.user}" if self.user_id else f"group {self.group}"
        return f"{who}: {', '.join(self.actions) or 'nothing'} on {self.pattern}"

    @property
    def actions(self) -> list[str]:
        return [action for action in AccessAction.values if getattr(self, action)]

    def clean(self) -> None:
        errors: dict[str, str] = {}
        if bool(self.user_id) == bool(self.group_id):
            errors["user"] = str(_("Choose a user or a group: one, not both."))
        if not self.actions:
            errors["acquire"] = str(_("Choose at least one action."))
        if errors:
            raise ValidationError(errors)
class Role(Lock):
    """A role of :mod:`coordination.election`: the lock ``election:<role>`` seen as an
    office. Its holder is the leader, its token the current term, its Grant rows the
    history of terms. A proxy: no table of its own."""

    class Meta:
        proxy = True
        verbose_name = _("election role")

    def __str__(self) -> str:
        return self.key.removeprefix("election:")


class BeatSlotQuerySet(models.QuerySet["BeatSlot"]):
    """Beat slots by state: claimed by a leader, sent to the broker, or lost."""

    def sent(self) -> BeatSlotQuerySet:
        return self.filter(sent_at__isnull=False)

    def unsent(self) -> BeatSlotQuerySet:
        """Claimed and not marked sent: in flight, or lost."""
        return self.filter(sent_at__isnull=True)

    def lost(self) -> BeatSlotQuerySet:
        """Claimed, not marked sent, and the claiming term is over (its lease is not
        the role's live lease any more): the leader died between claim and send, or
        could not reach the database to mark it sent. Never sent again."""
        live_term = Lock.objects.held().filter(
            key=Concat(models.Value("election:"), models.OuterRef("role"))
        ).values("token")[:1]
        # Coalesce: with no live lease the subquery is NULL, and "term = NULL" is
        # unknown, which exclude() would treat as a match.
        return self.unsent().exclude(
            term=Coalesce(models.Subquery(live_term), models.Value(0))
        )


class BeatSlot(models.Model):
    """One occurrence of a periodic task: a schedule entry at one due time.

    Claimed once, ever (the unique constraint), by the leader of the beat role,
    fenced by its term, before the task is sent; ``sent_at`` is set after the
    broker accepted the message. A slot claimed and never marked sent was lost
    by a leader that died between the two (see docs/beat.md).
    """

    role = models.CharField(max_length=KEY_MAX_LENGTH)
    entry = models.CharField(max_length=KEY_MAX_LENGTH, help_text=_("Schedule entry name."))
    task = models.CharField(max_length=KEY_MAX_LENGTH)
    due_at = models.DateTimeField(help_text=_("When the schedule says this occurrence is due."))
    term = models.BigIntegerField(help_text=_("The claiming leader's term (fencing token)."))
    claimed_by = models.CharField(max_length=HOLDER_MAX_LENGTH)
    claimed_at = models.DateTimeField(db_default=Now())
    sent_at = models.DateTimeField(null=True, blank=True)
    task_id = models.CharField(max_length=255, blank=True, default="", db_default="")

    objects = BeatSlotQuerySet.as_manager()

    class Meta:
        ordering = ["-due_at", "entry"]
        verbose_name = _("beat slot")
        constraints = [
            models.UniqueConstraint(
                fields=["role", "entry", "due_at"], name="coordination_beatslot_once"
            ),
            models.CheckConstraint(condition=Q(term__gt=0), name="coordination_beatslot_term_gt_0"),
        ]
        indexes = [
            models.Index(fields=["claimed_at"], name="coordination_beatslot_claimed"),
        ]

    def __str__(self) -> str:
        return f"{self.entry} @ {self.due_at:%Y-%m-%d %H:%M:%S.%f}"[:-3]

    @property
    def identity(self) -> str:
        """The slot as the task message's ``coordination_slot`` header names it."""
        return slot_identity(self.role, self.entry, self.due_at)


def slot_identity(role: str, entry: str, due_at: dt.datetime) -> str:
    """``<role>/<entry>@<due time, UTC, milliseconds>``: one string per slot."""
    due = due_at.astimezone(dt.UTC)
    return f"{role}/{entry}@{due:%Y-%m-%dT%H:%M:%S}.{due.microsecond // 1000:03d}Z"


TASK_PATTERN_WILDCARD = "*"
TASK_RULE = (
    "a task name (letters, digits and . _ : @ -, starting with a letter or digit), "
    "or a name's beginning followed by * (billing.* is every task whose name starts "
    "with billing.)"
)


def validate_task_pattern(task: object) -> str:
    """Return ``task`` if it names a task or a prefix of task names, else InvalidInput.

    Task names follow the key rule, so that ``task:<name>`` is a lock key: the
    key a policy answers to under the access rules (docs/jobs.md).
    """
    if not isinstance(task, str) or not task:
        raise InvalidInput(f"a job policy's task must be {TASK_RULE}")
    name = task.removesuffix(TASK_PATTERN_WILDCARD)
    if TASK_PATTERN_WILDCARD in name or not name or not KEY_PATTERN.fullmatch(name):
        raise InvalidInput(f"task {task!r} is not {TASK_RULE}")
    if len(task) > KEY_MAX_LENGTH - len("task:"):
        raise InvalidInput(f"task is {len(task)} characters long; at most {KEY_MAX_LENGTH - 5}")
    return task


def _task_field_validator(value: str) -> None:
    try:
        validate_task_pattern(value)
    except InvalidInput as error:
        raise ValidationError(str(error), code="invalid") from None


class WhenPaused(models.TextChoices):
    """What an execution that starts while its policy is paused does instead of its body."""

    DEFER = "defer", _("defer: run it after the resume")
    SKIP = "skip", _("skip: a Skipped result, not run")


class JobPolicy(models.Model):
    """How the executions of one fenced task (or of every task a pattern names)
    are coordinated, set at run time by an operator: paused, capped, its lease.

    Read by every execution of ``fenced_task`` and of its ``django.tasks``
    twin (:mod:`coordination.jobs`, through a per-process cache of
    ``COORDINATION["JOB_POLICY_REFRESH"]`` seconds), so a change applies
    without a restart. Every change is recorded as a :class:`JobPolicyChange`.
    Empty overrides keep what the task's decorator says.
    """

    task = models.CharField(
        max_length=KEY_MAX_LENGTH - 5, unique=True, validators=[_task_field_validator],
        help_text=_("The task's name (billing.tasks.settle), or a beginning followed by * "
                    "(billing.* : every task whose name starts with billing.). An exact name "
                    "wins over a pattern, a longer pattern over a shorter one."),
    )
    paused = models.BooleanField(
        default=False, db_default=False,
        help_text=_("Executions that start while paused do not run their body."),
    )
    when_paused = models.CharField(
        max_length=5, choices=WhenPaused.choices, default=WhenPaused.DEFER,
        db_default=WhenPaused.DEFER,
        help_text=_("Defer (sent again after a countdown until resumed; never lost) or "
                    "skip (a Skipped result)."),
    )
    defer_seconds = models.FloatField(
        default=10.0, db_default=10.0,
        help_text=_("Countdown of a deferred execution before it asks again, in seconds."),
    )
    max_running = models.PositiveIntegerField(
        null=True, blank=True,
        help_text=_("At most this many executions of the task run at once, over all "
                    "workers and keys, each holding a fenced permit. Empty: no cap."),
    )
    ttl = models.FloatField(
        null=True, blank=True,
        help_text=_("Lease of each execution in seconds, instead of the decorator's. Empty: "
                    "the decorator's."),
    )
    on_busy = models.CharField(
        max_length=5, blank=True, default="", db_default="",
        choices=[("retry", "retry"), ("skip", "skip"), ("raise", "raise")],
        help_text=_("What an execution does when its lock (or every permit) is held, "
                    "instead of the decorator's. Empty: the decorator's."),
    )
    note = models.CharField(max_length=200, blank=True, default="", db_default="")
    updated_at = models.DateTimeField(db_default=Now(), auto_now=True)

    class Meta:
        ordering = ["task"]
        verbose_name = _("job policy")
        verbose_name_plural = _("job policies")
        permissions = [("pause_jobpolicy", "Can pause and resume tasks, and revoke their leases")]
        constraints = [
            models.CheckConstraint(
                condition=Q(max_running__isnull=True) | Q(max_running__gte=1, max_running__lte=1000),
                name="coordination_jobpolicy_max_running",
                violation_error_message=_("max running is from 1 to 1000, or empty."),
            ),
            models.CheckConstraint(
                condition=Q(ttl__isnull=True) | Q(ttl__gt=0),
                name="coordination_jobpolicy_ttl_gt_0",
                violation_error_message=_("ttl is more than 0 seconds, or empty."),
            ),
            models.CheckConstraint(
                condition=Q(defer_seconds__gte=0.1, defer_seconds__lte=3600),
                name="coordination_jobpolicy_defer_seconds",
                violation_error_message=_("the defer countdown is from 0.1 to 3600 seconds."),
            ),
        ]

    def __str__(self) -> str:
        return self.task

    def save(self, *args: Any, changed_by: str = "", via: str = "code", **kwargs: Any) -> None:
        """Save, and record the change (``changed_by``, ``via``, before and after) in
        the same transaction: a change nobody can see never applies."""
        alias = kwargs.get("using") or self._state.db or app_settings.DATABASE
        with transaction.atomic(using=alias):
            before = None
            if self.pk is not None:
                old = JobPolicy.objects.using(alias).select_for_update().filter(pk=self.pk).first()
                before = old.state() if old is not None else None
            super().save(*args, **kwargs)
            after = self.state()
            if before != after:
                JobPolicyChange.objects.using(alias).create(
                    policy=self, task=self.task, changed_by=changed_by, via=via,
                    before=before, after=after,
                )

    def delete(self, *args: Any, changed_by: str = "", via: str = "code", **kwargs: Any) -> Any:
        """Delete, recording the change; the record keeps the task's name."""
        alias = kwargs.get("using") or self._state.db or app_settings.DATABASE
        with transaction.atomic(using=alias):
            JobPolicyChange.objects.using(alias).create(
                policy=None, task=self.task, changed_by=changed_by, via=via,
                before=self.state(), after=None,
            )
            return super().delete(*args, **kwargs)

    @property
    def access_key(self) -> str:
        """The lock key the access rules see this policy as: ``task:<task>``
        (``task:billing.*`` for a pattern, matched by rule patterns as a key)."""
        return f"task:{self.task}"

    def state(self) -> dict[str, Any]:
        """The policy's settings as a change records them (before and after)."""
        return {
            "task": self.task, "paused": self.paused, "when_paused": self.when_paused,
            "defer_seconds": self.defer_seconds, "max_running": self.max_running,
            "ttl": self.ttl, "on_busy": self.on_busy, "note": self.note,
        }


class JobPolicyChange(models.Model):
    """One change of a job policy: who, when, through what, before and after.

    Written in the same transaction as the change by
    :func:`coordination.jobs.save_policy` and :func:`~coordination.jobs.delete_policy`;
    kept when the policy is deleted (``task`` names it).
    """

    policy = models.ForeignKey(
        JobPolicy, on_delete=models.SET_NULL, null=True, blank=True, related_name="changes"
    )
    task = models.CharField(max_length=KEY_MAX_LENGTH)
    changed_by = models.CharField(max_length=150, blank=True, default="")
    via = models.CharField(max_length=40, blank=True, default="")
    changed_at = models.DateTimeField(db_default=Now())
    before = models.JSONField(null=True, blank=True)
    after = models.JSONField(null=True, blank=True)

    class Meta:
        ordering = ["-changed_at", "-id"]
        verbose_name = _("job policy change")

    def __str__(self) -> str:
        return f"{self.task} by {self.changed_by or 'code'} at {self.changed_at}"

    @property
    def summary(self) -> str:
        """``paused: False -> True; max_running: None -> 2``: what changed."""
        before, after = self.before or {}, self.after or {}
        if not before:
            return "created"
        if not after:
            return "deleted"
        return "; ".join(
            f"{name}: {before.get(name)!r} -> {after.get(name)!r}"
            for name in after if before.get(name) != after.get(name)
        ) or "no change"


class JobOutcome(models.TextChoices):
    DEFERRED = "deferred", _("deferred")
    SKIPPED = "skipped", _("skipped")


class JobTally(models.Model):
    """How many executions of a task did not run their body, and how: deferred
    (paused, sent again) or skipped (paused with skip, lock or permits busy,
    superseded). One row per task and outcome, counted up by
    :func:`coordination.jobs.tally`."""

    task = models.CharField(max_length=KEY_MAX_LENGTH)
    outcome = models.CharField(max_length=8, choices=JobOutcome.choices)
    count = models.BigIntegerField(default=0, db_default=0)
    last_at = models.DateTimeField(db_default=Now())

    class Meta:
        ordering = ["task", "outcome"]
        constraints = [
            models.UniqueConstraint(fields=["task", "outcome"], name="coordination_jobtally_once"),
        ]

    def __str__(self) -> str:
        return f"{self.task} {self.outcome}: {self.count}"


class Execution(models.Model):
    """One execution of a fenced task, recorded by the task itself when its grant
    was taken: which task, which message and attempt, which worker, under which
    grant (and permit). What the jobs page calls running comes from these rows
    and the grant's lease, never from a holder name a client may choose.

    Written once per execution, right after its acquire (never raising: a task
    is not failed over its bookkeeping), and pruned with the grant history.
    """

    task = models.CharField(max_length=255)
    task_id = models.CharField(max_length=255, blank=True, default="")
    attempt = models.PositiveIntegerField(default=1)
    worker = models.CharField(max_length=HOLDER_MAX_LENGTH, blank=True, default="")
    lock_key = models.CharField(max_length=KEY_MAX_LENGTH)
    token = models.BigIntegerField()
    permit_key = models.CharField(max_length=KEY_MAX_LENGTH, blank=True, default="")
    permit_token = models.BigIntegerField(null=True, blank=True)
    started_at = models.DateTimeField(db_default=Now())

    class Meta:
        ordering = ["started_at", "id"]
        constraints = [
            models.UniqueConstraint(fields=["lock_key", "token"], name="coordination_execution_grant"),
        ]
        indexes = [models.Index(fields=["started_at"], name="coordination_execution_started")]

    def __str__(self) -> str:
        return f"{self.task}[{self.task_id}]#{self.attempt} under {self.lock_key} token {self.token}"
