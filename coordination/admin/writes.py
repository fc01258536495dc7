"""The history of writes: refused, let through unfenced, accepted; idempotency records."""

from __future__ import annotations

from django.contrib import admin
from django.db.models import QuerySet
from django.http import HttpRequest
from django.utils.translation import gettext_lazy as _

from .. import access
from ..models import AcceptedWrite, IdempotencyRecord, Rejection, UnfencedSave
from .base import HistoryAdmin, readable, timeline_link


@admin.register(Rejection)
class RejectionAdmin(HistoryAdmin):
    list_display = [
        "created_at", "reason", "resource", "lock", "token", "step", "watermark", "holder",
    ]
    list_filter = ["reason"]
    search_fields = ["resource", "lock_key", "holder"]
    date_hierarchy = "created_at"

    def get_queryset(self, request: HttpRequest) -> QuerySet[Rejection]:
        return readable(request, super().get_queryset(request), "lock_key")

    @admin.display(description=_("lock"), ordering="lock_key")
    def lock(self, rejection: Rejection) -> str:
        return timeline_link(rejection.lock_key)

    @admin.display(description=_("watermark then (token, step)"))
    def watermark(self, rejection: Rejection) -> str:
        if rejection.watermark_token is None:
            return "-"
        return f"{rejection.watermark_token}, {rejection.watermark_step}"


@admin.register(UnfencedSave)
class UnfencedSaveAdmin(HistoryAdmin):
    """Saves of stale instances an operator let through with ``coordination.unfenced()``."""

    list_display = ["created_at", "resource", "lock", "by", "reason", "carried", "watermark"]
    search_fields = ["resource", "lock_key", "by", "reason"]
    date_hierarchy = "created_at"

    def get_queryset(self, request: HttpRequest) -> QuerySet[UnfencedSave]:
        return readable(request, super().get_queryset(request), "lock_key")

    @admin.display(description=_("lock"), ordering="lock_key")
    def lock(self, row: UnfencedSave) -> str:
        return timeline_link(row.lock_key)

    @admin.display(description=_("instance's watermark (token, step)"))
    def carried(self, row: UnfencedSave) -> str:
        return f"{row.token}, {row.step}"

    @admin.display(description=_("row's watermark, kept (token, step)"))
    def watermark(self, row: UnfencedSave) -> str:
        return f"{row.watermark_token}, {row.watermark_step}"


@admin.register(AcceptedWrite)
class AcceptedWriteAdmin(HistoryAdmin):
    list_display = ["created_at", "resource", "lock", "token", "step", "holder"]
    search_fields = ["resource", "lock_key", "holder"]
    date_hierarchy = "created_at"

    def get_queryset(self, request: HttpRequest) -> QuerySet[AcceptedWrite]:
        return readable(request, super().get_queryset(request), "lock_key")

    @admin.display(description=_("lock"), ordering="lock_key")
    def lock(self, write: AcceptedWrite) -> str:
        return timeline_link(write.lock_key)


@admin.register(IdempotencyRecord)
class IdempotencyRecordAdmin(HistoryAdmin):
    list_display = ["key", "completed", "created_at"]
    list_filter = ["completed"]
    search_fields = ["key"]
    date_hierarchy = "created_at"

    def get_queryset(self, request: HttpRequest) -> QuerySet[IdempotencyRecord]:
        # A record names no lock key (the API's are hashed) but holds results, a
        # document's data among them: a user limited by access rules sees none.
        rows = super().get_queryset(request)
        return rows.none() if access.for_request(request).limited else rows
