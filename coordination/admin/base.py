"""What every admin of the app shares: read-only history, access rules on rows,
the page context of its own pages, and small display helpers."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Sequence
from typing import Any, cast
from urllib.parse import urlencode

import django
from django.contrib import admin
from django.contrib.admin.utils import unquote
from django.core.exceptions import PermissionDenied
from django.db.models import Expression, Model, QuerySet
from django.http import Http404, HttpRequest
from django.urls import reverse
from django.utils.html import format_html
from django.utils.translation import gettext_lazy as _

from .. import access


class HistoryAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    """Read-only for everyone: rows are written by the grant point and the fences only."""

    class Media:
        css = {"all": ("coordination/admin.css",)}

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


class ChoiceFilter(admin.SimpleListFilter):
    """A list filter of fixed choices: ``options`` are (value, label, narrow)
    triples, ``narrow`` taking the rows to the rows of that choice."""

    options: Sequence[tuple[str, Any, Callable[[QuerySet[Any]], QuerySet[Any]]]] = ()

    def lookups(
        self, request: HttpRequest, model_admin: admin.ModelAdmin  # type: ignore[type-arg]
    ) -> list[tuple[str, str]]:
        return [(value, str(label)) for value, label, _narrow in self.options]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any] | None:
        chosen = self.value()
        return next((narrow(queryset) for value, _label, narrow in self.options if value == chosen), None)


def object_or_404(model_admin: admin.ModelAdmin, request: HttpRequest, object_id: str) -> Model:  # type: ignore[type-arg]
    """The row an operator page names by its URL, or 404.

    ``get_object`` turns an id the primary key cannot hold (``abc`` for an
    integer key) into None, as the admin's own change page does; a plain
    ``get_object_or_404(pk=...)`` would raise ``ValueError``: a server error.
    """
    found = model_admin.get_object(request, unquote(object_id))
    if found is None:
        raise Http404(f"No {model_admin.opts.verbose_name} with id {object_id!r}.")
    return cast(Model, found)


def has_perm(request: HttpRequest, codename: str) -> bool:
    return request.user.has_perm(f"coordination.{codename}")


def readable(request: HttpRequest, rows: QuerySet[Any], key: str | Expression) -> QuerySet[Any]:
    """``rows`` of the lock keys the user's access rules let them read.

    ``key`` is the row's lock key: a field lookup (``"lock__key"``) or an
    expression computing it. Every admin of the app filters its rows here, in
    ``get_queryset``, so its list, change and history pages, its actions (they
    run on the list's rows), list filters, date drill-down and autocomplete
    see the same rows.
    """
    rules = access.for_request(request)
    if not rules.limited:
        return rows
    if not isinstance(key, str):
        rows, key = rows.alias(coordination_rules_key=key), "coordination_rules_key"
    return rules.filter(rows, "read", key)


def require_rules(request: HttpRequest, action: str, keys: Sequence[str]) -> None:
    """403 unless the user's access rules allow ``action`` on every one of ``keys``."""
    rules = access.for_request(request)
    if not all(rules.allows(action, key) for key in keys):
        raise PermissionDenied


def page_context(
    request: HttpRequest,
    model_admin: admin.ModelAdmin,  # type: ignore[type-arg]
    title: str,
    *,
    changelist: bool,
) -> dict[str, Any]:
    """What every page of ours needs to look like the rest of the admin."""
    opts = model_admin.model._meta
    changelist_url = reverse(f"admin:{opts.app_label}_{opts.model_name}_changelist")
    crumbs: list[tuple[str, str]] = [
        (str(opts.app_config.verbose_name), reverse("admin:app_list", args=[opts.app_label]))
    ]
    if changelist:
        crumbs.append((str(opts.verbose_name_plural).capitalize(), changelist_url))
    crumbs.append((title, ""))
    return {
        **model_admin.admin_site.each_context(request),
        "title": title,
        "subtitle": None,
        "opts": opts,
        "app_label": opts.app_label,
        "changelist_url": changelist_url,
        "crumbs": crumbs,
        "ol_breadcrumbs": django.VERSION >= (6, 0),
    }


def timeline_link(key: str) -> str:
    url = reverse("admin:coordination_dashboard") + "?" + urlencode({"key": key})
    return format_html('<a href="{}" title="{}">{}</a>', url, _("timeline of this lock"), key)


def duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f} s"
    return str(dt.timedelta(seconds=round(seconds)))
