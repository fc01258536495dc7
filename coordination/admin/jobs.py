"""Job policies (coordination.jobs), edited here with every change recorded; their
pause and resume actions, and the jobs page."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from django import forms
from django.contrib import admin, messages
from django.contrib.admin.utils import unquote
from django.core.exceptions import PermissionDenied
from django.db.models import CharField, QuerySet, Value
from django.db.models.functions import Concat
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse
from django.utils.translation import gettext_lazy as _
from django.utils.translation import ngettext

from .. import access, jobs
from ..conf import app_settings
from ..dashboard import registered_fenced_tasks
from ..exceptions import InvalidInput
from ..models import JobPolicy, validate_task_pattern
from .actions import Done, OperatorAction, OperatorActionsMixin, operate
from .base import has_perm, readable, require_rules
from .pages import jobs_page
from .stranded import clear_view


class JobPolicyForm(forms.ModelForm):  # type: ignore[type-arg]
    """A policy's fields; :attr:`rules` are the editing user's access rules."""

    rules: access.Access | None = None

    ahead_of_deploy = forms.BooleanField(
        required=False, label=_("Ahead of a deploy"),
        help_text=_("Save a policy for a task this site does not know yet (not reported by a "
                    "worker, never run): it applies once the task is deployed."),
    )

    class Meta:
        model = JobPolicy
        fields = [
            "task", "paused", "when_paused", "defer_seconds", "max_running", "ttl", "on_busy",
            "rate_limit", "rate_period", "rate_key", "key_cap", "cap_key", "note",
        ]

    def clean(self) -> dict[str, Any]:
        cleaned = super().clean() or {}
        task = cleaned.get("task")
        if (
            task and task != self.initial.get("task") and not cleaned.get("ahead_of_deploy")
            and not JobPolicy.objects.filter(task=task).exists()  # the unique check says so
        ):
            refusal = jobs.unknown_task(task, site_tasks())
            if refusal is not None:
                self.add_error("task", _("%(why)s. Check the name, or tick “Ahead of a deploy” to "
                                         "save it for a task not deployed yet.") % {"why": refusal})
        for field in ("rate_key", "cap_key"):
            template = cleaned.get(field)
            if task and template and (why := jobs.template_refusal(task, template)) is not None:
                self.add_error(field, why)
        return cleaned

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


def site_tasks() -> set[str]:
    """The fenced tasks a policy may name: registered in this process, reported by a
    worker, or run before."""
    return {*registered_fenced_tasks(), *jobs.known_tasks()}


def running_now(policy: JobPolicy) -> int:
    """How many executions of the policy's task (or pattern) run now."""
    if policy.task.endswith("*"):
        return sum(1 for run in jobs.running() if run.task.startswith(policy.task[:-1]))
    return len(jobs.running(policy.task))


def _steer(how: str) -> OperatorAction[JobPolicy]:
    """Pause (``pause``, ``pause_and_revoke``) or resume tasks: each needs the
    permission and ``revoke`` on its ``task:<name>``; revoking a running
    execution also needs ``revoke`` on its own key (others stay running).
    Only pausing with revoking asks for a confirmation."""

    def run(request: HttpRequest, policy: JobPolicy) -> Done:
        by = request.user.get_username()
        if how == "resume":
            return Done(jobs.resume(policy.task, by=by, via="admin"), f"resume by {by}")
        rules = access.for_request(request)
        changed, ended = jobs.pause(
            policy.task, by=by, via="admin", revoke_running=how == "pause_and_revoke",
            may_revoke=lambda key: rules.allows("revoke", key),
        )
        return Done(changed, f"{how.replace('_', ' ')} by {by}", len(ended))

    def report(chosen: Sequence[Any], results: Sequence[Done | None]) -> Iterable[tuple[str, int]]:
        verb = _("Resumed") if how == "resume" else _("Paused")
        yield ngettext(
            "%(verb)s %(count)d task.", "%(verb)s %(count)d tasks.", len(chosen)
        ) % {"verb": verb, "count": len(chosen)}, messages.SUCCESS
        if how == "pause_and_revoke":
            revoked = sum(result.ended for result in results if result is not None)
            yield ngettext(
                "Revoked %(count)d lease of running executions; their later fenced writes are refused.",
                "Revoked %(count)d leases of running executions; their later fenced writes are refused.",
                revoked,
            ) % {"count": revoked}, messages.WARNING if revoked else messages.INFO

    title = _("Pause and revoke running executions?")
    return OperatorAction(
        permission="pause_jobpolicy",
        keys=lambda policy: [jobs.permit_name(policy.task)],
        run=run,
        report=report,
        confirm=how == "pause_and_revoke",
        title=(title, title),
        explanation=_(
            "New executions of these tasks stop running their bodies (deferred or skipped, "
            "as each policy says). The leases of the executions running now are revoked: "
            "their keep-alives find the lease lost and their later fenced writes are "
            "refused; the next grant of each key fences them out. Work they already "
            "wrote stays."
        ),
        button=_("Yes, pause and revoke"),
        headers=[_("task"), _("paused"), _("running now")],
        row=lambda policy: [policy.task, policy.paused, running_now(policy)],
    )


