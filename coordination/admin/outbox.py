"""The outbox in the admin: the calls by state, and the operator's two actions.

A user sees the calls whose lock key the access rules let them ``read``.
Retrying a call or marking it reconciled is an operator action
(:func:`.actions.operate`): the ``coordination.relay_outboxcall`` permission,
a confirmation page, ``write`` on the key of every call chosen (403 unless all
allow it), an admin log entry per call moved and a message. Nothing else is
editable: a call's target, payload and idempotency key are what the fenced task
recorded.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django.contrib import admin
from django.db.models import QuerySet
from django.http import HttpRequest
from django.template.response import TemplateResponse
from django.utils.translation import gettext_lazy as _
from django.utils.translation import ngettext_lazy

from ..models import OutboxCall
from ..stores.outbox import mark_reconciled, retry_call
from .actions import Done, OperatorAction, OperatorActionsMixin, counted
from .base import has_perm, readable

PERMISSION = "coordination.relay_outboxcall"
_HEADERS = [_("call"), _("state"), _("target"), _("lock key"), _("attempts"), _("last error")]


def _row(call: OutboxCall) -> list[Any]:
    return [call.pk, call.get_state_display(), call.target, call.lock_key, call.attempts,
            call.last_error or "-"]


def _retry(request: HttpRequest, call: OutboxCall) -> Done | None:
    previous = call.get_state_display()
    if not retry_call(call):
        return None
    by = request.user.get_username()
    return Done(call, f"Retry by {by} (was {previous}); sent again with idempotency key "
                      f"{call.idempotency_key}.")


def _reconcile(request: HttpRequest, call: OutboxCall) -> Done | None:
    previous = call.get_state_display()
    by = request.user.get_username()
    if not mark_reconciled(call, f"marked reconciled by {by}"):
        return None
    return Done(call, f"Marked reconciled by {by} (was {previous}); recorded sent, never sent again.")


_LEFT = ngettext_lazy(
    "%(count)d call was not failed or needing reconciliation; left as it was.",
    "%(count)d calls were not failed or needing reconciliation; left as they were.", "count",
)


def _action(
    run: Callable[[HttpRequest, OutboxCall], Done | None], done: Any,
    title: tuple[Any, Any], explanation: Any, button: Any,
) -> OperatorAction[OutboxCall]:
    """An action on chosen calls: the relay permission and ``write`` on every call's
    key, a confirmation page listing them, and how many moved (``done``) or were left."""
    return OperatorAction[OutboxCall](
        permission="relay_outboxcall", keys=lambda call: [call.lock_key], run=run, rule="write",
        report=counted(done, _LEFT), title=title, explanation=explanation, button=button,
        headers=_HEADERS, row=_row,
    )


RETRY = _action(
    _retry,
    ngettext_lazy(
        "%(count)d call set to pending; the relay sends it again with the same idempotency key.",
        "%(count)d calls set to pending; the relay sends them again with the same idempotency keys.",
        "count",
    ),
    (_("Retry this call?"), _("Retry calls?")),
    _(
        "The calls go back to pending, with one more attempt allowed, and the relay sends "
        "them again with the idempotency key they were recorded with: a receiver that keeps "
        "the keys applies each call once. Only failed calls and calls needing reconciliation "
        "are retried."
    ),
    _("Yes, retry"),
)

RECONCILE = _action(
    _reconcile,
    ngettext_lazy(
        "%(count)d call marked reconciled; it is recorded sent and never sent again.",
        "%(count)d calls marked reconciled; they are recorded sent and never sent again.",
        "count",
    ),
    (_("Mark this call reconciled?"), _("Mark calls reconciled?")),
    _(
        "You checked at the receiver that these calls took effect. They are recorded sent, "
        "with your name in their note, and the relay never sends them again."
    ),
    _("Yes, mark reconciled"),
)


@admin.register(OutboxCall)
class OutboxCallAdmin(OperatorActionsMixin, admin.ModelAdmin):  # type: ignore[type-arg]
    list_display = [
        "id", "state", "kind", "method", "target", "lock_key", "token", "attempts",
        "response_status", "updated_at",
    ]
    list_filter = ["state", "kind"]
    search_fields = ["target", "lock_key", "idempotency_key"]
    date_hierarchy = "created_at"
    actions = ["retry", "reconcile"]
    guarded_actions = ["retry", "reconcile"]

    class Media:
        css = {"all": ("coordination/admin.css",)}

    def get_queryset(self, request: HttpRequest) -> QuerySet[OutboxCall]:
        return readable(request, super().get_queryset(request), "lock_key")

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> list[str]:
        return [field.name for field in OutboxCall._meta.fields]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False  # calls are recorded by fenced tasks, never typed in

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False  # the record of what was sent is the audit

    def has_relay_permission(self, request: HttpRequest) -> bool:
        return has_perm(request, "relay_outboxcall")

    @admin.action(description=_("Retry (same idempotency key)"), permissions=["relay"])
    def retry(self, request: HttpRequest, calls: QuerySet[OutboxCall]) -> TemplateResponse | None:
        return self.act_on_selected(request, RETRY, list(calls.order_by("id")), "retry")

    @admin.action(description=_("Mark reconciled (it took effect)"), permissions=["relay"])
    def reconcile(self, request: HttpRequest, calls: QuerySet[OutboxCall]) -> TemplateResponse | None:
        return self.act_on_selected(request, RECONCILE, list(calls.order_by("id")), "reconcile")
