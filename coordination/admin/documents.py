"""Documents, with the re-bind action: a form for the new key, a confirmation, the change."""

from __future__ import annotations

from typing import Any, cast

from django import forms
from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse
from django.utils.translation import gettext_lazy as _

from .. import access, documents
from ..exceptions import InvalidInput
from ..models import KEY_MAX_LENGTH, Document, Lock, validate_key
from .actions import Done, OperatorAction, OperatorActionsMixin, operate
from .base import HistoryAdmin, has_perm, object_or_404, page_context, readable, timeline_link


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


def watermark(document: Document) -> str:
    return f"{document.fence.token}, {document.fence.step}"


def rebind_message(result: documents.Rebind) -> str:
    counter = (
        f"; the counter of {result.after} was raised from {result.counter_before} to "
        f"{result.counter_after}" if result.counter_raised else ""
    )
    return (
        f"Re-bound from lock {result.before} to lock {result.after}; the watermark stays at "
        f"token {result.watermark[0]} (step {result.watermark[1]}){counter}."
    )


def rebind_action(document: Document, key: str) -> OperatorAction[Document]:
    """Re-binding ``document`` to lock ``key``: the user's rules must let them write
    with both keys (the form said so already)."""
    fence = document.fence
    counter = Lock.objects.filter(key=key).values_list("token", flat=True).first() or 0

    def run(request: HttpRequest, document: Document) -> Done:
        result = documents.rebind_document(document.name, key)
        return Done(document, rebind_message(result))

    title = _("Re-bind this document?")
    return OperatorAction(
        permission="rebind_document",
        rule="write",
        keys=lambda document: [document.fence.lock_key, key],
        run=run,
        report=lambda chosen, results: [(done.entry, messages.SUCCESS) for done in results if done],
        title=(title, title),
        explanation=_(
            "From now on only grants of %(new)s write this document; grants of %(old)s are "
            "refused as wrong_lock. Its watermark stays at token %(token)s: the token "
            "counter of %(new)s is raised to at least %(token)s, so its next grant can "
            "write, and its grants issued before now are refused as stale. Neither the "
            "watermark nor any counter goes down."
        ) % {"new": key, "old": fence.lock_key, "token": fence.token},
        button=_("Yes, re-bind"),
        headers=[_("document"), _("lock now"), _("new lock"), _("watermark"),
                 _("new lock's counter")],
        row=lambda document: [document.name, fence.lock_key, key, watermark(document),
                              f"{counter} \u2192 {max(counter, fence.token)}"],
    )


@admin.register(Document)
class DocumentAdmin(OperatorActionsMixin, HistoryAdmin):
    list_display = ["name", "lock", "watermark", "updated_at"]
    list_select_related = ["fence"]
    search_fields = ["name", "fence__lock_key"]
    fields = readonly_fields = ("name", "lock", "watermark", "data", "updated_at")
    object_actions = {"can_rebind": "rebind_document"}
    change_form_template = "coordination/admin/document_change_form.html"

    def get_queryset(self, request: HttpRequest) -> QuerySet[Document]:
        return readable(request, super().get_queryset(request), "fence__lock_key")

    def get_urls(self) -> list[URLPattern]:
        view = self.admin_site.admin_view
        return [
            path("<path:object_id>/rebind/", view(self.rebind_view),
                 name="coordination_document_rebind"),
            *super().get_urls(),
        ]

    def has_rebind_permission(self, request: HttpRequest) -> bool:
        return has_perm(request, "rebind_document")

    @admin.display(description=_("lock"), ordering="fence__lock_key")
    def lock(self, document: Document) -> str:
        return timeline_link(document.fence.lock_key)

    @admin.display(description=_("watermark (token, step)"))
    def watermark(self, document: Document) -> str:
        return watermark(document)

    def rebind_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        """Re-bind: a form for the new key, a confirmation page, then the change and its log entry."""
        if not self.has_rebind_permission(request):
            raise PermissionDenied
        document = cast(Document, object_or_404(self, request, object_id))
        form = RebindForm(request.POST or None, document=document, rules=access.for_request(request))
        if request.method == "POST" and form.is_valid():
            key = form.cleaned_data["lock_key"]
            confirmed = request.POST.get("confirm") == "yes"
            try:
                asked = operate(self, request, rebind_action(document, key), [document],
                                confirmed=confirmed, hidden=[("lock_key", key)])
            except InvalidInput as error:  # re-bound meanwhile by someone else
                form.add_error("lock_key", error.detail)
            else:
                return asked or HttpResponseRedirect(
                    reverse("admin:coordination_document_change", args=[document.pk])
                )
        context = {
            **page_context(request, self, str(_("Re-bind this document?")), changelist=True),
            "document": document,
            "form": form,
        }
        return TemplateResponse(request, "coordination/admin/rebind_document.html", context)
