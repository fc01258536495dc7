"""The operator's view: locks, grants, fences and refused writes, and a dashboard.

Everything here is read-only history except three operator actions, each with a
permission of its own, a confirmation page and an admin log entry:

- revoke a lock (``coordination.revoke_lock``): :func:`coordination.locks.revoke`;
- raise a fence to its lock's last token (``coordination.raise_fence``):
  :func:`coordination.fencing.raise_fence_to_lock`, for after a restore;
- re-bind a document to another lock key (``coordination.rebind_document``):
  :func:`coordination.documents.rebind_document`.

Access rules (:mod:`coordination.access`, edited here as AccessRule rows) limit
what a user sees and does to the keys their rules allow: every list of per-key
rows leaves out the others, the dashboard too, and revoking or raising needs
the ``revoke`` action on the key.

Leader election has two read-only lists: the roles (their leader, term and
history of terms) and the beat slots of ``FencedScheduler`` (claimed, sent, lost).

Job policies (:mod:`coordination.jobs`) are edited here, every change recorded;
pausing and resuming a task needs ``coordination.pause_jobpolicy``, and the
jobs page shows each fenced task's running executions with its buttons.

Lock and fence rows are never deleted (rule 8 of docs/rules.md): their counters and
watermarks are what keeps old tokens refused. States and times are decided with
the database clock.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from typing import Any, cast
from urllib.parse import urlencode

import django
from django import forms
from django.apps import apps as django_apps
from django.contrib import admin, messages
from django.contrib.admin.helpers import ACTION_CHECKBOX_NAME
from django.contrib.admin.utils import flatten_fieldsets, unquote
from django.contrib.auth import get_user_model
from django.core.exceptions import PermissionDenied
from django.db.models import (
    CharField,
    Count,
    Expression,
    Model,
    OuterRef,
    Q,
    QuerySet,
    Subquery,
    Value,
)
from django.db.models.functions import Coalesce, Concat
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse
from django.utils.html import format_html
from django.utils.translation import gettext_lazy as _
from django.utils.translation import ngettext

from . import access, dashboard, documents, fencing, jobs, locks
from .conf import app_settings
from .election import ROLE_PREFIX
from .exceptions import InvalidInput, StaleInstance, StaleToken, UnfencedWrite
from .models import (
    KEY_MAX_LENGTH,
    AcceptedWrite,
    AccessRule,
    BeatSlot,
    DatabaseNow,
    Document,
    Fence,
    Grant,
    GrantEnd,
    IdempotencyRecord,
    JobPolicy,
    Lock,
    LockQuerySet,
    LockState,
    Rejection,
    Role,
    TokenFloor,
    UnfencedSave,
    validate_key,
    validate_task_pattern,
)

DASHBOARD_REFRESH_SECONDS = 10


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


# The change form's hidden field: the watermark of the row as the page showed it.
WATERMARK_FIELD = "coordination_watermark"


class _CarriedWatermark(forms.Form):
    """Carries the row's watermark from the page the user edited to the save, so a
    form loaded before a newer write is refused like any stale instance."""

    coordination_watermark = forms.CharField(widget=forms.HiddenInput, required=False)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        instance = getattr(self, "instance", None)
        if isinstance(instance, fencing.FencedModel) and instance.pk is not None:
            token, step = instance.carried_watermark()
            self.fields[WATERMARK_FIELD].initial = f"{token},{step}"

    def clean_coordination_watermark(self) -> tuple[int, int]:
        try:
            token, step = (int(part) for part in self.cleaned_data[WATERMARK_FIELD].split(","))
        except ValueError:
            raise forms.ValidationError(
                _("This form does not say which version of the row it edits; reload the page "
                  "and make the change again."),
                code="no_watermark",
            ) from None
        return token, step


class _UniqueWithinRules(forms.ModelForm):  # type: ignore[type-arg]
    """A model form whose unique check tells a user limited by access rules nothing
    of the rows they may not read: a clash with one is 403, as a write their rules
    refuse, never "... with this name already exists"."""

    readable: Any = None  # the rows the user may read (the admin's queryset)

    def validate_unique(self) -> None:
        # The fields to check, before the check's own errors exclude them.
        exclude = self._get_validation_exclusions()  # type: ignore[attr-defined]
        super().validate_unique()
        if self.readable is None or not self.errors:
            return
        instance = self.instance
        model = type(instance)
        checks, _ = instance._get_unique_checks(exclude=exclude)
        for owner, fields in checks:
            values = {name: getattr(instance, owner._meta.get_field(name).attname) for name in fields}
            if any(value is None for value in values.values()):
                continue
            clashing = model._default_manager.filter(**values)
            if instance.pk is not None:
                clashing = clashing.exclude(pk=instance.pk)
            if clashing.exclude(pk__in=self.readable.values("pk")).exists():
                raise PermissionDenied


class FencedModelAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    """Admin for a user's :class:`~coordination.fencing.FencedModel`: a write the
    fences refuse is shown as an error message, not a server error.

    An admin edit is a plain ``save()``: it never changes the watermark (rule 8
    of docs/rules.md). The change form carries the row's watermark as the page
    showed it (a hidden field), so a page loaded before a newer write is
    refused (``StaleInstance``) instead of overwriting that write. On a
    ``fence_strict`` model the database refuses every edit (``UnfencedWrite``),
    as it refuses a bulk action that would lower a watermark (``StaleToken``).
    Nothing is saved; the page is shown again, as the row is now, with the
    reason. The list's editable columns save the rows as the POST finds them:
    they are not checked against the page. Subclass it as you would
    ``admin.ModelAdmin``.

    Access rules apply as on the app's own pages: a user limited by rules sees
    the rows whose lock key (``fence_lock``) their rules let them read, and
    changes or deletes only those they may also write with. A value of a unique
    field that a row they may not read holds is refused with 403, not "already
    exists" (a clash with a row they may read is the form's error, as usual).
    """

    def get_queryset(self, request: HttpRequest) -> QuerySet[Any]:
        rows = super().get_queryset(request)
        return _readable(request, rows, fencing.lock_key_expression(self.model))

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return super().has_change_permission(request, obj) and self._writable(request, obj)

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return super().has_delete_permission(request, obj) and self._writable(request, obj)

    def _writable(self, request: HttpRequest, obj: Any) -> bool:
        return obj is None or access.for_request(request).allows("write", fencing.lock_key_of(obj))

    def get_fieldsets(self, request: HttpRequest, obj: Any = None) -> Any:
        fieldsets = super().get_fieldsets(request, obj)
        # Only a form that can be saved carries it (a view-only page shows fields
        # read-only, and this one has nothing to show).
        if (
            obj is None or WATERMARK_FIELD in flatten_fieldsets(fieldsets)
            or not self.has_change_permission(request, obj)
        ):
            return fieldsets
        return [*fieldsets, (None, {"fields": [WATERMARK_FIELD]})]

    def get_form(
        self, request: HttpRequest, obj: Any = None, change: bool = False, **kwargs: Any
    ) -> Any:
        # The model form is made without the hidden field (it is no model field),
        # which is then added to it for a change of an existing row.
        if kwargs.get("fields"):
            kwargs["fields"] = [name for name in kwargs["fields"] if name != WATERMARK_FIELD]
        form = super().get_form(request, obj, change=change, **kwargs)
        readable = self.get_queryset(request) if access.for_request(request).limited else None
        bases = (_UniqueWithinRules, form) if obj is None else (_CarriedWatermark, _UniqueWithinRules, form)
        return type(form.__name__, bases, {"readable": readable})

    def save_model(self, request: HttpRequest, obj: Any, form: Any, change: bool) -> None:
        carried = form.cleaned_data.get(WATERMARK_FIELD) if change else None
        if carried is not None:
            obj.fence, obj.fence_step = carried
        super().save_model(request, obj, form, change)

    def changeform_view(
        self, request: HttpRequest, object_id: str | None = None, form_url: str = "",
        extra_context: dict[str, Any] | None = None,
    ) -> HttpResponse:
        try:
            return super().changeform_view(request, object_id, form_url, extra_context)
        except (StaleInstance, UnfencedWrite, StaleToken) as refused:
            return self._refused(request, refused)

    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        # list_editable and actions save from here.
        try:
            return super().changelist_view(request, extra_context)
        except (StaleInstance, UnfencedWrite, StaleToken) as refused:
            return self._refused(request, refused)

    def _refused(
        self, request: HttpRequest, refused: StaleInstance | UnfencedWrite | StaleToken
    ) -> HttpResponse:
        # Raised out of the view's atomic block: the transaction was rolled back.
        if isinstance(refused, StaleInstance):
            detail = (
                f"{refused.resource} was changed by a newer write since this page was loaded "
                f"(its watermark is now {refused.current_token}, {refused.current_step}). "
                "The page now shows the row as it is: make the change again."
            )
        else:
            detail = refused.detail
        self.message_user(request, f"Not saved: {detail}", messages.ERROR)
        return HttpResponseRedirect(request.get_full_path())


class OperatorActionsMixin:
    """Guarded actions: 403 for a user without their permission, even on a forged POST.

    Django would only say "no action selected" for an action the user may not
    run; an operator action refused must be visible as refused.
    """

    guarded_actions: Sequence[str] = ()

    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        action = request.POST.get("action", "") if request.method == "POST" else ""
        model_admin = cast(admin.ModelAdmin, self)  # type: ignore[type-arg]
        if action in self.guarded_actions and action not in model_admin.get_actions(request):
            raise PermissionDenied
        return super().changelist_view(request, extra_context)  # type: ignore[misc, no-any-return]


def _object_or_404(model_admin: admin.ModelAdmin, request: HttpRequest, object_id: str) -> Model:  # type: ignore[type-arg]
    """The row an operator page names by its URL, or 404.

    ``get_object`` turns an id the primary key cannot hold (``abc`` for an
    integer key) into None, as the admin's own change page does; a plain
    ``get_object_or_404(pk=...)`` would raise ``ValueError``: a server error.
    """
    found = model_admin.get_object(request, unquote(object_id))
    if found is None:
        raise Http404(f"No {model_admin.opts.verbose_name} with id {object_id!r}.")
    return cast(Model, found)


def _has_perm(request: HttpRequest, codename: str) -> bool:
    return request.user.has_perm(f"coordination.{codename}")


def _readable(request: HttpRequest, rows: QuerySet[Any], key: str | Expression) -> QuerySet[Any]:
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


def _require_rules(request: HttpRequest, action: str, keys: Sequence[str]) -> None:
    """403 unless the user's access rules allow ``action`` on every one of ``keys``."""
    rules = access.for_request(request)
    if not all(rules.allows(action, key) for key in keys):
        raise PermissionDenied


