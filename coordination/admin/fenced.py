"""The admin for users' fenced models: a refused write is a message, not a server error."""

from __future__ import annotations

from typing import Any

from django import forms
from django.contrib import admin, messages
from django.contrib.admin.utils import flatten_fieldsets
from django.core.exceptions import PermissionDenied
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.utils.translation import gettext_lazy as _

from .. import access, fencing
from ..exceptions import StaleInstance, StaleToken, UnfencedWrite
from .base import readable

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
        return readable(request, rows, fencing.lock_key_expression(self.model))

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return super().has_change_permission(request, obj) and self._writable(request, obj)

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return super().has_delete_permission(request, obj) and self._writable(request, obj)

    def _writable(self, request: HttpRequest, obj: Any) -> bool:
        return obj is None or access.for_request(request).allows("write", fencing.lock_key_of(obj))

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> Any:
        # The watermark is shown, never edited: a save writes the form's fields only.
        own = list(super().get_readonly_fields(request, obj))
        return [*own, *(name for name in ("fence", "fence_step") if name not in own)]

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
