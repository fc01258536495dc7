"""The REST API behaves as documented whatever the site's own DRF and spectacular settings say.

A site that installs the app brings its own ``REST_FRAMEWORK`` (or none: DRF's
defaults, whose schema class drf-spectacular cannot use). The coordination views
set their own policies, so none of these settings changes what the API does.
"""

from __future__ import annotations

from typing import Any

import pytest
from django.test import override_settings
from rest_framework.test import APIClient

from ..support.api_support import full_client, make_user, post

pytestmark = pytest.mark.django_db

HOSTILE_REST_FRAMEWORK: dict[str, Any] = {
    "DEFAULT_SCHEMA_CLASS": "rest_framework.schemas.openapi.AutoSchema",  # DRF's own default
    "DEFAULT_AUTHENTICATION_CLASSES": ["rest_framework.authentication.BasicAuthentication"],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAdminUser"],
    "DEFAULT_RENDERER_CLASSES": ["rest_framework.renderers.BrowsableAPIRenderer"],
    "DEFAULT_PARSER_CLASSES": ["rest_framework.parsers.FormParser"],
    "DEFAULT_VERSIONING_CLASS": "rest_framework.versioning.URLPathVersioning",
    "DEFAULT_FILTER_BACKENDS": ["rest_framework.filters.OrderingFilter"],
    "DEFAULT_PAGINATION_CLASS": "rest_framework.pagination.LimitOffsetPagination",
    "DEFAULT_THROTTLE_CLASSES": ["rest_framework.throttling.AnonRateThrottle"],
    "DEFAULT_THROTTLE_RATES": {"anon": "1/day"},
    "NON_FIELD_ERRORS_KEY": "problems",
}
HOSTILE_SPECTACULAR = {
    "TITLE": "the site's other API",
    "SWAGGER_UI_DIST": "https://cdn.jsdelivr.net/npm/swagger-ui-dist@latest",
    "REDOC_DIST": "https://cdn.jsdelivr.net/npm/redoc@latest",
    "PREPROCESSING_HOOKS": [],
}


@pytest.fixture(autouse=True)
def hostile_site() -> Any:
    with override_settings(REST_FRAMEWORK=HOSTILE_REST_FRAMEWORK, SPECTACULAR_SETTINGS=HOSTILE_SPECTACULAR):
        yield


def test_token_acquire_and_release_work_under_the_sites_drf_defaults() -> None:
    client = full_client()
    acquired = post(client, "/api/locks/job:1/acquire", {"holder": "worker-1", "ttl": 30})
    assert acquired.status_code == 201, acquired.content
    assert acquired["Content-Type"] == "application/json"
    grant = acquired.json()
    proof = {"token": grant["token"], "lease_id": grant["lease_id"]}
    released = post(client, "/api/locks/job:1/release", proof)
    assert released.status_code == 200, released.content
    assert released.json()["end_reason"] == "released"


def test_refusals_keep_the_apis_error_shape() -> None:
    client = full_client()
    post(client, "/api/locks/job:1/acquire", {"holder": "a", "ttl": 30})
    held = post(client, "/api/locks/job:1/acquire", {"holder": "b", "ttl": 30})
    assert held.status_code == 409
    assert held.json()["code"] == "lock_held"
    anonymous = APIClient().get("/api/locks/")
    assert anonymous.status_code == 401
    assert anonymous["WWW-Authenticate"] == "Token"
    assert anonymous.json()["code"] == "not_authenticated"


def test_non_field_errors_keep_their_documented_key() -> None:
    response = post(full_client(), "/api/locks/job:1/acquire", ["not", "an", "object"])
    assert response.status_code == 400
    assert set(response.json()["errors"]) == {"non_field_errors"}


def test_lists_page_and_filter_as_documented() -> None:
    client = full_client()
    for key in ("b", "a", "c"):
        post(client, f"/api/locks/{key}/acquire", {"holder": "w", "ttl": 30})
    page = client.get("/api/locks/?page_size=2&ordering=-key").json()
    assert [lock["key"] for lock in page["results"]] == ["a", "b"]
    assert page["count"] == 3


def test_the_schema_describes_this_api_only() -> None:
    response = full_client().get("/api/schema/", HTTP_ACCEPT="application/json")
    assert response.status_code == 200, response.content
    schema = response.json()
    assert schema["info"]["title"] == "coordination"
    assert "/api/locks/{key}/acquire" in schema["paths"]
    assert all(path.startswith("/api/") for path in schema["paths"])
    assert "/api/schema/" not in schema["paths"]


@pytest.mark.parametrize("path", ["/api/docs/", "/api/docs/redoc/"])
def test_docs_pages_never_load_from_a_cdn(path: str) -> None:
    client = APIClient()
    client.force_login(make_user())
    page = client.get(path)
    assert page.status_code == 200
    html = page.content.decode()
    assert "/static/drf_spectacular_sidecar/" in html
    # Not a bare "cdn": the page's random CSRF token (letters and digits) holds one now and then.
    assert "cdn." not in html.lower()
    assert "jsdelivr" not in html.lower()
    assert "https://" not in html


@pytest.mark.parametrize("path", ["/api/docs/", "/api/docs/redoc/"])
def test_docs_pages_without_the_sidecar_app_answer_404_naming_the_extra(path: str, settings: Any) -> None:
    client = APIClient()
    client.force_login(make_user())
    apps = [app for app in settings.INSTALLED_APPS if app != "drf_spectacular_sidecar"]
    with override_settings(INSTALLED_APPS=apps):
        page = client.get(path)
    assert page.status_code == 404
    assert page["Content-Type"] == "application/json"
    assert page.json()["code"] == "not_found"
    text = page.json()["detail"]
    assert "django-coordination[api-docs]" in text
    assert '"drf_spectacular_sidecar"' in text
