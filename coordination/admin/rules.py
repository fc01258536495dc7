"""The access rules (docs/access-rules.md), edited as AccessRule rows."""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.contrib.auth import get_user_model
from django.db.models import Q, QuerySet
from django.http import HttpRequest, HttpResponse
from django.utils.translation import gettext_lazy as _

from .. import access
from ..conf import app_settings
from ..models import AccessRule


def rules_in_force() -> str:
    mode = app_settings.ACCESS_RULES
    if mode == "off":
        return str(_('Rules are ignored: COORDINATION["ACCESS_RULES"] is "off".'))
    if mode == "auto" and not AccessRule.objects.exists():
        return str(_(
            'No rule yet, so none applies (COORDINATION["ACCESS_RULES"] is "auto"). From the '
            "first rule on, every user but superusers may use only the keys their rules name."
        ))
    return str(_(
        "Rules apply: every user but superusers may use only the keys their rules (or their "
        "groups' rules) name."
    ))


@admin.register(AccessRule)
class AccessRuleAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    """Who may use which keys (docs/access-rules.md); Django's model permissions on
    AccessRule say who may edit them, which is as much as giving every key away."""

    list_display = ["who", "pattern", "acquire", "write", "read", "revoke", "created_at"]
    list_display_links = ["who", "pattern"]
    list_filter = ["acquire", "write", "read", "revoke"]
    list_select_related = ["user", "group"]
    fieldsets = [
        (None, {"fields": ["user", "group", "pattern"]}),
        (_("Allowed on these keys"), {"fields": ["acquire", "write", "read", "revoke"]}),
    ]

    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        # Above the list: whether the rules apply now, so that the first rule's
        # effect (under "auto", everyone else is cut off) is not a surprise.
        context = {"subtitle": rules_in_force(), **(extra_context or {})}
        return super().changelist_view(request, context)

    def get_queryset(self, request: HttpRequest) -> QuerySet[AccessRule]:
        # Rules name keys and who holds them: a user limited by rules sees only
        # the rules that apply to them (their own and their groups').
        rows = super().get_queryset(request)
        if not access.for_request(request).limited:
            return rows
        user = request.user
        return rows.filter(Q(user_id=user.pk) | Q(group__in=user.groups.values("pk")))

    def get_search_fields(self, request: HttpRequest) -> list[str]:
        username = get_user_model().USERNAME_FIELD
        return ["pattern", f"user__{username}", "group__name"]

    @admin.display(description=_("who"), ordering="user")
    def who(self, rule: AccessRule) -> str:
        if rule.user_id:
            return str(_("user %(name)s") % {"name": rule.user})
        return str(_("group %(name)s") % {"name": rule.group})
