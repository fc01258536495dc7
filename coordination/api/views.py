"""REST views: thin shells over :mod:`coordination.locks`, :mod:`coordination.documents`
and the models. No grant or fence logic lives here.

Every view authenticates (token first, so an anonymous request gets 401 with
``WWW-Authenticate: Token``), checks the Django permission of its action, then
the user's access rules for the key (:mod:`coordination.access`: 403
``key_forbidden`` before anything changes; lists leave out the keys the user
may not read), throttles per user, accepts only strict JSON and answers
refusals with ``{"code", "detail", ...}``.

The views set every policy DRF would otherwise take from the site's
``REST_FRAMEWORK`` setting (authentication, permissions, throttling, parsers,
renderers, content negotiation, versioning, filtering, pagination, the schema
class and the exception handler), so the API behaves as documented in any site,
whatever its own DRF defaults are.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from typing import Any, TypeVar, cast

from django.db import transaction
from django.db.models import QuerySet
from django.http import Http404, HttpRequest, HttpResponse, HttpResponsePermanentRedirect, JsonResponse
from django.urls import Resolver404, resolve
from django.utils.decorators import method_decorator
from django.views.decorators.csrf import csrf_exempt
from drf_spectacular.openapi import AutoSchema
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema
from rest_framework import generics, serializers, status
from rest_framework.authentication import SessionAuthentication, TokenAuthentication
from rest_framework.filters import BaseFilterBackend
from rest_framework.metadata import SimpleMetadata
from rest_framework.negotiation import DefaultContentNegotiation
from rest_framework.pagination import PageNumberPagination
from rest_framework.renderers import JSONRenderer
from rest_framework.request import Request
from rest_framework.response import Response

from .. import access, documents, fencing, locks
from ..conf import app_settings
from ..documents import NAME_MAX_LENGTH
from ..exceptions import (
    DuplicateWrite,
    IdempotencyKeyReused,
    InvalidInput,
    KeyForbidden,
    LeaseLost,
    StaleToken,
    WrongLock,
)
from ..models import (
    KEY_MAX_LENGTH,
    KEY_PATTERN,
    Document,
    Fence,
    Grant,
    GrantMode,
    Lock,
    Rejection,
    validate_key,
)
from ..semaphores import acquire_permit, permit_keys
from ..shared import acquire_shared
from .exceptions import exception_handler
from .parsers import StrictJSONParser
from .permissions import ActionPermission, ThrottledRefusals, UserThrottle
from .serializers import (
    AcquiredGrantSerializer,
    AcquiredPermitSerializer,
    AcquiredSetSerializer,
    DocumentSerializer,
    DocumentWrite,
    ErrorSerializer,
    FenceSerializer,
    GrantSerializer,
    LockAcquireRequest,
    LockSerializer,
    LockSetAcquireRequest,
    PermitAcquireRequest,
    RejectionFilter,
    RejectionSerializer,
    ReleaseRequest,
    RenewRequest,
)

IDEMPOTENCY_HEADER = "Idempotency-Key"
IDEMPOTENCY_KEY_MAX_LENGTH = 128
# What the fence answers a write it refuses; stored as the answer of an idempotent PUT.
FENCE_REFUSALS = (StaleToken, DuplicateWrite, WrongLock, LeaseLost)

_ERRORS = {
    400: "invalid (per-field `errors`), parse_error",
    401: "not_authenticated",
    403: "permission_denied (the action's Django permission), key_forbidden (access rules)",
    404: "not_found",
    409: "the coordination refusal named by `code`",
    413: "request_too_large",
    415: "unsupported_media_type",
    429: "throttled (see Retry-After)",
}


_Method = TypeVar("_Method", bound=Callable[..., Any])


def operation(**details: Any) -> Callable[[_Method], _Method]:
    """``extend_schema`` for a view method, extending drf-spectacular's ``AutoSchema``.

    drf-spectacular bases a method's schema on the site's ``DEFAULT_SCHEMA_CLASS``
    when the method names none, and DRF's default there is not a class it can
    use: the schema would fail with a server error in a site that does not set
    it. ``extend_schema`` looks at the method's ``schema`` attribute first.
    """
    annotate = extend_schema(**details)

    def decorator(method: _Method) -> _Method:
        setattr(method, "schema", AutoSchema)  # noqa: B010  (an attribute of a function)
        return annotate(method)

    return decorator


def _errors(*statuses: int) -> dict[int, OpenApiResponse]:
    common = (400, 401, 403, 429)
    return {
        code: OpenApiResponse(ErrorSerializer, description=_ERRORS[code])
        for code in sorted({*common, *statuses})
    }


def _name_parameter(name: str, max_length: int, description: str) -> OpenApiParameter:
    return OpenApiParameter(
        name,
        {"type": "string", "pattern": f"^{KEY_PATTERN.pattern}$", "maxLength": max_length},
        OpenApiParameter.PATH,
        description=description,
    )


KEY_PARAMETER = _name_parameter("key", KEY_MAX_LENGTH, "Lock key: letters, digits and . _ : @ -")
RESOURCE_PARAMETER = _name_parameter("resource", KEY_MAX_LENGTH, "Fence resource name.")
NAME_PARAMETER = _name_parameter("name", NAME_MAX_LENGTH, "Document name.")
NAME_OF_SEMAPHORE = _name_parameter(
    "name", KEY_MAX_LENGTH, "Semaphore name: its slots are the lock keys <name>@1 ... <name>@<limit>."
)


def _path_key(value: str, field: str, *, max_length: int = KEY_MAX_LENGTH) -> str:
    """A key from the URL, or 400 ``invalid`` naming the path parameter."""
    try:
        validate_key(value, what=field)
    except InvalidInput as error:
        raise serializers.ValidationError({field: [error.detail]}, code="invalid") from None
    if len(value) > max_length:
        raise serializers.ValidationError(
            {field: [f"{field} is {len(value)} characters long; at most {max_length}"]}, code="invalid"
        )
    return value


def _valid(serializer_class: type[serializers.Serializer[Any]], data: Any) -> dict[str, Any]:
    serializer = serializer_class(data=data)
    serializer.is_valid(raise_exception=True)
    return cast(dict[str, Any], serializer.validated_data)


class Pagination(PageNumberPagination):
    """``?page=`` and ``?page_size=`` (default ``COORDINATION["API_PAGE_SIZE"]``, at most 1000)."""

    page_size_query_param = "page_size"
    max_page_size = 1000

    def get_page_size(self, request: Request) -> int | None:
        self.page_size = int(app_settings.API_PAGE_SIZE)
        return super().get_page_size(request)


class APIJSONRenderer(JSONRenderer):
    """Compact UTF-8 JSON, never NaN: fixed here, not read from the site's ``REST_FRAMEWORK``."""

    ensure_ascii = False
    compact = True
    strict = True


