"""The outbox: calls to systems that cannot check a token, recorded under a fence."""

from __future__ import annotations

from django.db import models
from django.db.models import Q
from django.utils.translation import gettext_lazy as _

from ..keys import KEY_MAX_LENGTH


class OutboxState(models.TextChoices):
    PENDING = "pending", _("pending")
    SENDING = "sending", _("sending")
    SENT = "sent", _("sent")
    FAILED = "failed", _("failed")
    NEEDS_RECONCILIATION = "needs_reconciliation", _("needs reconciliation")


class OutboxCall(models.Model):
    """An external call a fenced task recorded, and where the relay is with it.

    ``lock_key``, ``token`` and ``step`` are the grant it was recorded with (the
    record was a fenced write: a stale holder cannot record a call). The
    ``idempotency_key`` is fixed when the call is recorded and sent with every
    attempt, so a receiver that keeps it applies the call once however often the
    relay sends it. ``relay_term`` is the relay's election term of the last
    transition.
    """

    kind = models.CharField(max_length=32, default="http")
    target = models.CharField(max_length=2000)
    method = models.CharField(max_length=10, default="POST")
    headers = models.JSONField(default=dict, blank=True)
    payload = models.JSONField(default=dict, blank=True)
    idempotent = models.BooleanField(
        default=True,
        help_text=_("The receiver keeps the idempotency key: a relay that died mid-send resends."),
    )
    idempotency_key = models.CharField(max_length=64, unique=True)
    resource = models.CharField(max_length=KEY_MAX_LENGTH)
    lock_key = models.CharField(max_length=KEY_MAX_LENGTH, db_index=True)
    token = models.BigIntegerField()
    step = models.BigIntegerField()
    state = models.CharField(
        max_length=24, choices=OutboxState.choices, default=OutboxState.PENDING
    )
    attempts = models.PositiveIntegerField(default=0)
    max_attempts = models.PositiveIntegerField(default=5)
    last_error = models.TextField(blank=True, default="")
    response_status = models.IntegerField(null=True, blank=True)
    relay_term = models.BigIntegerField(null=True, blank=True)
    note = models.TextField(blank=True, default="")
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)
    next_attempt_at = models.DateTimeField(null=True, blank=True)
    sent_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["id"]
        permissions = [("relay_outboxcall", "Can retry an outbox call or mark it reconciled")]
        indexes = [models.Index(fields=["state", "id"], name="coordination_outbox_state")]
        constraints = [
            models.CheckConstraint(condition=Q(token__gt=0), name="coordination_outbox_token_gt_0"),
        ]

    def __str__(self) -> str:
        return f"{self.kind} {self.method} {self.target} [{self.state}]"
