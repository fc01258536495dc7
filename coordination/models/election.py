"""Leader election's rows: roles (locks of their own) and the beat's slots."""

from __future__ import annotations

import datetime as dt
from typing import TYPE_CHECKING

from django.db import models
from django.db.models import Q
from django.db.models.functions import Coalesce, Concat, Now
from django.utils.translation import gettext_lazy as _

from ..keys import (
    HOLDER_MAX_LENGTH,
    KEY_MAX_LENGTH,
)
from .grants import Lock

if TYPE_CHECKING:
    pass


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