def _page_context(
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


def _confirmation(
    request: HttpRequest,
    model_admin: admin.ModelAdmin,  # type: ignore[type-arg]
    *,
    title: str,
    explanation: str,
    button: str,
    objects: Sequence[Any],
    rows: Sequence[Sequence[Any]],
    headers: Sequence[str],
    action: str | None,
    hidden: Sequence[tuple[str, str]] = (),
) -> TemplateResponse:
    """The page between choosing an operator action and running it; ``hidden`` are
    form fields sent again with the confirmation."""
    context = {
        **_page_context(request, model_admin, title, changelist=True),
        "explanation": explanation,
        "button": button,
        "objects": objects,
        "rows": rows,
        "headers": headers,
        "action": action,
        "action_checkbox_name": ACTION_CHECKBOX_NAME,
        "hidden": hidden,
    }
    return TemplateResponse(request, "coordination/admin/confirm_action.html", context)


# --- locks --------------------------------------------------------------------


class LockStateFilter(admin.SimpleListFilter):
    title = _("state")
    parameter_name = "state"

    def lookups(
        self, request: HttpRequest, model_admin: admin.ModelAdmin  # type: ignore[type-arg]
    ) -> list[tuple[str, str]]:
        return [(str(value), str(label)) for value, label in LockState.choices]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any] | None:
        rows = cast(LockQuerySet, queryset)
        value = self.value()
        if value == LockState.HELD:
            return rows.held()
        if value == LockState.EXPIRED:
            return rows.expired()
        if value == LockState.FREE:
            return rows.free()
        return None


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
        return _readable(request, rows, "key")

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
        return _has_perm(request, "revoke_lock")

    @admin.display(description=_("state"), ordering="state")
    def state_badge(self, lock: Lock) -> str:
        state = LockState(getattr(lock, "state", None) or self._state_now(lock))
        return format_html(
            '<span class="coordination-badge coordination-{}" data-state="{}">{}</span>',
            state.value, state.value, state.label,
        )

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
            return str(_("expired %(seconds)s ago") % {"seconds": _duration(-seconds)})
        return _duration(seconds)

    @admin.display(description=_("grants"), ordering="grants_total")
    def grant_count(self, lock: Lock) -> str:
        total = getattr(lock, "grants_total", None)
        if total is None:
            total = lock.grants.count()
        url = reverse("admin:coordination_grant_changelist") + f"?lock__id__exact={lock.pk}"
        return format_html('<a href="{}">{}</a>', url, total)

    def _state_now(self, lock: Lock) -> LockState:
        return lock.state_at(locks.database_now())

    @admin.action(description=_("Revoke the selected locks"), permissions=["revoke"])
    def revoke_selected(
        self, request: HttpRequest, queryset: QuerySet[Lock]
    ) -> TemplateResponse | None:
        chosen = list(queryset.order_by("key"))
        if request.POST.get("confirm") == "yes":
            self._revoke(request, chosen)
            return None
        return self._revoke_confirmation(request, chosen, action="revoke_selected")

    def revoke_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        if not self.has_revoke_permission(request):
            raise PermissionDenied
        lock = cast(Lock, _object_or_404(self, request, object_id))
        if request.method == "POST" and request.POST.get("confirm") == "yes":
            self._revoke(request, [lock])
            return HttpResponseRedirect(reverse("admin:coordination_lock_change", args=[lock.pk]))
        return self._revoke_confirmation(request, [lock], action=None)

    def _revoke_confirmation(
        self, request: HttpRequest, chosen: list[Lock], *, action: str | None
    ) -> TemplateResponse:
        _require_rules(request, "revoke", [lock.key for lock in chosen])
        return _confirmation(
            request, self,
            title=str(_("Revoke locks?")) if len(chosen) > 1 else str(_("Revoke this lock?")),
            explanation=str(_(
                "Revoking ends the current lease at once. The holder's renew and release "
                "fail from now on, and the next acquire gets a higher token, whose first "
                "write fences the revoked holder out. Writes the holder already made stay."
            )),
            button=str(_("Yes, revoke")),
            objects=chosen,
            headers=[str(_("lock")), str(_("state")), str(_("holder")), str(_("last token"))],
            rows=[
                [lock.key, self.state_badge(lock), lock.holder or "-", lock.token]
                for lock in chosen
            ],
            action=action,
        )

    def _revoke(self, request: HttpRequest, chosen: list[Lock]) -> None:
        _require_rules(request, "revoke", [lock.key for lock in chosen])
        revoked = 0
        for lock in chosen:
            grant = locks.revoke(lock.key)
            if grant is None:
                continue
            revoked += 1
            self.log_change(
                request, lock,
                f"Revoked the lease of token {grant.token} held by {grant.holder}; "
                "the next grant gets a higher token.",
            )
        if revoked:
            self.message_user(
                request,
                ngettext(
                    "Revoked %(count)d lock; its next grant gets a higher token.",
                    "Revoked %(count)d locks; their next grants get higher tokens.",
                    revoked,
                ) % {"count": revoked},
                messages.SUCCESS,
            )
        free = len(chosen) - revoked
        if free:
            self.message_user(
                request,
                ngettext(
                    "%(count)d lock was already free; nothing to revoke.",
                    "%(count)d locks were already free; nothing to revoke.",
                    free,
                ) % {"count": free},
                messages.WARNING,
            )

    def changeform_view(
        self,
        request: HttpRequest,
        object_id: str | None = None,
        form_url: str = "",
        extra_context: dict[str, Any] | None = None,
    ) -> HttpResponse:
        extra = {**(extra_context or {}), "can_revoke": self.has_revoke_permission(request)}
        return super().changeform_view(request, object_id, form_url, extra)

    def dashboard_view(self, request: HttpRequest) -> HttpResponse:
        if not self.has_view_permission(request):
            raise PermissionDenied
        keys = [key for key in request.GET.getlist("key") if key][: dashboard.TIMELINE_LOCKS]
        try:
            refresh = max(0, min(int(request.GET.get("refresh", DASHBOARD_REFRESH_SECONDS)), 3600))
        except ValueError:
            refresh = DASHBOARD_REFRESH_SECONDS
        shown = dashboard.Shown(
            grants=_has_perm(request, "view_grant"),
            rejections=_has_perm(request, "view_rejection"),
            accepted_writes=_has_perm(request, "view_acceptedwrite"),
            access=access.for_request(request),
        )
        data = dashboard.build_dashboard(keys, shown=shown)
        context = {
            **_page_context(request, self, str(_("Dashboard")), changelist=False),
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


# --- grants -------------------------------------------------------------------


class GrantEndFilter(admin.SimpleListFilter):
    title = _("end")
    parameter_name = "end"

    def lookups(
        self, request: HttpRequest, model_admin: admin.ModelAdmin  # type: ignore[type-arg]
    ) -> list[tuple[str, str]]:
        return [
            *((str(value), str(label)) for value, label in GrantEnd.choices),
            ("live", str(_("live lease"))),
            ("unreleased", str(_("expired, not released"))),
        ]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any] | None:
        value = self.value()
        if value in GrantEnd.values:
            return queryset.filter(end_reason=value)
        if value == "live":
            return queryset.filter(ended_at=None, expires_at__gt=DatabaseNow())
        if value == "unreleased":
            return queryset.filter(ended_at=None, expires_at__lte=DatabaseNow())
        return None


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
        return cast("QuerySet[Grant]", _readable(request, rows, "lock__key"))

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


