"""One lock: its state, acquire, renew, release, its grants; the list of locks."""

from __future__ import annotations

from typing import Any

from django.db.models import QuerySet
from django.http import Http404
from drf_spectacular.utils import extend_schema
from rest_framework import status
from rest_framework.request import Request
from rest_framework.response import Response

from ... import access, locks
from ...models import Grant, GrantMode, Lock
from ...shared import acquire_shared
from ..serializers import (
    AcquiredGrantSerializer,
    GrantSerializer,
    LockAcquireRequest,
    LockSerializer,
    ReleaseRequest,
    RenewRequest,
)
from .base import (
    KEY_PARAMETER,
    CoordinationListView,
    CoordinationView,
    error_responses,
    non_atomic,
    operation,
    path_key,
    validated,
)


@extend_schema(tags=["locks"])
class LockListView(CoordinationListView):
    """All locks with their state by the database clock, ordered by key."""

    serializer_class = LockSerializer
    required_permissions = {"GET": "coordination.view_lock"}

    def get_queryset(self) -> QuerySet[Lock]:
        rows = Lock.objects.with_state().order_by("key")
        return access.for_request(self.request).filter(rows, "read", "key")

    @operation(
        operation_id="locks_list",
        responses={200: LockSerializer(many=True), **error_responses(404)},
    )
    def get(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        return super().get(request, *args, **kwargs)


@extend_schema(tags=["locks"], parameters=[KEY_PARAMETER])
class LockDetailView(CoordinationView):
    """One lock: its last token and its state by the database clock."""

    required_permissions = {"GET": "coordination.view_lock"}

    @operation(
        operation_id="locks_retrieve",
        summary="A lock's state",
        responses={200: LockSerializer, **error_responses(404)},
    )
    def get(self, request: Request, key: str) -> Response:
        key = path_key(key, "key")
        access.for_request(request).require("read", key)
        lock = Lock.objects.with_state().filter(key=key).first()
        if lock is None:
            raise Http404
        return Response(LockSerializer(lock).data)


@non_atomic
@extend_schema(tags=["locks"], parameters=[KEY_PARAMETER])
class AcquireView(CoordinationView):
    """Acquire a lease and a fencing token."""

    required_permissions = {"POST": "coordination.acquire_lock"}

    @operation(
        operation_id="locks_acquire",
        summary="Acquire a lease and a fencing token",
        description=(
            "Grants the lock to `holder` for `ttl` seconds of database time, with a token "
            "greater than every earlier token of the key. `lease_id` is returned only here: "
            "keep it secret, renew, release and fenced writes need it. A held lock answers "
            "409 `lock_held` with `holder`, `expires_at`, `retry_after` and a Retry-After header. "
            "`mode: shared` grants a reader: many at once, refused while a writer holds the key; "
            "a writer is refused while readers hold it, and its token is above theirs."
        ),
        request=LockAcquireRequest,
        responses={201: AcquiredGrantSerializer, **error_responses(409, 413, 415)},
    )
    def post(self, request: Request, key: str) -> Response:
        key = path_key(key, "key")
        access.for_request(request).require("acquire", key)
        body = validated(LockAcquireRequest, request.data)
        grant = (acquire_shared if body["mode"] == GrantMode.SHARED else locks.acquire)(
            key, holder=body["holder"], ttl=body["ttl"], wait=body["wait"]
        )
        return Response(AcquiredGrantSerializer(grant).data, status=status.HTTP_201_CREATED)


@non_atomic
@extend_schema(tags=["locks"], parameters=[KEY_PARAMETER])
class RenewView(CoordinationView):
    """Extend the current lease; needs its lease_id."""

    required_permissions = {"POST": "coordination.acquire_lock"}

    @operation(
        operation_id="locks_renew",
        summary="Extend the current lease",
        description="Needs the grant's `token` and `lease_id`; 409 `lease_lost` once the lease ended.",
        request=RenewRequest,
        responses={200: GrantSerializer, **error_responses(409, 413, 415)},
    )
    def post(self, request: Request, key: str) -> Response:
        key = path_key(key, "key")
        access.for_request(request).require("acquire", key)
        body = validated(RenewRequest, request.data)
        grant = locks.grant_from_proof(key, body["token"], body["lease_id"])
        grant = locks.renew(grant, ttl=body.get("ttl"))
        return Response(GrantSerializer(grant).data)


@non_atomic
@extend_schema(tags=["locks"], parameters=[KEY_PARAMETER])
class ReleaseView(CoordinationView):
    """End the current lease; needs its lease_id."""

    required_permissions = {"POST": "coordination.acquire_lock"}

    @operation(
        operation_id="locks_release",
        summary="End the current lease",
        description=(
            "Needs the grant's `token` and `lease_id`. 409 `lease_lost` if the lease already "
            "ended (an expired lease is closed and the lock freed before answering)."
        ),
        request=ReleaseRequest,
        responses={200: GrantSerializer, **error_responses(409, 413, 415)},
    )
    def post(self, request: Request, key: str) -> Response:
        key = path_key(key, "key")
        access.for_request(request).require("acquire", key)
        body = validated(ReleaseRequest, request.data)
        grant = locks.grant_from_proof(key, body["token"], body["lease_id"])
        return Response(GrantSerializer(locks.release(grant)).data)


@extend_schema(tags=["locks"], parameters=[KEY_PARAMETER])
class GrantListView(CoordinationListView):
    """The grant history of a lock, newest first."""

    serializer_class = GrantSerializer
    required_permissions = {"GET": "coordination.view_grant"}

    def get_queryset(self) -> QuerySet[Grant]:
        key = path_key(self.kwargs["key"], "key")
        access.for_request(self.request).require("read", key)
        lock = Lock.objects.filter(key=key).first()
        if lock is None:
            raise Http404
        return Grant.objects.filter(lock=lock).select_related("lock").order_by("-token")

    @operation(
        operation_id="locks_grants",
        responses={200: GrantSerializer(many=True), **error_responses(404)},
    )
    def get(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        return super().get(request, *args, **kwargs)
