"""REST views of job policies: read, create or replace, change and delete one task's
policy; pause a task (revoking its running executions if asked) and resume it.

The same rules as the admin (:mod:`coordination.jobs`): a policy is the lock
key ``task:<task>`` to the access rules (``read`` to see it, ``revoke`` to
change it), the Django permissions of the JobPolicy model apply (pausing and
resuming: ``pause_jobpolicy``, as the admin's buttons), and every change is
recorded with the API user as who made it. Revoking a running execution also
needs ``revoke`` on its own key; the others stay running.
"""

from __future__ import annotations

from typing import Any

from django.db import transaction
from django.db.models import CharField, QuerySet, Value
from django.db.models.functions import Concat
from django.http import Http404
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import serializers, status
from rest_framework.exceptions import NotFound
from rest_framework.request import Request
from rest_framework.response import Response

from ... import access, jobs
from ...conf import app_settings
from ...dashboard import registered_fenced_tasks
from ...exceptions import InvalidInput
from ...models import (
    KEY_MAX_LENGTH,
    RATE_LIMIT_MAX,
    RATE_PERIOD_MAX,
    RATE_PERIOD_MIN,
    JobPolicy,
    WhenPaused,
    validate_task_pattern,
)
from ..serializers import (
    GrantSerializer,
    StrictCharField,
    StrictIntegerField,
    StrictSecondsField,
    StrictSerializer,
)
from .base import (
    CoordinationListView,
    CoordinationView,
    error_responses,
    non_atomic,
    operation,
    validated,
)

TASK_PARAMETER = OpenApiParameter(
    "task",
    {"type": "string", "maxLength": KEY_MAX_LENGTH - 5},
    OpenApiParameter.PATH,
    description="The task's name, or a name's beginning followed by * (a pattern policy).",
)


class StrictBooleanField(serializers.BooleanField):
    """A JSON boolean only: not ``"true"``, 1 or ``"yes"``."""

    def to_internal_value(self, data: Any) -> bool:
        if not isinstance(data, bool):
            raise serializers.ValidationError("Must be a JSON boolean.", code="invalid")
        return data


class JobPolicySerializer(serializers.ModelSerializer[JobPolicy]):
    class Meta:
        model = JobPolicy
        fields = [
            "task", "paused", "when_paused", "defer_seconds", "max_running", "ttl", "on_busy",
            "rate_limit", "rate_period", "rate_key", "key_cap", "cap_key", "note", "updated_at",
        ]


class JobPolicyWrite(StrictSerializer):
    """Body of a policy's PUT (every field optional: a missing one takes its default)
    or PATCH (a missing one is left as it is)."""

    paused = StrictBooleanField(required=False, help_text="Executions that start now do not run.")
    when_paused = serializers.ChoiceField(
        choices=WhenPaused.choices, required=False,
        help_text="`defer` (default: sent again after `defer_seconds`) or `skip`.",
    )
    defer_seconds = StrictSecondsField(
        required=False, min_value=0.1, max_value=3600.0,
        help_text="Countdown of a deferred execution, seconds (default 10).",
    )
    max_running = StrictIntegerField(
        required=False, allow_null=True, min_value=1, max_value=1000,
        help_text="At most this many executions at once; null: no cap.",
    )
    on_busy = serializers.ChoiceField(
        choices=["", "retry", "skip", "raise"], required=False,
        help_text="Overrides the decorator's on_busy; empty: the decorator's.",
    )
    rate_limit = StrictIntegerField(
        required=False, allow_null=True, min_value=1, max_value=RATE_LIMIT_MAX,
        help_text="At most this many starts in any window of `rate_period`, per `rate_key`, over "
                  "every worker; null: no limit (then `rate_period` null and `rate_key` empty).",
    )
    rate_period = StrictSecondsField(
        required=False, allow_null=True, min_value=RATE_PERIOD_MIN, max_value=RATE_PERIOD_MAX,
        help_text="The rate limit's period, seconds (60: per minute); set with `rate_limit`.",
    )
    rate_key = StrictCharField(
        required=False, allow_blank=True, max_length=KEY_MAX_LENGTH,
        help_text="Template over the task's arguments the limit counts per (`{customer_id}`); "
                  "empty: one count for the policy.",
    )
    key_cap = StrictIntegerField(
        required=False, allow_null=True, min_value=1, max_value=1000,
        help_text="At most this many executions at once per `cap_key`, each holding a fenced "
                  "permit; null: no cap per key.",
    )
    cap_key = StrictCharField(
        required=False, allow_blank=True, max_length=KEY_MAX_LENGTH,
        help_text="Template over the task's arguments the cap counts per (`{customer_id}`); "
                  "needed with `key_cap`.",
    )
    note = StrictCharField(required=False, allow_blank=True, max_length=200)
    ahead_of_deploy = StrictBooleanField(
        required=False, default=False,
        help_text="Create a policy for a task this site does not know yet (no worker reported "
                  "it, it never ran): without it such a name is refused (400 `invalid`).",
    )

    def get_fields(self) -> dict[str, serializers.Field[Any, Any, Any, Any]]:
        fields = super().get_fields()
        fields["ttl"] = StrictSecondsField(
            required=False, allow_null=True, min_value=float(app_settings.MIN_TTL),
            max_value=float(app_settings.MAX_TTL),
            help_text="Lease of each execution, seconds; null: the decorator's.",
        )
        return fields


