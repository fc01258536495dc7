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

from collections.abc import Callable
from typing import Any, TypeVar, cast

from django.db import transaction
from django.utils.decorators import method_decorator
from drf_spectacular.openapi import AutoSchema
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema
from rest_framework import generics, serializers
from rest_framework.authentication import SessionAuthentication, TokenAuthentication
from rest_framework.filters import BaseFilterBackend
from rest_framework.metadata import SimpleMetadata
from rest_framework.negotiation import DefaultContentNegotiation
from rest_framework.pagination import PageNumberPagination
from rest_framework.renderers import JSONRenderer
from rest_framework.request import Request
from rest_framework.response import Response

from ...conf import app_settings
from ...documents import NAME_MAX_LENGTH
from ...exceptions import InvalidInput
from ...models import KEY_MAX_LENGTH, KEY_PATTERN, validate_key
from ..exceptions import exception_handler
from ..parsers import StrictJSONParser
from ..permissions import ActionPermission, ThrottledRefusals, UserThrottle
from ..serializers import ErrorSerializer

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


def error_responses(*statuses: int) -> dict[int, OpenApiResponse]:
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


def path_key(value: str, field: str, *, max_length: int = KEY_MAX_LENGTH) -> str:
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


def validated(serializer_class: type[serializers.Serializer[Any]], data: Any) -> dict[str, Any]:
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
non_atomic = method_decorator(transaction.non_atomic_requests, name="dispatch")
