"""Leader election: the roles with their terms, and the beat slots of ``FencedScheduler``."""

from __future__ import annotations

import datetime as dt
from typing import Any, cast
from urllib.parse import urlencode

from django.contrib import admin
from django.db.models import CharField, OuterRef, QuerySet, Subquery, Value
from django.db.models.functions import Concat
from django.http import HttpRequest
from django.urls import reverse
from django.utils.html import format_html
from django.utils.translation import gettext_lazy as _

from .. import locks
from ..election import ROLE_PREFIX
from ..models import BeatSlot, DatabaseNow, Role
from .base import ChoiceFilter, HistoryAdmin, duration, readable


@admin.register(Role)
class RoleAdmin(HistoryAdmin):
    """The roles of :mod:`coordination.election`: who leads now, since when, in which
    term; the role's Grant rows are its history of terms."""

    list_display = ["role", "leader", "term", "since", "lease_left", "terms_link"]
    search_fields = ["key", "holder"]
    fields = readonly_fields = ("role", "leader", "term", "since", "lease_left", "terms_link")

    def get_queryset(self, request: HttpRequest) -> QuerySet[Role]:
        rows = super().get_queryset(request).filter(key__startswith="election:")
        return cast("QuerySet[Role]", readable(request, rows.annotate(db_now=DatabaseNow()), "key"))

    def _leading(self, role: Role) -> bool:
        now = getattr(role, "db_now", None) or locks.database_now()
        return bool(role.holder) and role.expires_at is not None and role.expires_at > now

    @admin.display(description=_("role"), ordering="key")
    def role(self, role: Role) -> str:
        return str(role)

    @admin.display(description=_("leader"), ordering="holder")
    def leader(self, role: Role) -> str:
        if self._leading(role):
            return role.holder
        return format_html('<span class="coordination-badge coordination-free">{}</span>', _("no leader"))

    @admin.display(description=_("term"), ordering="token")
    def term(self, role: Role) -> int:
        """The current leader's term, or the last one issued when nobody leads."""
        return role.token

    @admin.display(description=_("leading since"), ordering="acquired_at")
    def since(self, role: Role) -> dt.datetime | None:
        return role.acquired_at if self._leading(role) else None

    @admin.display(description=_("lease left"))
    def lease_left(self, role: Role) -> str:
        if not self._leading(role) or role.expires_at is None:
            return "-"
        now = getattr(role, "db_now", None) or locks.database_now()
        return duration((role.expires_at - now).total_seconds())

    @admin.display(description=_("history of terms"))
    def terms_link(self, role: Role) -> str:
        url = reverse("admin:coordination_grant_changelist") + "?" + urlencode({"lock__id__exact": role.pk})
        return format_html('<a href="{}">{}</a>', url, _("terms"))


def _lost() -> QuerySet[Any]:
    return BeatSlot.objects.lost().values("pk")


class BeatSlotStateFilter(ChoiceFilter):
    title = _("state")
    parameter_name = "state"
    options = [
        ("sent", _("sent"), lambda rows: rows.filter(sent_at__isnull=False)),
        ("claimed", _("claimed, not sent yet (its term still leads)"),
         lambda rows: rows.filter(sent_at__isnull=True).exclude(pk__in=_lost())),
        ("lost", _("lost: claimed, never sent, its term is over"),
         lambda rows: rows.filter(pk__in=_lost())),
    ]


@admin.register(BeatSlot)
class BeatSlotAdmin(HistoryAdmin):
    """Slots of ``coordination.contrib.beat.FencedScheduler``: one row per schedule entry
    and due time, claimed once by a leader's term. A lost slot was claimed by a leader
    that died (or could not reach the broker) before it was sent; it is never resent."""

    list_display = ["entry", "due_at", "task", "term", "claimed_by", "claimed_at", "sent_at", "state"]
    list_filter = [BeatSlotStateFilter, "role", "entry"]
    search_fields = ["entry", "task", "claimed_by", "task_id"]
    date_hierarchy = "due_at"
    fields = readonly_fields = (
        "role", "entry", "task", "due_at", "term", "claimed_by", "claimed_at", "sent_at", "task_id",
        "state",
    )

    def get_queryset(self, request: HttpRequest) -> QuerySet[BeatSlot]:
        lost = BeatSlot.objects.lost().filter(pk=OuterRef("pk")).values("pk")[:1]
        rows = super().get_queryset(request).annotate(lost_pk=Subquery(lost))
        # A slot belongs to its role's lock, election:<role>.
        role_key = Concat(Value(ROLE_PREFIX), "role", output_field=CharField())
        return cast("QuerySet[BeatSlot]", readable(request, rows, role_key))

    @admin.display(description=_("state"))
    def state(self, slot: BeatSlot) -> str:
        if slot.sent_at is not None:
            kind, label = "released", _("sent")
        elif getattr(slot, "lost_pk", None) is not None:
            kind, label = "revoked", _("lost")
        else:
            kind, label = "live", _("claimed")
        return format_html('<span class="coordination-badge coordination-{}">{}</span>', kind, label)
