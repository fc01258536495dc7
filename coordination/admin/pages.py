"""The admin's own pages beside the lists: the dashboard and the jobs page."""

from __future__ import annotations

from urllib.parse import urlencode

from django.contrib import admin
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.utils.translation import gettext_lazy as _

from .. import access, dashboard, jobs
from ..conf import app_settings
from .base import has_perm, page_context

DASHBOARD_REFRESH_SECONDS = 10


def _refresh(request: HttpRequest) -> int:
    """The page's refresh period asked for in ``?refresh=``, 0 (paused) to an hour."""
    try:
        return max(0, min(int(request.GET.get("refresh", DASHBOARD_REFRESH_SECONDS)), 3600))
    except ValueError:
        return DASHBOARD_REFRESH_SECONDS


def _shown(request: HttpRequest, *, accepted_writes: bool) -> dashboard.Shown:
    """What the user's permissions and access rules let a page show."""
    return dashboard.Shown(
        grants=has_perm(request, "view_grant"),
        rejections=has_perm(request, "view_rejection"),
        accepted_writes=accepted_writes and has_perm(request, "view_acceptedwrite"),
        access=access.for_request(request),
    )


def dashboard_page(model_admin: admin.ModelAdmin, request: HttpRequest) -> HttpResponse:  # type: ignore[type-arg]
    """The dashboard (``lock/dashboard/``): ``?key=`` chooses the locks of the timeline."""
    if not model_admin.has_view_permission(request):
        raise PermissionDenied
    keys = [key for key in request.GET.getlist("key") if key][: dashboard.TIMELINE_LOCKS]
    refresh = _refresh(request)
    data = dashboard.build_dashboard(keys, shown=_shown(request, accepted_writes=True))
    context = {
        **page_context(request, model_admin, str(_("Dashboard")), changelist=False),
        "title": _("Coordination dashboard"),
        "dashboard": data,
        "refresh": refresh,
        "chosen_keys": keys,
        "pause_url": "?" + urlencode({"key": keys, "refresh": 0}, doseq=True),
        "resume_url": "?" + urlencode(
            {"key": keys, "refresh": DASHBOARD_REFRESH_SECONDS}, doseq=True
        ),
    }
    return TemplateResponse(request, "coordination/dashboard.html", context)


def jobs_page(model_admin: admin.ModelAdmin, request: HttpRequest, *, can_pause: bool) -> HttpResponse:  # type: ignore[type-arg]
    """The jobs page (``jobpolicy/jobs/``): each fenced task, its running executions
    and, for a user who may pause it, its buttons."""
    if not model_admin.has_view_permission(request):
        raise PermissionDenied
    shown = _shown(request, accepted_writes=False)
    rules = shown.access
    data = dashboard.build_jobs(
        shown=shown,
        may_steer=lambda task: can_pause and rules.allows("revoke", jobs.permit_name(task)),
    )
    context = {
        **page_context(request, model_admin, str(_("Jobs")), changelist=True),
        "title": _("Fenced tasks"),
        "jobs": data,
        "refresh": _refresh(request),
        "show_grants": shown.grants,
        "policy_refresh": app_settings.JOB_POLICY_REFRESH,
        "clearable": [
            execution.pk for execution in data.stranded
            if has_perm(request, "revoke_lock") and all(
                rules.allows("revoke", key)
                for key in (jobs.permit_name(execution.task), *execution.keys)
            )
        ],
    }
    return TemplateResponse(request, "coordination/admin/jobs.html", context)
