"""The jobs page's action on stranded executions: end their dead leases and fence
them out (:func:`coordination.stranded.clear`), through the one operator-action
helper like every other action."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.urls import reverse
from django.utils.translation import gettext_lazy as _
from django.utils.translation import ngettext

from .. import jobs
from ..exceptions import LockHeld
from ..models import Lock
from ..stranded import Stranded, clear, stranded_executions
from .actions import Done, OperatorAction, operate
from .base import has_perm

# The posted field naming the executions chosen (their record's id).
CHOSEN = "stranded"


def _clear(request: HttpRequest, execution: Stranded) -> Done | None:
    by = request.user.get_username()
    try:
        cleared = clear(execution, by=by)
    except LockHeld as refused:
        messages.warning(request, str(refused))
        return None
    if cleared is None:
        return None
    lock = Lock.objects.filter(key=execution.key).first()
    return Done(lock, cleared.summary, 1)


def _report(chosen: Sequence[Any], results: Sequence[Done | None]) -> Iterable[tuple[str, int]]:
    done = sum(1 for result in results if result is not None)
    if done:
        yield ngettext(
            "Cleared %(count)d stranded execution: its lease ended, and its token is refused "
            "by every watermark of its key.",
            "Cleared %(count)d stranded executions: their leases ended, and their tokens are "
            "refused by every watermark of their keys.",
            done,
        ) % {"count": done}, messages.SUCCESS
    left = len(chosen) - done
    if left:
        yield ngettext(
            "%(count)d execution was left as it is: no longer stranded, or its key cannot be "
            "granted yet.",
            "%(count)d executions were left as they are: no longer stranded, or their keys "
            "cannot be granted yet.",
            left,
        ) % {"count": left}, messages.WARNING


CLEAR = OperatorAction[Stranded](
    permission="revoke_lock",
    keys=lambda execution: [jobs.permit_name(execution.task), *execution.keys],
    run=_clear,
    report=_report,
    title=(_("Clear this stranded execution?"), _("Clear these stranded executions?")),
    explanation=_(
        "Their workers were lost without releasing (killed, out of memory, past a hard time "
        "limit). Clearing ends each dead lease and raises every watermark of its key (its "
        "fences, the documents and fenced rows it guards) to a new token, so a copy that was "
        "only paused and wakes up is refused (stale token) wherever it writes in this "
        "database. A key a worker took again meanwhile is left to it. Work already written stays."
    ),
    button=_("Yes, clear"),
    headers=[_("task"), _("task id"), _("attempt"), _("worker"), _("key"), _("token"),
             _("lease expired")],
    row=lambda execution: [
        execution.task, execution.task_id, execution.attempt, execution.worker, execution.key,
        execution.token, execution.expired_at.isoformat(timespec="seconds"),
    ],
)


def clear_view(model_admin: admin.ModelAdmin, request: HttpRequest) -> HttpResponse:  # type: ignore[type-arg]
    """The jobs page's "Clear" button: POST the ``stranded`` ids; the confirmation
    page, then the action and back to the jobs page."""
    if not has_perm(request, CLEAR.permission):
        raise PermissionDenied
    back = reverse("admin:coordination_jobs")
    if request.method != "POST":
        return HttpResponseRedirect(back)
    ids = [int(value) for value in request.POST.getlist(CHOSEN) if value.isdigit()]
    chosen = stranded_executions(pks=ids) if ids else []
    if not chosen:
        model_admin.message_user(
            request, _("None of the chosen executions is stranded now."), messages.WARNING
        )
        return HttpResponseRedirect(back)
    asked = operate(
        model_admin, request, CLEAR, chosen, confirmed=request.POST.get("confirm") == "yes",
        hidden=[(CHOSEN, str(execution.pk)) for execution in chosen],
    )
    return asked if asked is not None else HttpResponseRedirect(back)
