"""The API's OpenAPI schema and its interactive docs, independent of the site's settings.

- :class:`SchemaView` describes this API only (not the site's other DRF views),
  with its own title and spectacular settings, for any authenticated user.
- :class:`DocsView` (Swagger UI) and :class:`RedocView` take their JavaScript
  and CSS from ``drf_spectacular_sidecar`` (the ``[api-docs]`` extra), served
  by the site's static files: never from a CDN. Without that app in
  ``INSTALLED_APPS`` they answer 404 with what to install (system check
  ``coordination.W020`` says so too), instead of a page that loads from
  outside or a server error.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import wraps
from typing import Any

from django.apps import apps
from django.conf import global_settings, settings
from django.contrib.auth.views import redirect_to_login
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import resolve_url
from drf_spectacular.views import SpectacularAPIView, SpectacularRedocView, SpectacularSwaggerView
from rest_framework.authentication import SessionAuthentication, TokenAuthentication
from rest_framework.permissions import IsAuthenticated
from rest_framework.response import Response

from .. import __version__
from ..charsets import UNSUPPORTED_CHARSET, refusal_detail, undecodable_charset
from .exceptions import exception_handler
from .permissions import ThrottledRefusals
from .views.base import APIJSONRenderer

__all__ = ["DOCS_APP", "DocsView", "RedocView", "SchemaView", "coordination_endpoints", "docs_page"]

DOCS_APP = "drf_spectacular_sidecar"
TITLE = "coordination"
_SIDECAR_STATIC = "drf_spectacular_sidecar/"

# Applied while the schema is generated (drf-spectacular's per-view settings), so
# the site's SPECTACULAR_SETTINGS and its other endpoints do not leak into it.
SCHEMA_SETTINGS: dict[str, Any] = {
    "TITLE": TITLE,
    "DESCRIPTION": "Lease locks with fencing tokens, fences and a fenced document store.",
    "VERSION": __version__,
    "PREPROCESSING_HOOKS": ["coordination.api.schema.coordination_endpoints"],
    "POSTPROCESSING_HOOKS": ["drf_spectacular.hooks.postprocess_schema_enums"],
    "SCHEMA_PATH_PREFIX": None,
    "COMPONENT_SPLIT_REQUEST": False,
    "CAMELIZE_NAMES": False,
}


API_VIEWS_PACKAGE = "coordination.api.views"
"""The package of the API's views: the schema and docs views are not in it."""


def coordination_endpoints(endpoints: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """drf-spectacular preprocessing hook: this app's API views only.

    Drops the site's other DRF views (whose schema classes may not be
    drf-spectacular's) and the schema and docs views themselves.
    """
    return [
        endpoint
        for endpoint in endpoints
        if getattr(getattr(endpoint[3], "cls", None), "__module__", "").startswith(f"{API_VIEWS_PACKAGE}.")
    ]


class SchemaView(ThrottledRefusals, SpectacularAPIView):
    """The OpenAPI 3 schema of this API, for authenticated users (token or session)."""

    authentication_classes = [TokenAuthentication, SessionAuthentication]
    permission_classes = [IsAuthenticated]
    versioning_class = None
    schema = None  # describes the API; not part of it
    custom_settings = SCHEMA_SETTINGS

    def get_exception_handler(self) -> Callable[..., Response | None]:
        return exception_handler

    def handle_exception(self, exc: Exception) -> Response:
        # A refusal is JSON in the API's error shape, like every other answer under
        # the API: without this it would be rendered as the negotiated schema format
        # (YAML when the client sends no Accept header).
        response = super().handle_exception(exc)
        renderer = APIJSONRenderer()
        self.request.accepted_renderer = renderer
        self.request.accepted_media_type = renderer.media_type
        return response


class DocsView(SpectacularSwaggerView):
    """Swagger UI over :class:`SchemaView`, its assets from the sidecar app only."""

    authentication_classes = [SessionAuthentication]
    permission_classes = [IsAuthenticated]
    versioning_class = None
    schema = None  # describes the API; not part of it
    url_name = "coordination_api:schema"
    title = f"{TITLE} API"

    @staticmethod
    def _swagger_ui_resource(filename: str) -> str:
        return _sidecar_url(f"swagger-ui-dist/{filename}")

    @staticmethod
    def _swagger_ui_favicon() -> str:
        return _sidecar_url("swagger-ui-dist/favicon-32x32.png")


class RedocView(SpectacularRedocView):
    """Redoc over :class:`SchemaView`, its script from the sidecar app only, no web fonts."""

    authentication_classes = [SessionAuthentication]
    permission_classes = [IsAuthenticated]
    versioning_class = None
    schema = None  # describes the API; not part of it
    url_name = "coordination_api:schema"
    template_name = "coordination/api/redoc.html"
    title = f"{TITLE} API"

    @staticmethod
    def _redoc_standalone() -> str:
        return _sidecar_url("redoc/bundles/redoc.standalone.js")


def _sidecar_url(path: str) -> str:
    from django.templatetags.static import static

    return static(_SIDECAR_STATIC + path)


def docs_page(view: Callable[..., HttpResponse]) -> Callable[..., HttpResponse]:
    """A docs page for people in a browser: log in first, and only with local assets.

    Anonymous visitors are sent to the site's ``LOGIN_URL``, or to the admin's
    login page when the site kept Django's default (``/accounts/login/``, which a
    new project does not serve). A charset Django cannot decode text with is 415
    ``unsupported_charset`` first. Without ``drf_spectacular_sidecar`` installed the
    page answers 404 and says what to install.
    """

    @wraps(view)
    def page(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        charset = undecodable_charset(request.META.get("CONTENT_TYPE", ""))
        if charset is not None:  # before anything reads request.GET
            body = {"code": UNSUPPORTED_CHARSET, "detail": refusal_detail(charset)}
            return JsonResponse(body, status=415)
        if not apps.is_installed(DOCS_APP):
            detail = (
                "The API docs pages serve their JavaScript and CSS from the drf_spectacular_sidecar "
                "app, never from a CDN, and it is not installed. Install the extra "
                "(pip install 'django-coordination[api-docs]') and add \"drf_spectacular_sidecar\" "
                "to INSTALLED_APPS. The schema itself is at the schema/ endpoint next to this page."
            )
            return JsonResponse({"code": "not_found", "detail": detail}, status=404)
        if not request.user.is_authenticated:
            login_url = settings.LOGIN_URL
            if login_url == global_settings.LOGIN_URL:
                login_url = "admin:login"
            return redirect_to_login(request.get_full_path(), resolve_url(login_url))
        return view(request, *args, **kwargs)

    return page