# --- fences -------------------------------------------------------------------


@admin.register(Fence)
class FenceAdmin(OperatorActionsMixin, HistoryAdmin):
    list_display = ["resource", "lock_key_link", "watermark", "lock_token", "last_write"]
    search_fields = ["resource", "lock_key"]
    fields = readonly_fields = (
        "resource", "lock_key_link", "token", "step", "lock_token", "last_write",
    )
    actions = ["raise_to_lock_token"]
    guarded_actions = ["raise_to_lock_token"]
    change_form_template = "coordination/admin/fence_change_form.html"

    def get_queryset(self, request: HttpRequest) -> QuerySet[Fence]:
        lock = Lock.objects.filter(key=OuterRef("lock_key"))
        rows = super().get_queryset(request).annotate(
            issued=Coalesce(Subquery(lock.values("token")[:1]), 0),
            lock_pk=Subquery(lock.values("pk")[:1]),
        )
        return cast("QuerySet[Fence]", _readable(request, rows, "lock_key"))

    def get_urls(self) -> list[URLPattern]:
        view = self.admin_site.admin_view
        return [
            path("<path:object_id>/raise/", view(self.raise_view), name="coordination_fence_raise"),
            *super().get_urls(),
        ]

    def has_raise_permission(self, request: HttpRequest) -> bool:
        return _has_perm(request, "raise_fence")

    @admin.display(description=_("watermark (token, step)"), ordering="token")
    def watermark(self, fence: Fence) -> str:
        return f"{fence.token}, {fence.step}"

    @admin.display(description=_("lock's last token"), ordering="issued")
    def lock_token(self, fence: Fence) -> str:
        issued = self._issued(fence)
        if issued > fence.token:
            return format_html(
                '{} <span class="coordination-note" title="{}">({})</span>', issued,
                _("tokens up to this one were issued but have not written here"),
                _("ahead of the watermark"),
            )
        return str(issued)

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

    @staticmethod
    def _issued(fence: Fence) -> int:
        issued = getattr(fence, "issued", None)
        if issued is None:
            issued = Lock.objects.filter(key=fence.lock_key).values_list("token", flat=True).first()
        return int(issued or 0)

    @admin.action(description=_("Raise to the lock's last issued token"), permissions=["raise"])
    def raise_to_lock_token(
        self, request: HttpRequest, queryset: QuerySet[Fence]
    ) -> TemplateResponse | None:
        chosen = list(queryset.order_by("resource"))
        if request.POST.get("confirm") == "yes":
            self._raise(request, chosen)
            return None
        return self._raise_confirmation(request, chosen, action="raise_to_lock_token")

    def raise_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        if not self.has_raise_permission(request):
            raise PermissionDenied
        fence = cast(Fence, _object_or_404(self, request, object_id))
        if request.method == "POST" and request.POST.get("confirm") == "yes":
            self._raise(request, [fence])
            return HttpResponseRedirect(reverse("admin:coordination_fence_change", args=[fence.pk]))
        return self._raise_confirmation(request, [fence], action=None)

    def _raise_confirmation(
        self, request: HttpRequest, chosen: list[Fence], *, action: str | None
    ) -> TemplateResponse:
        _require_rules(request, "revoke", [fence.lock_key for fence in chosen])
        return _confirmation(
            request, self,
            title=str(_("Raise watermarks?")) if len(chosen) > 1 else str(_("Raise this watermark?")),
            explanation=str(_(
                "For after a restore from backup: each watermark is raised to the last "
                "token its lock has issued, so writes of every older token are refused "
                "as stale. The holder of that last token can still write. A watermark is "
                "never lowered."
            )),
            button=str(_("Yes, raise")),
            objects=chosen,
            headers=[str(_("resource")), str(_("lock")), str(_("watermark")),
                     str(_("lock's last token"))],
            rows=[
                [fence.resource, fence.lock_key, self.watermark(fence), self._issued(fence)]
                for fence in chosen
            ],
            action=action,
        )

    def _raise(self, request: HttpRequest, chosen: list[Fence]) -> None:
        _require_rules(request, "revoke", [fence.lock_key for fence in chosen])
        raised = 0
        for fence in chosen:
            result = fencing.raise_fence_to_lock(fence.resource)
            if not result.raised:
                continue
            raised += 1
            self.log_change(
                request, fence,
                f"Raised the watermark from {result.before[0]} (step {result.before[1]}) to "
                f"{result.after[0]} (step {result.after[1]}), the last token of lock "
                f"{result.lock_key}.",
            )
        if raised:
            self.message_user(
                request,
                ngettext(
                    "Raised %(count)d fence to its lock's last token; older tokens are refused.",
                    "Raised %(count)d fences to their locks' last tokens; older tokens are refused.",
                    raised,
                ) % {"count": raised},
                messages.SUCCESS,
            )
        unchanged = len(chosen) - raised
        if unchanged:
            self.message_user(
                request,
                ngettext(
                    "%(count)d fence was already at its lock's last token; left as it is.",
                    "%(count)d fences were already at their locks' last tokens; left as they are.",
                    unchanged,
                ) % {"count": unchanged},
                messages.WARNING,
            )

    def changeform_view(
        self,
        request: HttpRequest,
        object_id: str | None = None,
        form_url: str = "",
        extra_context: dict[str, Any] | None = None,
    ) -> HttpResponse:
        extra = {**(extra_context or {}), "can_raise": self.has_raise_permission(request)}
        return super().changeform_view(request, object_id, form_url, extra)


