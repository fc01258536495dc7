"""REST views of stranded executions: list them, clear one.

The same rules as the jobs page (:mod:`coordination.stranded`): listing needs
``view_grant`` (holders and tokens) and ``read`` on the task (``task:<name>``)
and on the execution's keys; clearing needs ``revoke_lock`` and ``revoke`` on
all of them, as a revoke does. An execution the user may not read, or that is
not stranded (any more), is 404. Each clear is recorded in the admin's log of
actions, as the admin's clear is, and in the grant history.
"""

from __future__ import annotations

from typing import Any

from django.contrib.admin.models import CHANGE, LogEntry
from django.http import Http404
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import serializers
from rest_framework.request import Request
from rest_framework.response import Response

from ... import access, jobs
from ...models import Lock
from ...stranded import Stranded, clear, stranded_executions
from .base import CoordinationListView, CoordinationView, error_responses, non_atomic, operation

ID_PARAMETER = OpenApiParameter(
    "id", {"type": "integer", "minimum": 1, "maximum": 2**63 - 1}, OpenApiParameter.PATH,
    description="The stranded execution's id, as the list gives it.",
)


class StrandedSerializer(serializers.Serializer[Any]):
    id = serializers.IntegerField(source="pk")
    task = serializers.CharField()
    task_id = serializers.CharField()
    attempt = serializers.IntegerField()
    worker = serializers.CharField(help_text="<host>:<pid> of the process that ran it.")
    key = serializers.CharField()
    token = serializers.IntegerField(help_text="The dead lease's token.")
    permit = serializers.CharField(help_text="The permit's lock key (max_running), or empty.")
    cap_permit = serializers.CharField(
        help_text="The permit's lock key of the policy's cap per key (key_cap), or empty."
    )
    started_at = serializers.DateTimeField()
    last_renewal = serializers.DateTimeField(
        allow_null=True, help_text="The lease's end minus its length; null: not recorded."
    )
    expired_at = serializers.DateTimeField(help_text="When the lease ran out (database time).")


class ClearedSerializer(serializers.Serializer[Any]):
    execution = StrandedSerializer()
    token = serializers.IntegerField(help_text="Every watermark of the key now stands at this token.")
    raised = serializers.IntegerField(help_text="How many watermarks were raised.")
    permit_token = serializers.IntegerField(
        allow_null=True, help_text="The token the permit's watermarks now stand at; null: none."
    )
    cap_permit_token = serializers.IntegerField(
        allow_null=True,
        help_text="The same for the permit of the cap per key; null: none.",
    )


def _keys(execution: Stranded) -> list[str]:
    return [jobs.permit_name(execution.task), *execution.keys]


@extend_schema(tags=["jobs"])
class StrandedListView(CoordinationListView):
    """The executions whose lease expired without a release and whose key nobody
    has taken since (their worker was lost), oldest first, at most 1000."""

    serializer_class = StrandedSerializer
    required_permissions = {"GET": "coordination.view_grant"}

    def get_queryset(self) -> Any:
        rules = access.for_request(self.request)
        return [
            execution for execution in stranded_executions(limit=1000)
            if all(rules.allows("read", key) for key in _keys(execution))
        ]

    @operation(
        operation_id="stranded_executions_list",
        responses={200: StrandedSerializer(many=True), **error_responses(404)},
    )
    def get(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        return super().get(request, *args, **kwargs)


@non_atomic
@extend_schema(tags=["jobs"], parameters=[ID_PARAMETER])
class StrandedClearView(CoordinationView):
    """Clear one stranded execution: its dead lease ends and every watermark of its
    key is raised to a new token, so a write under its token is refused as stale."""

    required_permissions = {"POST": "coordination.revoke_lock"}

    @operation(
        operation_id="stranded_executions_clear",
        request=None,
        responses={200: ClearedSerializer, **error_responses(404, 409)},
        description=(
            "404 `not_found` for an execution that is not stranded (released, taken over, "
            "cleared) or that the user may not read; 409 `lock_held` while the key cannot be "
            "granted yet (a lock-delay after the dead lease, fair waiters queued first)."
        ),
    )
    def post(self, request: Request, id: int) -> Response:
        rules = access.for_request(request)
        found = stranded_executions(pks=[id], limit=1)
        if not found or not all(rules.allows("read", key) for key in _keys(found[0])):
            raise Http404
        execution = found[0]
        for key in _keys(execution):
            rules.require("revoke", key)
        cleared = clear(execution, by=request.user.get_username())
        if cleared is None:
            raise Http404
        lock = Lock.objects.filter(key=execution.key).first()
        if lock is not None and request.user.pk is not None:
            LogEntry.objects.log_actions(
                request.user.pk, [lock], CHANGE, change_message=f"{cleared.summary} (REST)",
                single_object=True,
            )
        return Response(ClearedSerializer({
            "execution": execution, "token": cleared.token, "raised": cleared.raised,
            "permit_token": cleared.permit_token, "cap_permit_token": cleared.cap_permit_token,
        }).data)
