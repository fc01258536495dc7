"""Fences and their watermarks (read only)."""

from __future__ import annotations

from typing import Any

from django.db.models import QuerySet
from django.http import Http404
from drf_spectacular.utils import extend_schema
from rest_framework.request import Request
from rest_framework.response import Response

from ... import access
from ...models import Fence
from ..serializers import FenceSerializer
from .base import (
    RESOURCE_PARAMETER,
    CoordinationListView,
    CoordinationView,
    error_responses,
    operation,
    path_key,
)


@extend_schema(tags=["fences"])
class FenceListView(CoordinationListView):
    """Every fence with its watermark, ordered by resource name."""

    serializer_class = FenceSerializer
    required_permissions = {"GET": "coordination.view_fence"}

    def get_queryset(self) -> QuerySet[Fence]:
        return access.for_request(self.request).filter(Fence.objects.order_by("resource"), "read", "lock_key")

    @operation(
        operation_id="fences_list",
        responses={200: FenceSerializer(many=True), **error_responses(404)},
    )
    def get(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        return super().get(request, *args, **kwargs)


@extend_schema(tags=["fences"], parameters=[RESOURCE_PARAMETER])
class FenceDetailView(CoordinationView):
    """One fence and its watermark."""

    required_permissions = {"GET": "coordination.view_fence"}

    @operation(
        operation_id="fences_retrieve",
        summary="A fence's watermark",
        responses={200: FenceSerializer, **error_responses(404)},
    )
    def get(self, request: Request, resource: str) -> Response:
        resource = path_key(resource, "resource")
        fence = Fence.objects.filter(resource=resource).first()
        # A fence of a key the rules do not let the user read is not there for them:
        # 403 would tell that the name exists, and which key guards it.
        if fence is None or not access.for_request(request).allows("read", fence.lock_key):
            raise Http404
        return Response(FenceSerializer(fence).data)