def _refuse_unknown(task: str) -> None:
    """A policy naming no fenced task the site knows would steer nothing: a typo, or a
    task not deployed yet (``ahead_of_deploy``)."""
    # The remedy before the nearest names: the API cuts a long message, and the
    # names are the part that may go.
    refusal = jobs.unknown_task(
        task, {*registered_fenced_tasks(), *jobs.known_tasks()},
        remedy='send "ahead_of_deploy": true to create it before the task is deployed',
    )
    if refusal is not None:
        raise serializers.ValidationError({"task": [refusal]}, code="invalid")


def _check_limits(policy: JobPolicy) -> None:
    """The rate and cap fields of the policy as saved go together, and their
    templates name only arguments of the tasks the policy applies to (400
    ``invalid``, naming the field), before the database's own checks would."""
    errors: dict[str, list[str]] = {}
    if (policy.rate_limit is None) != (policy.rate_period is None):
        errors["rate_period" if policy.rate_period is None else "rate_limit"] = [
            "rate_limit and rate_period are set together (or both null)."
        ]
    if policy.rate_key and policy.rate_limit is None:
        errors["rate_key"] = ["a rate key needs a rate_limit."]
    if (policy.key_cap is None) != (not policy.cap_key):
        errors["cap_key" if policy.key_cap is not None else "key_cap"] = [
            "key_cap and cap_key are set together (or both empty)."
        ]
    for field in ("rate_key", "cap_key"):
        template = getattr(policy, field)
        if field not in errors and template:
            why = jobs.template_refusal(policy.task, template)
            if why is not None:
                errors[field] = [why]
    if errors:
        raise serializers.ValidationError(errors, code="invalid")


def _path_task(task: str) -> str:
    try:
        return validate_task_pattern(task)
    except InvalidInput as error:
        raise serializers.ValidationError({"task": [error.detail]}, code="invalid") from None