# --- refused and accepted writes, idempotency, documents ---------------------------


def _timeline_link(key: str) -> str:
    url = reverse("admin:coordination_dashboard") + "?" + urlencode({"key": key})
    return format_html('<a href="{}" title="{}">{}</a>', url, _("timeline of this lock"), key)


@admin.register(Rejection)
class RejectionAdmin(HistoryAdmin):
    list_display = [
        "created_at", "reason", "resource", "lock", "token", "step", "watermark", "holder",
    ]
    list_filter = ["reason"]
    search_fields = ["resource", "lock_key", "holder"]
    date_hierarchy = "created_at"

    def get_queryset(self, request: HttpRequest) -> QuerySet[Rejection]:
        return _readable(request, super().get_queryset(request), "lock_key")

    @admin.display(description=_("lock"), ordering="lock_key")
    def lock(self, rejection: Rejection) -> str:
        return _timeline_link(rejection.lock_key)

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
        return _readable(request, super().get_queryset(request), "lock_key")

    @admin.display(description=_("lock"), ordering="lock_key")
    def lock(self, row: UnfencedSave) -> str:
        return _timeline_link(row.lock_key)

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
        return _readable(request, super().get_queryset(request), "lock_key")

    @admin.display(description=_("lock"), ordering="lock_key")
    def lock(self, write: AcceptedWrite) -> str:
        return _timeline_link(write.lock_key)


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


