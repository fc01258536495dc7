"""The operator actions: confirm, check the access rules, act, log, tell the user.

Every action that changes state on an operator's word (revoke a lock, raise a
fence, re-bind a document, pause or resume tasks) is an :class:`OperatorAction`
run by :func:`operate`, from the list's action menu
(:meth:`OperatorActionsMixin.act_on_selected`) or from a button on one row's
page (:meth:`OperatorActionsMixin.act_on_object`). Each step is written here
once: the model permission (403 without it, even on a forged POST), the
confirmation page, the ``rule`` of the user's access rules on every key
concerned (403 unless all allow it), an admin log entry per row changed and
the messages to the user.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, NamedTuple, TypeVar, cast

from django.contrib import admin, messages
from django.contrib.admin.helpers import ACTION_CHECKBOX_NAME
from django.core.exceptions import PermissionDenied
from django.db.models import Model
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import reverse
from django.utils.functional import Promise

from .base import has_perm, object_or_404, page_context, require_rules

T = TypeVar("T")
Text = str | Promise  # a str or a lazy translation


class Done(NamedTuple):
    """What running an action on one row did: the row its admin log entry goes
    on (None: none is written) and the entry; ``ended`` counts what it ended on
    the way (leases of running executions)."""

    logged: Model | None
    entry: str
    ended: int = 0


# The messages after an action: (text, level) pairs.
Report = Callable[[Sequence[Any], Sequence["Done | None"]], Iterable[tuple[str, int]]]


def counted(done: Any, untouched: Any) -> Report:
    """The usual report: how many rows were changed (success), how many were left
    as they were (warning); ``done`` and ``untouched`` are
    ``ngettext_lazy(singular, plural, "count")`` messages."""

    def report(chosen: Sequence[Any], results: Sequence[Done | None]) -> Iterable[tuple[str, int]]:
        changed = sum(1 for result in results if result is not None)
        for message, count, level in (
            (done, changed, messages.SUCCESS), (untouched, len(chosen) - changed, messages.WARNING),
        ):
            if count:
                yield str(message % {"count": count}), level

    return report


@dataclass(frozen=True)
class OperatorAction(Generic[T]):
    """One operator action, run by :func:`operate`.

    ``permission`` is the model permission's codename; ``rule`` the action of the
    access rules that ``keys`` (the lock keys a row concerns) must all allow.
    ``run`` acts on one row and says what it did, None for nothing; ``report``
    turns the results into messages. ``title`` (for one row, for several),
    ``explanation``, ``button``, ``headers`` and ``row`` make the confirmation
    page; an action with ``confirm`` False runs at once.
    """

    permission: str
    keys: Callable[[T], Sequence[str]]
    run: Callable[[HttpRequest, T], Done | None]
    report: Report
    rule: str = "revoke"
    confirm: bool = True
    title: tuple[Text, Text] = ("", "")
    explanation: Text = ""
    button: Text = ""
    headers: Sequence[Text] = ()
    row: Callable[[T], Sequence[Any]] = lambda obj: ()


def operate(
    model_admin: admin.ModelAdmin,  # type: ignore[type-arg]
    request: HttpRequest,
    action: OperatorAction[T],
    chosen: Sequence[T],
    *,
    confirmed: bool,
    menu_action: str | None = None,
    hidden: Sequence[tuple[str, str]] = (),
) -> TemplateResponse | None:
    """Run ``action`` on ``chosen`` once ``confirmed`` (or at once if it asks for no
    confirmation): None when it ran, else the confirmation page, whose form
    posts the list's ``menu_action`` (None: back to the same URL) and ``hidden``
    fields again."""
    if not has_perm(request, action.permission):
        raise PermissionDenied
    require_rules(request, action.rule, [key for obj in chosen for key in action.keys(obj)])
    if action.confirm and not confirmed:
        title = action.title[0] if len(chosen) == 1 else action.title[1]
        context = {
            **page_context(request, model_admin, str(title), changelist=True),
            "explanation": str(action.explanation),
            "button": str(action.button),
            "objects": chosen,
            "rows": [action.row(obj) for obj in chosen],
            "headers": [str(header) for header in action.headers],
            "action": menu_action,
            "action_checkbox_name": ACTION_CHECKBOX_NAME,
            "hidden": hidden,
        }
        return TemplateResponse(request, "coordination/admin/confirm_action.html", context)
    results = [action.run(request, obj) for obj in chosen]
    for result in results:
        if result is not None and result.logged is not None:
            model_admin.log_change(request, result.logged, result.entry)
    for text, level in action.report(chosen, results):
        model_admin.message_user(request, text, level)
    return None


class OperatorActionsMixin:
    """An admin with operator actions.

    Guarded actions: 403 for a user without their permission, even on a forged
    POST. Django would only say "no action selected" for an action the user
    may not run; an operator action refused must be visible as refused.

    ``object_actions`` maps a change form's flag to the codename it needs
    (``{"can_revoke": "revoke_lock"}``): the template shows the button if so.
    """

    guarded_actions: Sequence[str] = ()
    object_actions: dict[str, str] = {}

    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        action = request.POST.get("action", "") if request.method == "POST" else ""
        model_admin = cast(admin.ModelAdmin, self)  # type: ignore[type-arg]
        if action in self.guarded_actions and action not in model_admin.get_actions(request):
            raise PermissionDenied
        return super().changelist_view(request, extra_context)  # type: ignore[misc, no-any-return]

    def changeform_view(
        self,
        request: HttpRequest,
        object_id: str | None = None,
        form_url: str = "",
        extra_context: dict[str, Any] | None = None,
    ) -> HttpResponse:
        flags = {flag: has_perm(request, codename) for flag, codename in self.object_actions.items()}
        extra = {**(extra_context or {}), **flags}
        return super().changeform_view(request, object_id, form_url, extra)  # type: ignore[misc, no-any-return]

    def act_on_selected(
        self, request: HttpRequest, action: OperatorAction[T], chosen: Sequence[T], menu_action: str
    ) -> TemplateResponse | None:
        """The body of an action of the list's menu."""
        model_admin = cast(admin.ModelAdmin, self)  # type: ignore[type-arg]
        confirmed = request.POST.get("confirm") == "yes"
        return operate(model_admin, request, action, chosen, confirmed=confirmed, menu_action=menu_action)

    def act_on_object(
        self, request: HttpRequest, object_id: str, action: OperatorAction[Any]
    ) -> HttpResponse:
        """The page of a row's button: confirmation, then the action and back to the row."""
        model_admin = cast(admin.ModelAdmin, self)  # type: ignore[type-arg]
        if not has_perm(request, action.permission):
            raise PermissionDenied
        obj = object_or_404(model_admin, request, object_id)
        confirmed = request.method == "POST" and request.POST.get("confirm") == "yes"
        asked = operate(model_admin, request, action, [obj], confirmed=confirmed)
        if asked is not None:
            return asked
        opts = model_admin.opts
        return HttpResponseRedirect(
            reverse(f"admin:{opts.app_label}_{opts.model_name}_change", args=[obj.pk])
        )
