"""Fences, with the raise-to-the-lock's-token action for after a restore."""

from __future__ import annotations

import datetime as dt
from typing import cast

from django.contrib import admin
from django.db.models import OuterRef, QuerySet, Subquery
from django.db.models.functions import Coalesce
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse
from django.utils.html import format_html
from django.utils.translation import gettext_lazy as _
from django.utils.translation import ngettext_lazy

from .. import fencing
from ..models import Fence, Lock
from .actions import Done, OperatorAction, OperatorActionsMixin, counted
from .base import HistoryAdmin, has_perm, readable


def watermark(fence: Fence) -> str:
    return f"{fence.token}, {fence.step}"


def issued(fence: Fence) -> int:
    """The last token the fence's lock has issued (0 for a lock never granted)."""
    found = getattr(fence, "issued", None)
    if found is None:
        found = Lock.objects.filter(key=fence.lock_key).values_list("token", flat=True).first()
    return int(found or 0)


def _raise(request: HttpRequest, fence: Fence) -> Done | None:
    result = fencing.raise_fence_to_lock(fence.resource)
    if not result.raised:
        return None
    return Done(
        fence,
        f"Raised the watermark from {result.before[0]} (step {result.before[1]}) to "
        f"{result.after[0]} (step {result.after[1]}), the last token of lock "
        f"{result.lock_key}.",
    )


RAISE = OperatorAction[Fence](
    permission="raise_fence",
    keys=lambda fence: [fence.lock_key],
    run=_raise,
    report=counted(
        ngettext_lazy(
            "Raised %(count)d fence to its lock's last token; older tokens are refused.",
            "Raised %(count)d fences to their locks' last tokens; older tokens are refused.",
            "count",
        ),
        ngettext_lazy(
            "%(count)d fence was already at its lock's last token; left as it is.",
            "%(count)d fences were already at their locks' last tokens; left as they are.",
            "count",
        ),
    ),
    title=(_("Raise this watermark?"), _("Raise watermarks?")),
    explanation=_(
        "For after a restore from backup: each watermark is raised to the last "
        "token its lock has issued, so writes of every older token are refused "
        "as stale. The holder of that last token can still write. A watermark is "
        "never lowered."
    ),
    button=_("Yes, raise"),
    headers=[_("resource"), _("lock"), _("watermark"), _("lock's last token")],
    row=lambda fence: [fence.resource, fence.lock_key, watermark(fence), issued(fence)],
)


@admin.register(Fence)
class FenceAdmin(OperatorActionsMixin, HistoryAdmin):
    list_display = ["resource", "lock_key_link", "watermark", "lock_token", "last_write"]
    search_fields = ["resource", "lock_key"]
    fields = readonly_fields = (
        "resource", "lock_key_link", "token", "step", "lock_token", "last_write",
    )
    actions = ["raise_to_lock_token"]
    guarded_actions = ["raise_to_lock_token"]
    object_actions = {"can_raise": "raise_fence"}
    change_form_template = "coordination/admin/fence_change_form.html"

    def get_queryset(self, request: HttpRequest) -> QuerySet[Fence]:
        lock = Lock.objects.filter(key=OuterRef("lock_key"))
        rows = super().get_queryset(request).annotate(
            issued=Coalesce(Subquery(lock.values("token")[:1]), 0),
            lock_pk=Subquery(lock.values("pk")[:1]),
        )
        return cast("QuerySet[Fence]", readable(request, rows, "lock_key"))

    def get_urls(self) -> list[URLPattern]:
        view = self.admin_site.admin_view
        return [
            path("<path:object_id>/raise/", view(self.raise_view), name="coordination_fence_raise"),
            *super().get_urls(),
        ]

    def has_raise_permission(self, request: HttpRequest) -> bool:
        return has_perm(request, "raise_fence")

    @admin.display(description=_("watermark (token, step)"), ordering="token")
    def watermark(self, fence: Fence) -> str:
        return watermark(fence)

    @admin.display(description=_("lock's last token"), ordering="issued")
    def lock_token(self, fence: Fence) -> str:
        last = issued(fence)
        if last > fence.token:
            return format_html(
                '{} <span class="coordination-note" title="{}">({})</span>', last,
                _("tokens up to this one were issued but have not written here"),
                _("ahead of the watermark"),
            )
        return str(last)

    @admin.display(description=_("lock"), ordering="lock_key")
    def lock_key_link(self, fence: Fence) -> str:
        lock = getattr(fence, "lock_pk", None)
        if lock is None:
            return fence.lock_key
        url = reverse("admin:coordination_lock_change", args=[lock])
        return format_html('<a href="{}">{}</a>', url, fence.lock_key)

    @admin.display(description=_("last write"), ordering="updated_at")
    def last_write(self, fence: Fence) -> dt.datetime:
        return fence.updated_at

    @admin.action(description=_("Raise to the lock's last issued token"), permissions=["raise"])
    def raise_to_lock_token(
        self, request: HttpRequest, queryset: QuerySet[Fence]
    ) -> TemplateResponse | None:
        chosen = list(queryset.order_by("resource"))
        return self.act_on_selected(request, RAISE, chosen, "raise_to_lock_token")

    def raise_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        return self.act_on_object(request, object_id, RAISE)