class RebindForm(forms.Form):
    """The new lock key of a document: a valid key, another one, one the user may write with."""

    lock_key = forms.CharField(
        label=_("New lock key"), max_length=KEY_MAX_LENGTH,
        help_text=_("Grants of this key write the document from now on; grants of the "
                    "current key are refused as wrong_lock."),
    )

    def __init__(self, *args: Any, document: Document, rules: access.Access, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.document, self.rules = document, rules

    def clean_lock_key(self) -> str:
        key = str(self.cleaned_data["lock_key"])
        try:
            validate_key(key, what="lock key")
        except InvalidInput as error:
            raise forms.ValidationError(error.detail, code="invalid") from None
        if key == self.document.fence.lock_key:
            raise forms.ValidationError(_("The document is already bound to this key."), code="same")
        for checked in (self.document.fence.lock_key, key):
            if not self.rules.allows("write", checked):
                raise forms.ValidationError(
                    _("Your access rules do not allow writing with lock key %(key)s."),
                    code="key_forbidden", params={"key": checked},
                )
        # Said here already; rebind_document() decides again under the row lock.
        found = Lock.objects.filter(key=key).values_list("token", "holder").first()
        if found is not None:
            refusal = documents.held_below_watermark(key, *found, self.document.fence.token)
            if refusal:
                raise forms.ValidationError(refusal, code="held")
        return key


@admin.register(Document)
class DocumentAdmin(HistoryAdmin):
    list_display = ["name", "lock", "watermark", "updated_at"]
    list_select_related = ["fence"]
    search_fields = ["name", "fence__lock_key"]
    fields = readonly_fields = ("name", "lock", "watermark", "data", "updated_at")
    change_form_template = "coordination/admin/document_change_form.html"

    def get_queryset(self, request: HttpRequest) -> QuerySet[Document]:
        return _readable(request, super().get_queryset(request), "fence__lock_key")

    def get_urls(self) -> list[URLPattern]:
        view = self.admin_site.admin_view
        return [
            path("<path:object_id>/rebind/", view(self.rebind_view),
                 name="coordination_document_rebind"),
            *super().get_urls(),
        ]

    def has_rebind_permission(self, request: HttpRequest) -> bool:
        return _has_perm(request, "rebind_document")

    @admin.display(description=_("lock"), ordering="fence__lock_key")
    def lock(self, document: Document) -> str:
        return _timeline_link(document.fence.lock_key)

    @admin.display(description=_("watermark (token, step)"))
    def watermark(self, document: Document) -> str:
        return f"{document.fence.token}, {document.fence.step}"

    def rebind_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        """Re-bind: a form for the new key, a confirmation page, then the change and its log entry."""
        if not self.has_rebind_permission(request):
            raise PermissionDenied
        # get_object() answers None for a pk that is not a number, too.
        document = self.get_object(request, object_id)
        if document is None:
            raise Http404(_("No such document."))
        rules = access.for_request(request)
        form = RebindForm(request.POST or None, document=document, rules=rules)
        if request.method == "POST" and form.is_valid():
            key = form.cleaned_data["lock_key"]
            if request.POST.get("confirm") != "yes":
                return self._rebind_confirmation(request, document, key)
            try:
                result = documents.rebind_document(document.name, key)
            except InvalidInput as error:  # re-bound meanwhile by someone else
                form.add_error("lock_key", error.detail)
            else:
                self.log_change(request, document, _rebind_message(result))
                self.message_user(request, _rebind_message(result), messages.SUCCESS)
                return HttpResponseRedirect(
                    reverse("admin:coordination_document_change", args=[document.pk])
                )
        context = {
            **_page_context(request, self, str(_("Re-bind this document?")), changelist=True),
            "document": document,
            "form": form,
        }
        return TemplateResponse(request, "coordination/admin/rebind_document.html", context)

    def _rebind_confirmation(
        self, request: HttpRequest, document: Document, key: str
    ) -> TemplateResponse:
        fence = document.fence
        counter = Lock.objects.filter(key=key).values_list("token", flat=True).first() or 0
        return _confirmation(
            request, self,
            title=str(_("Re-bind this document?")),
            explanation=str(_(
                "From now on only grants of %(new)s write this document; grants of %(old)s are "
                "refused as wrong_lock. Its watermark stays at token %(token)s: the token "
                "counter of %(new)s is raised to at least %(token)s, so its next grant can "
                "write, and its grants issued before now are refused as stale. Neither the "
                "watermark nor any counter goes down."
            ) % {"new": key, "old": fence.lock_key, "token": fence.token}),
            button=str(_("Yes, re-bind")),
            objects=[document],
            headers=[str(_("document")), str(_("lock now")), str(_("new lock")),
                     str(_("watermark")), str(_("new lock's counter"))],
            rows=[[document.name, fence.lock_key, key, self.watermark(document),
                   f"{counter} \u2192 {max(counter, fence.token)}"]],
            action=None,
            hidden=[("lock_key", key)],
        )

    def changeform_view(
        self,
        request: HttpRequest,
        object_id: str | None = None,
        form_url: str = "",
        extra_context: dict[str, Any] | None = None,
    ) -> HttpResponse:
        extra = {**(extra_context or {}), "can_rebind": self.has_rebind_permission(request)}
        return super().changeform_view(request, object_id, form_url, extra)


def _rules_in_force() -> str:
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


def _rebind_message(result: documents.Rebind) -> str:
    counter = (
        f"; the counter of {result.after} was raised from {result.counter_before} to "
        f"{result.counter_after}" if result.counter_raised else ""
    )
    return (
        f"Re-bound from lock {result.before} to lock {result.after}; the watermark stays at "
        f"token {result.watermark[0]} (step {result.watermark[1]}){counter}."
    )


# --- access rules -------------------------------------------------------------------


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
        context = {"subtitle": _rules_in_force(), **(extra_context or {})}
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


# --- leader election and beat ---------------------------------------------------


@admin.register(Role)
class RoleAdmin(HistoryAdmin):
    """The roles of :mod:`coordination.election`: who leads now, since when, in which
    term; the role's Grant rows are its history of terms."""

    list_display = ["role", "leader", "term", "since", "lease_left", "terms_link"]
    search_fields = ["key", "holder"]
    fields = readonly_fields = ("role", "leader", "term", "since", "lease_left", "terms_link")

    def get_queryset(self, request: HttpRequest) -> QuerySet[Role]:
        rows = super().get_queryset(request).filter(key__startswith="election:")
        return cast("QuerySet[Role]", _readable(request, rows.annotate(db_now=DatabaseNow()), "key"))

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
        return _duration((role.expires_at - now).total_seconds())

    @admin.display(description=_("history of terms"))
    def terms_link(self, role: Role) -> str:
        url = reverse("admin:coordination_grant_changelist") + "?" + urlencode({"lock__id__exact": role.pk})
        return format_html('<a href="{}">{}</a>', url, _("terms"))


class BeatSlotStateFilter(admin.SimpleListFilter):
    title = _("state")
    parameter_name = "state"

    def lookups(
        self, request: HttpRequest, model_admin: admin.ModelAdmin  # type: ignore[type-arg]
    ) -> list[tuple[str, str]]:
        return [
            ("sent", str(_("sent"))),
            ("claimed", str(_("claimed, not sent yet (its term still leads)"))),
            ("lost", str(_("lost: claimed, never sent, its term is over"))),
        ]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any] | None:
        rows = cast("QuerySet[BeatSlot]", queryset)
        value = self.value()
        if value == "sent":
            return rows.filter(sent_at__isnull=False)
        if value == "lost":
            return rows.filter(pk__in=BeatSlot.objects.lost().values("pk"))
        if value == "claimed":
            return rows.filter(sent_at__isnull=True).exclude(pk__in=BeatSlot.objects.lost().values("pk"))
        return None


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
        return cast("QuerySet[BeatSlot]", _readable(request, rows, role_key))

    @admin.display(description=_("state"))
    def state(self, slot: BeatSlot) -> str:
        if slot.sent_at is not None:
            kind, label = "released", _("sent")
        elif getattr(slot, "lost_pk", None) is not None:
            kind, label = "revoked", _("lost")
        else:
            kind, label = "live", _("claimed")
        return format_html('<span class="coordination-badge coordination-{}">{}</span>', kind, label)


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f} s"
    return str(dt.timedelta(seconds=round(seconds)))