class CoordinationView(ThrottledRefusals):
    """What every coordination endpoint shares: auth, permissions, throttling, strict JSON.

    Each policy is set here rather than inherited from ``REST_FRAMEWORK``: a site
    whose defaults are, say, basic auth, ``IsAdminUser``, form parsers, URL path
    versioning or DRF's own schema class must not change what this API does.
    """

    authentication_classes = [TokenAuthentication, SessionAuthentication]
    permission_classes = [ActionPermission]
    throttle_classes = [UserThrottle]
    parser_classes = [StrictJSONParser]
    renderer_classes = [APIJSONRenderer]
    content_negotiation_class = DefaultContentNegotiation
    metadata_class = SimpleMetadata
    versioning_class = None
    # drf-spectacular's inspector on every view, so /api/schema/ works without the
    # site setting DEFAULT_SCHEMA_CLASS (DRF's default class breaks the generator).
    schema = AutoSchema()
    required_permissions: dict[str, str] = {}

    def get_exception_handler(self) -> Callable[..., Response | None]:
        return exception_handler



class CoordinationListView(CoordinationView, generics.ListAPIView):  # type: ignore[type-arg]
    pagination_class = Pagination
    # The lists filter through their documented query parameters only; a site's
    # DEFAULT_FILTER_BACKENDS (ordering, search, django-filter) does not apply.
    filter_backends: list[type[BaseFilterBackend]] = []


# The grant point refuses to run inside a transaction, so these views must not be
# wrapped in one by ATOMIC_REQUESTS (system check coordination.W002 warns too).
_non_atomic = method_decorator(transaction.non_atomic_requests, name="dispatch")