STEER = {how: _steer(how) for how in ("pause", "resume", "pause_and_revoke")}

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
        "task", "paused", "when_paused", "max_running", "ttl", "on_busy", "rate_limit", "key_cap",
        "running_now", "updated_at",
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
        return readable(request, rows, Concat(Value("task:"), "task", output_field=CharField()))

    def get_urls(self) -> list[URLPattern]:
        view = self.admin_site.admin_view
        return [
            path("jobs/", view(self.jobs_view), name="coordination_jobs"),
            path("jobs/steer/", view(self.steer_view), name="coordination_jobs_steer"),
            path("jobs/stranded/clear/", view(self.clear_stranded_view),
                 name="coordination_jobs_clear_stranded"),
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
        return has_perm(request, "pause_jobpolicy")

    def _steerable(self, request: HttpRequest, obj: JobPolicy | None) -> bool:
        return obj is None or access.for_request(request).allows("revoke", obj.access_key)

    def save_model(self, request: HttpRequest, obj: JobPolicy, form: Any, change: bool) -> None:
        # A new policy (or a renamed one) names a task the rules must let the user steer.
        require_rules(request, "revoke", [obj.access_key])
        obj.save(changed_by=request.user.get_username(), via="admin")

    def delete_model(self, request: HttpRequest, obj: JobPolicy) -> None:
        obj.delete(changed_by=request.user.get_username(), via="admin")

    def delete_queryset(self, request: HttpRequest, queryset: QuerySet[JobPolicy]) -> None:
        for policy in queryset:
            self.delete_model(request, policy)

    @admin.display(description=_("running now"))
    def running_now(self, policy: JobPolicy) -> int:
        return running_now(policy)

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

    @admin.action(description=_("Pause the selected tasks"), permissions=["pause"])
    def pause_selected(self, request: HttpRequest, queryset: QuerySet[JobPolicy]) -> None:
        self.act_on_selected(request, STEER["pause"], list(queryset), "pause_selected")

    @admin.action(description=_("Resume the selected tasks"), permissions=["pause"])
    def resume_selected(self, request: HttpRequest, queryset: QuerySet[JobPolicy]) -> None:
        self.act_on_selected(request, STEER["resume"], list(queryset), "resume_selected")

    @admin.action(
        description=_("Pause the selected tasks and revoke their running executions"),
        permissions=["pause"],
    )
    def pause_and_revoke_selected(
        self, request: HttpRequest, queryset: QuerySet[JobPolicy]
    ) -> TemplateResponse | None:
        chosen = list(queryset.order_by("task"))
        return self.act_on_selected(
            request, STEER["pause_and_revoke"], chosen, "pause_and_revoke_selected"
        )

    def steer_view(self, request: HttpRequest) -> HttpResponse:
        """The jobs page's buttons: POST ``task`` and ``how`` (pause, resume,
        pause_and_revoke); back to the jobs page. The button is the confirmation."""
        back = reverse("admin:coordination_jobs")
        if request.method != "POST":
            return HttpResponseRedirect(back)
        task, how = request.POST.get("task", ""), request.POST.get("how", "")
        if how not in STEER:
            raise PermissionDenied
        try:
            validate_task_pattern(task)
        except InvalidInput as error:
            self.message_user(request, error.detail, messages.ERROR)
            return HttpResponseRedirect(back)
        # The task may be a pattern, or have no policy yet: run() reads only its name.
        operate(self, request, STEER[how], [JobPolicy(task=task)], confirmed=True)
        return HttpResponseRedirect(back)

    def clear_stranded_view(self, request: HttpRequest) -> HttpResponse:
        return clear_view(self, request)

    def jobs_view(self, request: HttpRequest) -> HttpResponse:
        return jobs_page(self, request, can_pause=self.has_pause_permission(request))