# --- job policies ----------------------------------------------------------------


class JobPolicyForm(forms.ModelForm):  # type: ignore[type-arg]
    """A policy's fields; :attr:`rules` are the editing user's access rules."""

    rules: access.Access | None = None

    class Meta:
        model = JobPolicy
        fields = ["task", "paused", "when_paused", "defer_seconds", "max_running", "ttl", "on_busy", "note"]

    def clean_task(self) -> str:
        task = str(self.cleaned_data.get("task", ""))
        # Before the unique check: "already exists" would tell a user limited by
        # access rules that a task they may not see has a policy. A name they may
        # not steer is refused as a new one would be, whether or not it is taken.
        if self.rules is not None and not self.rules.allows("revoke", jobs.permit_name(task)):
            raise PermissionDenied
        return task

    def clean_ttl(self) -> float | None:
        ttl = self.cleaned_data.get("ttl")
        if ttl is not None and not float(app_settings.MIN_TTL) <= ttl <= float(app_settings.MAX_TTL):
            raise forms.ValidationError(
                _("ttl must be from %(low)s to %(high)s seconds (COORDINATION MIN_TTL and MAX_TTL).")
                % {"low": app_settings.MIN_TTL, "high": app_settings.MAX_TTL}
            )
        return ttl


@admin.register(JobPolicy)
class JobPolicyAdmin(OperatorActionsMixin, admin.ModelAdmin):  # type: ignore[type-arg]
    """How each fenced task runs, changed at run time: paused, capped, its lease.

    A policy is the lock key ``task:<task>`` to the access rules: a limited
    user sees the policies their rules let them read and changes, pauses or
    resumes those they may ``revoke`` on. Every change is recorded (who, when,
    before and after) and listed on the policy's page. The jobs page
    (``jobs/``) shows each fenced task with its running executions and
    pause and resume buttons.
    """

    form = JobPolicyForm
    list_display = [
        "task", "paused", "when_paused", "max_running", "ttl", "on_busy", "running_now", "updated_at",
    ]
    list_filter = ["paused", "when_paused"]
    search_fields = ["task", "note"]
    actions = ["pause_selected", "resume_selected", "pause_and_revoke_selected"]
    guarded_actions = ["pause_selected", "resume_selected", "pause_and_revoke_selected"]
    change_form_template = "coordination/admin/jobpolicy_change_form.html"
    change_list_template = "coordination/admin/jobpolicy_change_list.html"

    class Media:
        css = {"all": ("coordination/admin.css",)}

    def get_queryset(self, request: HttpRequest) -> QuerySet[JobPolicy]:
        rows = super().get_queryset(request)
        return _readable(request, rows, Concat(Value("task:"), "task", output_field=CharField()))

    def get_urls(self) -> list[URLPattern]:
        view = self.admin_site.admin_view
        return [
            path("jobs/", view(self.jobs_view), name="coordination_jobs"),
            path("jobs/steer/", view(self.steer_view), name="coordination_jobs_steer"),
            *super().get_urls(),
        ]

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return super().has_change_permission(request, obj) and self._steerable(request, obj)

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return super().has_delete_permission(request, obj) and self._steerable(request, obj)

    def get_form(
        self, request: HttpRequest, obj: Any = None, change: bool = False, **kwargs: Any
    ) -> type[forms.ModelForm]:  # type: ignore[type-arg]
        form = super().get_form(request, obj, change, **kwargs)
        return type(form.__name__, (form,), {"rules": access.for_request(request)})

    def has_pause_permission(self, request: HttpRequest) -> bool:
        return _has_perm(request, "pause_jobpolicy")

    def _steerable(self, request: HttpRequest, obj: JobPolicy | None) -> bool:
        return obj is None or access.for_request(request).allows("revoke", obj.access_key)

    def save_model(self, request: HttpRequest, obj: JobPolicy, form: Any, change: bool) -> None:
        # A new policy (or a renamed one) names a task the rules must let the user steer.
        _require_rules(request, "revoke", [obj.access_key])
        obj.save(changed_by=request.user.get_username(), via="admin")

    def delete_model(self, request: HttpRequest, obj: JobPolicy) -> None:
        obj.delete(changed_by=request.user.get_username(), via="admin")

    def delete_queryset(self, request: HttpRequest, queryset: QuerySet[JobPolicy]) -> None:
        for policy in queryset:
            self.delete_model(request, policy)

    @admin.display(description=_("running now"))
    def running_now(self, policy: JobPolicy) -> int:
        if policy.task.endswith("*"):
            return sum(1 for run in jobs.running() if run.task.startswith(policy.task[:-1]))
        return len(jobs.running(policy.task))

    def changeform_view(
        self, request: HttpRequest, object_id: str | None = None, form_url: str = "",
        extra_context: dict[str, Any] | None = None,
    ) -> HttpResponse:
        extra = dict(extra_context or {})
        if object_id is not None:
            policy = self.get_object(request, unquote(object_id))
            if policy is not None:
                rules = access.for_request(request)
                extra["policy_changes"] = list(policy.changes.order_by("-changed_at", "-id")[:100])
                extra["policy_running"] = [
                    run for run in (
                        jobs.running() if policy.task.endswith("*") else jobs.running(policy.task)
                    )
                    if run.task.startswith(policy.task.removesuffix("*"))
                    and rules.allows("read", run.key)
                ]
                extra["can_pause"] = self.has_pause_permission(request) and self._steerable(
                    request, policy
                )
        return super().changeform_view(request, object_id, form_url, extra)

    # --- pause and resume ---

    def _steer(self, request: HttpRequest, tasks: Sequence[str], how: str) -> None:
        """Pause (``pause``, ``pause_and_revoke``) or resume ``tasks``: each needs the
        permission and ``revoke`` on its ``task:<name>``; revoking a running
        execution also needs ``revoke`` on its own key (others stay running)."""
        if not self.has_pause_permission(request):
            raise PermissionDenied
        _require_rules(request, "revoke", [jobs.permit_name(task) for task in tasks])
        rules = access.for_request(request)
        by = request.user.get_username()
        revoked = 0
        for task in tasks:
            if how == "resume":
                policy = jobs.resume(task, by=by, via="admin")
            else:
                policy, ended = jobs.pause(
                    task, by=by, via="admin", revoke_running=how == "pause_and_revoke",
                    may_revoke=lambda key: rules.allows("revoke", key),
                )
                revoked += len(ended)
            if policy is not None:
                self.log_change(request, policy, f"{how.replace('_', ' ')} by {by}")
        verb = {"pause": _("Paused"), "pause_and_revoke": _("Paused"), "resume": _("Resumed")}[how]
        self.message_user(
            request,
            ngettext("%(verb)s %(count)d task.", "%(verb)s %(count)d tasks.", len(tasks))
            % {"verb": verb, "count": len(tasks)},
            messages.SUCCESS,
        )
        if how == "pause_and_revoke":
            self.message_user(
                request,
                ngettext(
                    "Revoked %(count)d lease of running executions; their later fenced writes are refused.",
                    "Revoked %(count)d leases of running executions; their later fenced writes are refused.",
                    revoked,
                ) % {"count": revoked},
                messages.WARNING if revoked else messages.INFO,
            )

    @admin.action(description=_("Pause the selected tasks"), permissions=["pause"])
    def pause_selected(self, request: HttpRequest, queryset: QuerySet[JobPolicy]) -> None:
        self._steer(request, [policy.task for policy in queryset], "pause")

    @admin.action(description=_("Resume the selected tasks"), permissions=["pause"])
    def resume_selected(self, request: HttpRequest, queryset: QuerySet[JobPolicy]) -> None:
        self._steer(request, [policy.task for policy in queryset], "resume")

    @admin.action(
        description=_("Pause the selected tasks and revoke their running executions"),
        permissions=["pause"],
    )
    def pause_and_revoke_selected(
        self, request: HttpRequest, queryset: QuerySet[JobPolicy]
    ) -> TemplateResponse | None:
        chosen = list(queryset.order_by("task"))
        if request.POST.get("confirm") == "yes":
            self._steer(request, [policy.task for policy in chosen], "pause_and_revoke")
            return None
        _require_rules(request, "revoke", [policy.access_key for policy in chosen])
        return _confirmation(
            request, self,
            title=str(_("Pause and revoke running executions?")),
            explanation=str(_(
                "New executions of these tasks stop running their bodies (deferred or skipped, "
                "as each policy says). The leases of the executions running now are revoked: "
                "their keep-alives find the lease lost and their later fenced writes are "
                "refused; the next grant of each key fences them out. Work they already "
                "wrote stays."
            )),
            button=str(_("Yes, pause and revoke")),
            objects=chosen,
            headers=[str(_("task")), str(_("paused")), str(_("running now"))],
            rows=[[policy.task, policy.paused, self.running_now(policy)] for policy in chosen],
            action="pause_and_revoke_selected",
        )

    def steer_view(self, request: HttpRequest) -> HttpResponse:
        """The jobs page's buttons: POST ``task`` and ``how`` (pause, resume,
        pause_and_revoke); back to the jobs page."""
        back = reverse("admin:coordination_jobs")
        if request.method != "POST":
            return HttpResponseRedirect(back)
        task, how = request.POST.get("task", ""), request.POST.get("how", "")
        if how not in ("pause", "resume", "pause_and_revoke"):
            raise PermissionDenied
        try:
            validate_task_pattern(task)
        except InvalidInput as error:
            self.message_user(request, error.detail, messages.ERROR)
            return HttpResponseRedirect(back)
        self._steer(request, [task], how)
        return HttpResponseRedirect(back)

    def jobs_view(self, request: HttpRequest) -> HttpResponse:
        if not self.has_view_permission(request):
            raise PermissionDenied
        rules = access.for_request(request)
        shown = dashboard.Shown(
            grants=_has_perm(request, "view_grant"),
            rejections=_has_perm(request, "view_rejection"),
            accepted_writes=False,
            access=rules,
        )
        can_pause = self.has_pause_permission(request)
        data = dashboard.build_jobs(
            shown=shown,
            may_steer=lambda task: can_pause and rules.allows("revoke", jobs.permit_name(task)),
        )
        try:
            refresh = max(0, min(int(request.GET.get("refresh", DASHBOARD_REFRESH_SECONDS)), 3600))
        except ValueError:
            refresh = DASHBOARD_REFRESH_SECONDS
        context = {
            **_page_context(request, self, str(_("Jobs")), changelist=True),
            "title": _("Fenced tasks"),
            "jobs": data,
            "refresh": refresh,
            "show_grants": shown.grants,
            "policy_refresh": app_settings.JOB_POLICY_REFRESH,
        }
        return TemplateResponse(request, "coordination/admin/jobs.html", context)