# --- locks ---------------------------------------------------------------------------


@extend_schema(tags=["locks"])
class LockListView(CoordinationListView):
    """All locks with their state by the database clock, ordered by key."""

    serializer_class = LockSerializer
    required_permissions = {"GET": "coordination.view_lock"}

    def get_queryset(self) -> QuerySet[Lock]:
        rows = Lock.objects.with_state().order_by("key")
        return access.for_request(self.request).filter(rows, "read", "key")

    @operation(operation_id="locks_list", responses={200: LockSerializer(many=True), **_errors(404)})
    def get(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        return super().get(request, *args, **kwargs)


@extend_schema(tags=["locks"], parameters=[KEY_PARAMETER])
class LockDetailView(CoordinationView):
    """One lock: its last token and its state by the database clock."""

    required_permissions = {"GET": "coordination.view_lock"}

    @operation(
        operation_id="locks_retrieve",
        summary="A lock's state",
        responses={200: LockSerializer, **_errors(404)},
    )
    def get(self, request: Request, key: str) -> Response:
        key = _path_key(key, "key")
        access.for_request(request).require("read", key)
        lock = Lock.objects.with_state().filter(key=key).first()
        if lock is None:
            raise Http404
        return Response(LockSerializer(lock).data)


@_non_atomic
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
        responses={201: AcquiredGrantSerializer, **_errors(409, 413, 415)},
    )
    def post(self, request: Request, key: str) -> Response:
        key = _path_key(key, "key")
        access.for_request(request).require("acquire", key)
        body = _valid(LockAcquireRequest, request.data)
        grant = (acquire_shared if body["mode"] == GrantMode.SHARED else locks.acquire)(
            key, holder=body["holder"], ttl=body["ttl"], wait=body["wait"]
        )
        return Response(AcquiredGrantSerializer(grant).data, status=status.HTTP_201_CREATED)


@_non_atomic
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
        responses={201: AcquiredSetSerializer, **_errors(409, 413, 415)},
    )
    def post(self, request: Request) -> Response:
        body = _valid(LockSetAcquireRequest, request.data)
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


@_non_atomic
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
        responses={201: AcquiredPermitSerializer, **_errors(409, 413, 415)},
    )
    def post(self, request: Request, name: str) -> Response:
        name = _path_key(name, "name")
        body = _valid(PermitAcquireRequest, request.data)
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


@_non_atomic
@extend_schema(tags=["locks"], parameters=[KEY_PARAMETER])
class RenewView(CoordinationView):
    """Extend the current lease; needs its lease_id."""

    required_permissions = {"POST": "coordination.acquire_lock"}

    @operation(
        operation_id="locks_renew",
        summary="Extend the current lease",
        description="Needs the grant's `token` and `lease_id`; 409 `lease_lost` once the lease ended.",
        request=RenewRequest,
        responses={200: GrantSerializer, **_errors(409, 413, 415)},
    )
    def post(self, request: Request, key: str) -> Response:
        key = _path_key(key, "key")
        access.for_request(request).require("acquire", key)
        body = _valid(RenewRequest, request.data)
        grant = locks.grant_from_proof(key, body["token"], body["lease_id"])
        grant = locks.renew(grant, ttl=body.get("ttl"))
        return Response(GrantSerializer(grant).data)


@_non_atomic
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
        responses={200: GrantSerializer, **_errors(409, 413, 415)},
    )
    def post(self, request: Request, key: str) -> Response:
        key = _path_key(key, "key")
        access.for_request(request).require("acquire", key)
        body = _valid(ReleaseRequest, request.data)
        grant = locks.grant_from_proof(key, body["token"], body["lease_id"])
        return Response(GrantSerializer(locks.release(grant)).data)


