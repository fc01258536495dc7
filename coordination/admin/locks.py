"""Locks (with the revoke action) and their grants."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

from django.contrib import admin
from django.db.models import Count, OuterRef, QuerySet, Subquery
from django.db.models.functions import Coalesce
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse
from django.utils.html import format_html
from django.utils.translation import gettext_lazy as _
from django.utils.translation import ngettext_lazy

from .. import locks
from ..models import DatabaseNow, Grant, GrantEnd, Lock, LockQuerySet, LockState, TokenFloor
from .actions import Done, OperatorAction, OperatorActionsMixin, counted
from .base import ChoiceFilter, HistoryAdmin, duration, has_perm, readable
from .pages import dashboard_page


def _lock_rows(rows: QuerySet[Any]) -> LockQuerySet:
    return cast(LockQuerySet, rows)


class LockStateFilter(ChoiceFilter):
    title = _("state")
    parameter_name = "state"
    options = [
        (LockState.FREE.value, LockState.FREE.label, lambda rows: _lock_rows(rows).free()),
        (LockState.HELD.value, LockState.HELD.label, lambda rows: _lock_rows(rows).held()),
        (LockState.EXPIRED.value, LockState.EXPIRED.label, lambda rows: _lock_rows(rows).expired()),
    ]


def state_badge(lock: Lock) -> str:
    state = LockState(getattr(lock, "state", None) or lock.state_at(locks.database_now()))
    return format_html(
        '<span class="coordination-badge coordination-{}" data-state="{}">{}</span>',
        state.value, state.value, state.label,
    )


def _revoke(request: HttpRequest, lock: Lock) -> Done | None:
    grant = locks.revoke(lock.key)
    if grant is None:
        return None
    return Done(
        lock,
        f"Revoked the lease of token {grant.token} held by {grant.holder}; "
        "the next grant gets a higher token.",
    )


REVOKE = OperatorAction[Lock](
    permission="revoke_lock",
    keys=lambda lock: [lock.key],
    run=_revoke,
    report=counted(
        ngettext_lazy(
            "Revoked %(count)d lock; its next grant gets a higher token.",
            "Revoked %(count)d locks; their next grants get higher tokens.", "count",
        ),
        ngettext_lazy(
            "%(count)d lock was already free; nothing to revoke.",
            "%(count)d locks were already free; nothing to revoke.", "count",
        ),
    ),
    title=(_("Revoke this lock?"), _("Revoke locks?")),
    explanation=_(
        "Revoking ends the current lease at once. The holder's renew and release "
        "fail from now on, and the next acquire gets a higher token, whose first "
        "write fences the revoked holder out. Writes the holder already made stay."
    ),
    button=_("Yes, revoke"),
    headers=[_("lock"), _("state"), _("holder"), _("last token")],
    row=lambda lock: [lock.key, state_badge(lock), lock.holder or "-", lock.token],
)


@admin.register(Lock)
class LockAdmin(OperatorActionsMixin, HistoryAdmin):
    list_display = ["key", "state_badge", "holder", "last_token", "expires_in", "grant_count"]
    list_display_links = ["key"]
    list_filter = [LockStateFilter]
    search_fields = ["key", "holder"]
    fields = readonly_fields = (
        "key", "state_badge", "holder", "last_token", "acquired_at", "expires_at", "expires_in",
        "grant_count", "created_at",
    )
    actions = ["revoke_selected"]
    guarded_actions = ["revoke_selected"]
    object_actions = {"can_revoke": "revoke_lock"}
    change_list_template = "coordination/admin/lock_change_list.html"
    change_form_template = "coordination/admin/lock_change_form.html"

    def get_queryset(self, request: HttpRequest) -> QuerySet[Lock]:
        grants = (
            Grant.objects.filter(lock=OuterRef("pk")).order_by().values("lock")
            .annotate(n=Count("pk")).values("n")
        )
        # db_now is read in the same statement as the state, so "expires in" and
        # the badge agree, and both come from the database clock.
        rows = (
            cast(LockQuerySet, super().get_queryset(request))
            .with_state()
            .annotate(db_now=DatabaseNow(), grants_total=Coalesce(Subquery(grants), 0))
        )
        return readable(request, rows, "key")

    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        # Shown above the list: the counter a key the list does not have starts from.
        context = {"token_floor": TokenFloor.objects.value(), **(extra_context or {})}
        return super().changelist_view(request, context)

    def get_urls(self) -> list[URLPattern]:
        view = self.admin_site.admin_view
        return [
            path("dashboard/", view(self.dashboard_view), name="coordination_dashboard"),
            path("<path:object_id>/revoke/", view(self.revoke_view), name="coordination_lock_revoke"),
            *super().get_urls(),
        ]

    def has_revoke_permission(self, request: HttpRequest) -> bool:
        return has_perm(request, "revoke_lock")

    @admin.display(description=_("state"), ordering="state")
    def state_badge(self, lock: Lock) -> str:
        return state_badge(lock)

    @admin.display(description=_("last token"), ordering="token")
    def last_token(self, lock: Lock) -> int:
        return lock.token

    @admin.display(description=_("expires in"), ordering="expires_at")
    def expires_in(self, lock: Lock) -> str:
        if not lock.holder or lock.expires_at is None:
            return "-"
        now = getattr(lock, "db_now", None) or locks.database_now()
        seconds = (lock.expires_at - now).total_seconds()
        if seconds <= 0:
            return str(_("expired %(seconds)s ago") % {"seconds": duration(-seconds)})
        return duration(seconds)

    @admin.display(description=_("grants"), ordering="grants_total")
    def grant_count(self, lock: Lock) -> str:
        total = getattr(lock, "grants_total", None)
        if total is None:
            total = lock.grants.count()
        url = reverse("admin:coordination_grant_changelist") + f"?lock__id__exact={lock.pk}"
        return format_html('<a href="{}">{}</a>', url, total)

    @admin.action(description=_("Revoke the selected locks"), permissions=["revoke"])
    def revoke_selected(
        self, request: HttpRequest, queryset: QuerySet[Lock]
    ) -> TemplateResponse | None:
        return self.act_on_selected(request, REVOKE, list(queryset.order_by("key")), "revoke_selected")

    def revoke_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        return self.act_on_object(request, object_id, REVOKE)

    def dashboard_view(self, request: HttpRequest) -> HttpResponse:
        return dashboard_page(self, request)


def _ended(reason: str) -> Callable[[QuerySet[Any]], QuerySet[Any]]:
    return lambda rows: rows.filter(end_reason=reason)


class GrantEndFilter(ChoiceFilter):
    title = _("end")
    parameter_name = "end"
    options = [
        *((str(value), label, _ended(value)) for value, label in GrantEnd.choices),
        ("live", _("live lease"), lambda rows: rows.filter(ended_at=None, expires_at__gt=DatabaseNow())),
        ("unreleased", _("expired, not released"),
         lambda rows: rows.filter(ended_at=None, expires_at__lte=DatabaseNow())),
    ]


@admin.register(Grant)
class GrantAdmin(HistoryAdmin):
    list_display = [
        "lock_link", "token", "mode", "holder", "acquired_at", "expires_at", "ended_at", "end",
    ]
    list_filter = [GrantEndFilter, "mode"]
    list_select_related = ["lock"]
    search_fields = ["lock__key", "holder"]
    date_hierarchy = "acquired_at"
    fields = readonly_fields = (
        "lock_link", "token", "mode", "holder", "acquired_at", "expires_at", "ended_at", "end",
    )

    def get_queryset(self, request: HttpRequest) -> QuerySet[Grant]:
        rows = super().get_queryset(request).annotate(db_now=DatabaseNow())
        return cast("QuerySet[Grant]", readable(request, rows, "lock__key"))

    @admin.display(description=_("lock"), ordering="lock__key")
    def lock_link(self, grant: Grant) -> str:
        url = reverse("admin:coordination_lock_change", args=[grant.lock_id])
        return format_html('<a href="{}">{}</a>', url, grant.lock.key)

    @admin.display(description=_("end"), ordering="end_reason")
    def end(self, grant: Grant) -> str:
        if grant.end_reason:
            kind, label = grant.end_reason, GrantEnd(grant.end_reason).label
        else:
            now = getattr(grant, "db_now", None) or locks.database_now()
            if grant.expires_at > now:
                kind, label = "live", _("live lease")
            else:
                kind, label = "expired", _("expired, not released")
        return format_html(
            '<span class="coordination-badge coordination-{}">{}</span>', kind, label
        )