# --- API tokens ------------------------------------------------------------------------


def _replace_token_admin(site: admin.AdminSite) -> None:
    """Put :class:`TokenAdmin` in place of DRF's own token admin on ``site``.

    DRF's shows every token key in full to anyone with ``view_tokenproxy``, one
    of "all view permissions", and a key is a password: whoever reads it acts as
    its user. Its admin module is imported first here, so the replacement holds
    whatever the order of ``INSTALLED_APPS``.
    """
    import rest_framework.authtoken.admin as stock
    from rest_framework.authtoken.models import TokenProxy

    class TokenAdmin(stock.TokenAdmin):
        """Who has an API token, since when: a list without keys, nothing more.

        Keys are masked (their first four characters, enough to tell tokens
        apart in a conversation), and users other than superusers see only
        their own token, whatever their permissions on tokens. No page shows
        one token: Django's change, history and delete pages, and the admin log
        a deletion writes, name a token by its key. Tokens are created, rotated
        and revoked with ``manage.py drf_create_token`` (docs/security.md).
        """

        list_display = ("masked_key", "user", "created")
        list_display_links = None

        def get_queryset(self, request: HttpRequest) -> QuerySet[Any]:
            rows = super().get_queryset(request)
            user = request.user
            return rows if user.is_superuser else rows.filter(user_id=user.pk)

        def has_view_permission(self, request: HttpRequest, obj: Any = None) -> bool:
            return obj is None and super().has_view_permission(request)

        def has_add_permission(self, request: HttpRequest) -> bool:
            return False

        def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
            return False

        def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
            return False

        @admin.display(description=_("key"))
        def masked_key(self, token: Any) -> str:
            return f"{token.key[:4]}\u2026"

    if site.is_registered(TokenProxy):
        site.unregister(TokenProxy)
    site.register(TokenProxy, TokenAdmin)


if django_apps.is_installed("rest_framework.authtoken"):
    _replace_token_admin(admin.site)