@extend_schema(tags=["jobs"])
class JobPolicyListView(CoordinationListView):
    """Every job policy the user may read, ordered by task."""

    serializer_class = JobPolicySerializer
    required_permissions = {"GET": "coordination.view_jobpolicy"}

    def get_queryset(self) -> QuerySet[JobPolicy]:
        rows = JobPolicy.objects.order_by("task").alias(
            rules_key=Concat(Value("task:"), "task", output_field=CharField())
        )
        return access.for_request(self.request).filter(rows, "read", "rules_key")

    @operation(
        operation_id="job_policies_list",
        responses={200: JobPolicySerializer(many=True), **error_responses(404)},
    )
    def get(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        return super().get(request, *args, **kwargs)


@extend_schema(tags=["jobs"], parameters=[TASK_PARAMETER])
class JobPolicyDetailView(CoordinationView):
    """One task's policy: read it, put it (create or replace), patch it, delete it."""

    required_permissions = {
        "GET": "coordination.view_jobpolicy",
        "PUT": "coordination.change_jobpolicy",
        "PATCH": "coordination.change_jobpolicy",
        "DELETE": "coordination.delete_jobpolicy",
    }

    def _policy(self, request: Request, task: str, action: str) -> JobPolicy | None:
        task = _path_task(task)
        access.for_request(request).require(action, jobs.permit_name(task))
        return JobPolicy.objects.filter(task=task).first()

    @operation(
        operation_id="job_policies_retrieve",
        responses={200: JobPolicySerializer, **error_responses(404)},
    )
    def get(self, request: Request, task: str) -> Response:
        policy = self._policy(request, task, "read")
        if policy is None:
            raise Http404
        return Response(JobPolicySerializer(policy).data)

    @operation(
        operation_id="job_policies_put",
        summary="Create or replace a task's policy",
        description=(
            "Fields left out take their defaults. Workers apply the change to executions that "
            "start up to COORDINATION JOB_POLICY_REFRESH seconds later. Creating a policy needs "
            "`add_jobpolicy` too."
        ),
        request=JobPolicyWrite,
        responses={200: JobPolicySerializer, 201: JobPolicySerializer, **error_responses(404, 413, 415)},
    )
    def put(self, request: Request, task: str) -> Response:
        return self._write(request, task, partial=False)

    @operation(
        operation_id="job_policies_patch",
        summary="Change some fields of a task's policy",
        request=JobPolicyWrite,
        responses={200: JobPolicySerializer, **error_responses(404, 413, 415)},
    )
    def patch(self, request: Request, task: str) -> Response:
        return self._write(request, task, partial=True)

    @operation(
        operation_id="job_policies_destroy",
        responses={204: None, **error_responses(404)},
    )
    def delete(self, request: Request, task: str) -> Response:
        policy = self._policy(request, task, "revoke")
        if policy is None:
            raise Http404
        policy.delete(changed_by=request.user.get_username(), via="api")
        return Response(status=status.HTTP_204_NO_CONTENT)

    def _write(self, request: Request, task: str, *, partial: bool) -> Response:
        body = validated(JobPolicyWrite, request.data)
        with transaction.atomic(using=app_settings.DATABASE):
            policy = self._policy(request, task, "revoke")
            created = policy is None
            if policy is None:
                if partial:
                    raise NotFound(
                        f"task {_path_task(task)!r} has no policy to change: create one with PUT "
                        "(or POST .../pause)"
                    )
                if not request.user.has_perm("coordination.add_jobpolicy"):
                    self.permission_denied(request, "Creating a policy needs 'coordination.add_jobpolicy'.")
                policy = JobPolicy(task=_path_task(task))
                if not body.pop("ahead_of_deploy", False):
                    _refuse_unknown(policy.task)
            elif not partial:
                fresh = JobPolicy(task=policy.task)
                for name, value in fresh.state().items():
                    setattr(policy, name, value)
            body.pop("ahead_of_deploy", None)
            for name, value in body.items():
                setattr(policy, name, value)
            _check_limits(policy)
            policy.save(changed_by=request.user.get_username(), via="api")
        return Response(
            JobPolicySerializer(policy).data,
            status=status.HTTP_201_CREATED if created else status.HTTP_200_OK,
        )


class PauseRequest(StrictSerializer):
    revoke_running = StrictBooleanField(
        required=False, default=False,
        help_text="Also revoke the leases of the task's running executions (their keys and "
                  "permits): their later fenced writes are refused. Only those whose keys the "
                  "user may revoke are revoked.",
    )
    ahead_of_deploy = StrictBooleanField(
        required=False, default=False,
        help_text="Pause a task this site does not know yet (no policy, no worker reported it): "
                  "without it such a name is refused (400 `invalid`).",
    )


class PausedSerializer(serializers.Serializer[Any]):
    policy = JobPolicySerializer()
    revoked = GrantSerializer(
        many=True, help_text="The revoked leases (keys and permits of running executions); "
                             "writes under their tokens are refused.",
    )


@non_atomic
@extend_schema(tags=["jobs"], parameters=[TASK_PARAMETER])
class JobPolicyPauseView(CoordinationView):
    """Pause a task (its policy is created if it has none), optionally revoking the
    leases of its running executions, as the admin's "pause and revoke" does."""

    required_permissions = {"POST": "coordination.pause_jobpolicy"}

    @operation(
        operation_id="job_policies_pause",
        summary="Pause a task, and revoke its running executions if asked",
        description=(
            "New executions stop running their bodies (deferred or skipped, as the policy "
            "says) from up to COORDINATION JOB_POLICY_REFRESH seconds later. With "
            "`revoke_running`, the leases of the executions running now end at once: their "
            "keep-alives find the lease lost, their later fenced writes are refused, and the "
            "next grant of each key fences them out. Work they already wrote stays."
        ),
        request=PauseRequest,
        responses={200: PausedSerializer, **error_responses(413, 415)},
    )
    def post(self, request: Request, task: str) -> Response:
        body = validated(PauseRequest, request.data)
        task = _path_task(task)
        rules = access.for_request(request)
        rules.require("revoke", jobs.permit_name(task))
        if not body["ahead_of_deploy"] and not JobPolicy.objects.filter(task=task).exists():
            _refuse_unknown(task)
        policy, revoked = jobs.pause(
            task, by=request.user.get_username(), via="api",
            revoke_running=body["revoke_running"],
            may_revoke=lambda key: rules.allows("revoke", key),
        )
        return Response(PausedSerializer({"policy": policy, "revoked": revoked}).data)


@extend_schema(tags=["jobs"], parameters=[TASK_PARAMETER])
class JobPolicyResumeView(CoordinationView):
    """Resume a paused task: its deferred executions run when their countdown next ends."""

    required_permissions = {"POST": "coordination.pause_jobpolicy"}

    @operation(
        operation_id="job_policies_resume",
        summary="Resume a paused task",
        request=None,
        responses={200: JobPolicySerializer, **error_responses(404)},
        description="404 `not_found` for a task with no policy (nothing is paused).",
    )
    def post(self, request: Request, task: str) -> Response:
        task = _path_task(task)
        access.for_request(request).require("revoke", jobs.permit_name(task))
        policy = jobs.resume(task, by=request.user.get_username(), via="api")
        if policy is None:
            raise Http404
        return Response(JobPolicySerializer(policy).data)
