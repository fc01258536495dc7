"""The outbox in the admin: the calls by state, and the operator's two actions.

Registered on import (the app's admin imports this module). A user sees the
calls whose lock key the access rules let them ``read``; retrying a call or
marking it reconciled needs the ``coordination.relay_outboxcall`` permission and
``write`` on its key (docs/access-rules.md). Nothing else is editable: a call's
target, payload and idempotency key are what the fenced task recorded.
"""

from __future__ import annotations

from typing import Any

from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest
from django.utils.translation import gettext_lazy as _
from django.utils.translation import ngettext

from .. import access
from ..models import OutboxCall
from .outbox import mark_reconciled, retry_call

PERMISSION = "coordination.relay_outboxcall"


@admin.register(OutboxCall)
class OutboxCallAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    list_display = [
        "id", "state", "kind", "method", "target", "lock_key", "token", "attempts",
        "response_status", "updated_at",
    ]
    list_filter = ["state", "kind"]
    search_fields = ["target", "lock_key", "idempotency_key"]
    date_hierarchy = "created_at"
    actions = ["retry", "reconcile"]

    def get_queryset(self, request: HttpRequest) -> QuerySet[OutboxCall]:
        rows = super().get_queryset(request)
        return access.for_request(request).filter(rows, "read", "lock_key")

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> list[str]:
        return [field.name for field in OutboxCall._meta.fields]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False  # calls are recorded by fenced tasks, never typed in

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False  # the record of what was sent is the audit

    def has_relay_permission(self, request: HttpRequest) -> bool:
        return bool(getattr(request, "user", None) and request.user.has_perm(PERMISSION))

    def _writable(self, request: HttpRequest, calls: QuerySet[OutboxCall]) -> list[OutboxCall]:
        rules = access.for_request(request)
        allowed = [call for call in calls if rules.allows("write", call.lock_key)]
        refused = len(calls) - len(allowed)
        if refused:
            self.message_user(request, ngettext(
                "%d call skipped: your access rules do not allow write on its key.",
                "%d calls skipped: your access rules do not allow write on their keys.", refused,
            ) % refused, messages.WARNING)
        return allowed

    @admin.action(description=_("Retry (same idempotency key)"), permissions=["relay"])
    def retry(self, request: HttpRequest, calls: QuerySet[OutboxCall]) -> None:
        done = sum(retry_call(call) for call in self._writable(request, calls))
        self.message_user(request, ngettext(
            "%d call set to pending.", "%d calls set to pending.", done) % done)

    @admin.action(description=_("Mark reconciled (it took effect)"), permissions=["relay"])
    def reconcile(self, request: HttpRequest, calls: QuerySet[OutboxCall]) -> None:
        user = getattr(request.user, "get_username", lambda: "")()
        done = sum(mark_reconciled(call, f"marked reconciled by {user}")
                   for call in self._writable(request, calls))
        self.message_user(request, ngettext(
            "%d call marked reconciled.", "%d calls marked reconciled.", done) % done)
