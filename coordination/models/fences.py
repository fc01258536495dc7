"""The resource side's rows: named fences, refusals, accepted writes, idempotency
records, tombstones of deleted fenced rows, audited unfenced saves, documents."""

from __future__ import annotations

from typing import TYPE_CHECKING

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
    pass


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
