"""URLs of the REST API; the project mounts them with ``path("api/", include("coordination.api.urls"))``.

Paths have no trailing slash except the collections (``locks/``, ``fences/``,
``rejections/``), as the API contract lists them.
"""

from __future__ import annotations

from django.contrib.auth.decorators import login_required
from django.urls import path, re_path
from drf_spectacular.views import SpectacularAPIView, SpectacularRedocView, SpectacularSwaggerView
from rest_framework.authentication import SessionAuthentication, TokenAuthentication
from rest_framework.permissions import IsAuthenticated

from . import views
from .exceptions import exception_handler

app_name = "coordination_api"


class SchemaView(SpectacularAPIView):
    """The OpenAPI 3 schema, for authenticated users (token or session)."""

    authentication_classes = [TokenAuthentication, SessionAuthentication]
    permission_classes = [IsAuthenticated]

    def get_exception_handler(self):  # type: ignore[no-untyped-def]
        return exception_handler


urlpatterns = [
    path("locks/", views.LockListView.as_view(), name="lock-list"),
    path("locks/<str:key>", views.LockDetailView.as_view(), name="lock-detail"),
    path("locks/<str:key>/acquire", views.AcquireView.as_view(), name="lock-acquire"),
    path("locks/<str:key>/renew", views.RenewView.as_view(), name="lock-renew"),
    path("locks/<str:key>/release", views.ReleaseView.as_view(), name="lock-release"),
    path("locks/<str:key>/grants", views.GrantListView.as_view(), name="lock-grants"),
    path("fences/", views.FenceListView.as_view(), name="fence-list"),
    path("fences/<str:resource>", views.FenceDetailView.as_view(), name="fence-detail"),
    path("documents/<str:name>", views.DocumentView.as_view(), name="document"),
    path("rejections/", views.RejectionListView.as_view(), name="rejection-list"),
    path("schema/", SchemaView.as_view(), name="schema"),
    # The interactive docs are for people in a browser: log in (admin) first. Their
    # JavaScript and CSS come from drf-spectacular-sidecar, served locally.
    path(
        "docs/",
        login_required(
            SpectacularSwaggerView.as_view(
                url_name="coordination_api:schema",
                authentication_classes=[SessionAuthentication],
                permission_classes=[IsAuthenticated],
            )
        ),
        name="docs",
    ),
    path(
        "docs/redoc/",
        login_required(
            SpectacularRedocView.as_view(
                url_name="coordination_api:schema",
                template_name="coordination/api/redoc.html",
                authentication_classes=[SessionAuthentication],
                permission_classes=[IsAuthenticated],
            )
        ),
        name="redoc",
    ),
    re_path(r"^(?P<rest>.*)$", views.no_endpoint, name="no-endpoint"),
]
