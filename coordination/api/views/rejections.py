"""Refused writes (read only)."""

from __future__ import annotations

from typing import Any

from django.db.models import QuerySet
from drf_spectacular.utils import extend_schema
from rest_framework.request import Request
from rest_framework.response import Response

from ... import access
from ...models import Rejection
from ..serializers import RejectionFilter, RejectionSerializer
from .base import CoordinationListView, error_responses, operation, validated


@extend_schema(tags=["rejections"])
class RejectionListView(CoordinationListView):
    """Refused writes, newest first."""

    serializer_class = RejectionSerializer
    required_permissions = {"GET": "coordination.view_rejection"}

    def get_queryset(self) -> QuerySet[Rejection]:
        filters = validated(RejectionFilter, self.request.query_params)
        rows = Rejection.objects.order_by("-created_at", "-id")
        if "resource" in filters:
            rows = rows.filter(resource=filters["resource"])
        if "lock_key" in filters:
            rows = rows.filter(lock_key=filters["lock_key"])
        if "since" in filters:
            rows = rows.filter(created_at__gte=filters["since"])
        return access.for_request(self.request).filter(rows, "read", "lock_key")

    @operation(
        operation_id="rejections_list",
        parameters=[RejectionFilter],
        responses={200: RejectionSerializer(many=True), **error_responses(404)},
    )
    def get(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        return super().get(request, *args, **kwargs)