@extend_schema(tags=["locks"], parameters=[KEY_PARAMETER])
class GrantListView(CoordinationListView):
    """The grant history of a lock, newest first."""

    serializer_class = GrantSerializer
    required_permissions = {"GET": "coordination.view_grant"}

    def get_queryset(self) -> QuerySet[Grant]:
        key = _path_key(self.kwargs["key"], "key")
        access.for_request(self.request).require("read", key)
        lock = Lock.objects.filter(key=key).first()
        if lock is None:
            raise Http404
        return Grant.objects.filter(lock=lock).select_related("lock").order_by("-token")

    @operation(operation_id="locks_grants", responses={200: GrantSerializer(many=True), **_errors(404)})
    def get(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        return super().get(request, *args, **kwargs)


# --- fences --------------------------------------------------------------------------


@extend_schema(tags=["fences"])
class FenceListView(CoordinationListView):
    """Every fence with its watermark, ordered by resource name."""

    serializer_class = FenceSerializer
    required_permissions = {"GET": "coordination.view_fence"}

    def get_queryset(self) -> QuerySet[Fence]:
        return access.for_request(self.request).filter(Fence.objects.order_by("resource"), "read", "lock_key")

    @operation(operation_id="fences_list", responses={200: FenceSerializer(many=True), **_errors(404)})
    def get(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        return super().get(request, *args, **kwargs)


@extend_schema(tags=["fences"], parameters=[RESOURCE_PARAMETER])
class FenceDetailView(CoordinationView):
    """One fence and its watermark."""

    required_permissions = {"GET": "coordination.view_fence"}

    @operation(
        operation_id="fences_retrieve",
        summary="A fence's watermark",
        responses={200: FenceSerializer, **_errors(404)},
    )
    def get(self, request: Request, resource: str) -> Response:
        resource = _path_key(resource, "resource")
        fence = Fence.objects.filter(resource=resource).first()
        # A fence of a key the rules do not let the user read is not there for them:
        # 403 would tell that the name exists, and which key guards it.
        if fence is None or not access.for_request(request).allows("read", fence.lock_key):
            raise Http404
        return Response(FenceSerializer(fence).data)


# --- documents -----------------------------------------------------------------------


@extend_schema(tags=["documents"], parameters=[NAME_PARAMETER])
class DocumentView(CoordinationView):
    """A document of the fenced store."""

    required_permissions = {
        "GET": "coordination.view_document",
        "PUT": "coordination.write_document",
    }

    @operation(
        operation_id="documents_retrieve",
        summary="Read a document",
        responses={200: DocumentSerializer, **_errors(404)},
    )
    def get(self, request: Request, name: str) -> Response:
        name = _path_key(name, "name", max_length=NAME_MAX_LENGTH)
        try:
            document = documents.get_document(name)
        except Document.DoesNotExist:
            raise Http404 from None
        # As for fences: a document bound to a key the user may not read is absent.
        if not access.for_request(request).allows("read", document.fence.lock_key):
            raise Http404
        return Response(DocumentSerializer(document).data)

    @operation(
        operation_id="documents_write",
        summary="Fenced write of a document",
        description=(
            "Writes `data` if the grant (`lock_key`, `token`, proven by `lease_id`) passes the "
            "document's fence; the check and the write are one transaction. Refusals: 409 "
            "`stale_token` (with `current_token`), `duplicate_write` (same token and step; "
            "number several writes with `step`), `wrong_lock`, `lease_lost` (the lease_id does "
            "not match that grant). With an `Idempotency-Key` header a retry returns the "
            "stored response, a refusal included (header `Idempotent-Replayed: true`)."
        ),
        parameters=[
            OpenApiParameter(
                IDEMPOTENCY_HEADER,
                {"type": "string", "minLength": 1, "maxLength": IDEMPOTENCY_KEY_MAX_LENGTH},
                OpenApiParameter.HEADER,
                description="Makes a retried PUT return the stored response instead of writing again.",
            )
        ],
        request=DocumentWrite,
        responses={200: DocumentSerializer, **_errors(409, 413, 415)},
    )
    def put(self, request: Request, name: str) -> Response:
        name = _path_key(name, "name", max_length=NAME_MAX_LENGTH)
        idempotency_key = _idempotency_key(request)
        body = _valid(DocumentWrite, request.data)
        # The grant's key is the one a new document is bound to (and the one an
        # existing document must be bound to, which the fence checks).
        rules = access.for_request(request)
        rules.require("write", body["lock_key"])
        grant = locks.grant_from_proof(body["lock_key"], body["token"], body["lease_id"])

        def bound_within_rules(bound: str) -> None:
            # Checked under the fence's row lock, before the fence's own wrong_lock:
            # that would name a key outside the user's rules, and record a rejection
            # carrying its watermark. Read before the lock, the binding could be
            # made by another writer in between (two first writes racing).
            if not rules.allows("write", bound):
                raise KeyForbidden(
                    f"document {name!r} is bound to a lock key your access rules do not allow "
                    "you to write with (docs/access-rules.md)", action="write",
                )

        def write() -> dict[str, Any]:
            document = documents.put_document(
                name, grant, body["data"], step=body.get("step"),
                key_check=bound_within_rules if rules.limited else None,
            )
            return dict(DocumentSerializer(document).data)

        if idempotency_key is None:
            return Response(write())
        ran = False
        fingerprint = _fingerprint(name, body)

        def write_once() -> dict[str, Any]:
            nonlocal ran
            ran = True
            try:
                return {"request": fingerprint, "status": 200, "response": write()}
            except FENCE_REFUSALS as refusal:
                # A refusal is final for this write, so it is the stored answer too:
                # the retry gets it again, and the rejection record commits with it
                # (on SQLite it would otherwise roll back with this transaction).
                return {"request": fingerprint, "status": refusal.status_code, "response": refusal.as_dict()}

        # Scoped per user and document; hashed to fit the record's 255 characters.
        scope = f"{request.user.pk}\0{name}\0{idempotency_key}".encode()
        scoped = f"coordination.api.document:{hashlib.sha256(scope).hexdigest()}"
        stored = fencing.idempotent(scoped, write_once)
        if stored["request"] != fingerprint:
            raise IdempotencyKeyReused()
        headers = {} if ran else {"Idempotent-Replayed": "true"}
        return Response(stored["response"], status=stored["status"], headers=headers)


def _idempotency_key(request: Request) -> str | None:
    value = request.headers.get(IDEMPOTENCY_HEADER)
    if value is None:
        return None
    if not 0 < len(value) <= IDEMPOTENCY_KEY_MAX_LENGTH or not value.isprintable() or not value.isascii():
        raise serializers.ValidationError(
            {IDEMPOTENCY_HEADER: [f"Must be 1 to {IDEMPOTENCY_KEY_MAX_LENGTH} printable ASCII characters."]},
            code="invalid",
        )
    return value


def _fingerprint(name: str, body: dict[str, Any]) -> str:
    canonical = json.dumps({"name": name, **body}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


# --- rejections ----------------------------------------------------------------------


@extend_schema(tags=["rejections"])
class RejectionListView(CoordinationListView):
    """Refused writes, newest first."""

    serializer_class = RejectionSerializer
    required_permissions = {"GET": "coordination.view_rejection"}

    def get_queryset(self) -> QuerySet[Rejection]:
        filters = _valid(RejectionFilter, self.request.query_params)
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
        responses={200: RejectionSerializer(many=True), **_errors(404)},
    )
    def get(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        return super().get(request, *args, **kwargs)


# --- anything else under the API -------------------------------------------------------


@csrf_exempt
def no_endpoint(request: HttpRequest, rest: str = "") -> HttpResponse:
    """Unknown paths under the API get the API's error shape, not an HTML page,
    for every method.

    Exempt from the CSRF check, as the API's views are (they authenticate by
    token, or check CSRF themselves for a session): it changes nothing, and a
    POST or PUT to a wrong path must learn that the path is wrong, not that a
    CSRF cookie is missing. A path asked for without its trailing slash
    (``/api/locks``) is redirected to it with ``308 Permanent Redirect``, which
    keeps the method and body (a 301 turns a POST into a GET in most clients),
    and a JSON body in the error shape naming the ``location``.
    """
    if not request.path.endswith("/"):
        try:
            match = resolve(request.path + "/")
        except Resolver404:
            match = None
        if match is not None and match.url_name != "no-endpoint":
            query = request.META.get("QUERY_STRING", "")
            location = request.path + "/" + (f"?{query}" if query else "")
            body = {
                "code": "permanent_redirect",
                "detail": f"The endpoint is at {request.path}/ (with a trailing slash); "
                "repeat the request there.",
                "location": location,
            }
            return HttpResponsePermanentRedirect(
                location, preserve_request=True, content=json.dumps(body), content_type="application/json"
            )
    detail = f"No API endpoint at {request.path}; the OpenAPI schema lists them all."
    return JsonResponse({"code": "not_found", "detail": detail}, status=404)
