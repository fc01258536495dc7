"""Acquiring several leases at once: a lock set (all or none), a semaphore's permit."""

from __future__ import annotations

from drf_spectacular.utils import extend_schema
from rest_framework import serializers, status
from rest_framework.request import Request
from rest_framework.response import Response

from ... import access, locks
from ...exceptions import InvalidInput
from ...semaphores import acquire_permit, permit_keys
from ..serializers import (
    AcquiredPermitSerializer,
    AcquiredSetSerializer,
    LockSetAcquireRequest,
    PermitAcquireRequest,
)
from .base import (
    NAME_OF_SEMAPHORE,
    CoordinationView,
    error_responses,
    non_atomic,
    operation,
    path_key,
    validated,
)


@non_atomic
@extend_schema(tags=["locks"])
class LockSetAcquireView(CoordinationView):
    """Acquire several locks, all or none."""

    required_permissions = {"POST": "coordination.acquire_lock"}

    @operation(
        operation_id="lock_sets_acquire",
        summary="Acquire several locks, all or none",
        description=(
            "Grants every key of `keys` to `holder`, each with its own token, in one "
            "transaction and in sorted key order (no deadlock between overlapping sets), or "
            "none: 409 `lock_held` names the first refused key. Renew and release each grant "
            "at its key's own endpoints."
        ),
        request=LockSetAcquireRequest,
        responses={201: AcquiredSetSerializer, **error_responses(409, 413, 415)},
    )
    def post(self, request: Request) -> Response:
        body = validated(LockSetAcquireRequest, request.data)
        rules = access.for_request(request)
        for key in body["keys"]:
            rules.require("acquire", key)
        grants = locks.acquire_many(
            body["keys"], holder=body["holder"], ttl=body["ttl"], wait=body["wait"]
        )
        return Response(
            AcquiredSetSerializer({"grants": list(grants.values())}).data,
            status=status.HTTP_201_CREATED,
        )


@non_atomic
@extend_schema(tags=["semaphores"], parameters=[NAME_OF_SEMAPHORE])
class PermitAcquireView(CoordinationView):
    """Acquire one of a semaphore's permits."""

    required_permissions = {"POST": "coordination.acquire_lock"}

    @operation(
        operation_id="semaphores_acquire",
        summary="Acquire one of a semaphore's permits",
        description=(
            "Grants one of the `limit` permits of the semaphore: the lease of one slot's lock "
            "key `<name>@<slot>`, with a token of that slot's own. Fence the permit's writes by "
            "that key; renew and release it at `locks/<name>@<slot>/renew` and `/release`. "
            "All permits held: 409 `lock_held` (`holder` says so, `retry_after` when the first "
            "lease ends)."
        ),
        request=PermitAcquireRequest,
        responses={201: AcquiredPermitSerializer, **error_responses(409, 413, 415)},
    )
    def post(self, request: Request, name: str) -> Response:
        name = path_key(name, "name")
        body = validated(PermitAcquireRequest, request.data)
        try:
            slots = permit_keys(name, body["limit"])
        except InvalidInput as error:  # the name leaves no room for "@<slot>"
            raise serializers.ValidationError({"name": [error.detail]}, code="invalid") from None
        rules = access.for_request(request)
        for slot in slots:
            rules.require("acquire", slot)
        permit = acquire_permit(
            name, limit=body["limit"], holder=body["holder"], ttl=body["ttl"], wait=body["wait"]
        )
        return Response(AcquiredPermitSerializer(permit).data, status=status.HTTP_201_CREATED)
