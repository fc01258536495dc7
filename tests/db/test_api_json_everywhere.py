"""Every answer under ``/api/`` is JSON in the API's error shape: the schema's
refusals whatever the client accepts, and paths asked for with or without a
trailing slash they do not have, for every method. A path without its slash is a
``308`` (the method and body are kept), never a ``301`` (clients turn a POST into
a GET on a 301 and then see the list)."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from django.test import Client
from django.urls import URLPattern
from rest_framework.test import APIClient

from coordination.api import urls as api_urls
from coordination.api import views as api_views
from coordination.models import Lock
from tests.support.api_support import full_client, post

pytestmark = pytest.mark.django_db

METHODS = ["get", "head", "options", "post", "put", "patch", "delete"]
CONVERTER = re.compile(r"<(?:\w+:)?(?P<name>\w+)>")


def api_routes() -> list[str]:
    """Every route of the API's URLconf as a concrete path (``<str:key>`` -> ``job-1``)."""
    routes = []
    for pattern in api_urls.urlpatterns:
        assert isinstance(pattern, URLPattern)
        if pattern.name == "no-endpoint":
            continue
        routes.append("/api/" + CONVERTER.sub(lambda match: f"{match['name']}-1", str(pattern.pattern)))
    return routes


def other_form(path: str) -> str:
    """The path with its trailing slash taken away, or added when it has none."""
    return path[:-1] if path.endswith("/") else path + "/"


def assert_json_error_shape(response: Any, method: str) -> dict[str, Any]:
    assert response["Content-Type"].startswith("application/json"), (
        method, response.status_code, response["Content-Type"], response.content[:200],
    )
    if method == "head":
        return {}
    body = json.loads(response.content)
    assert isinstance(body["code"], str) and isinstance(body["detail"], str), body
    return body


# --- the schema's refusals -------------------------------------------------------------


@pytest.mark.parametrize(
    "accept", [None, "application/vnd.oai.openapi", "application/vnd.oai.openapi+json", "*/*"]
)
def test_the_schema_refuses_an_anonymous_client_in_json_whatever_it_accepts(accept: str | None) -> None:
    headers = {} if accept is None else {"Accept": accept}

    response = Client().get("/api/schema/", headers=headers)

    assert response.status_code == 401
    assert response["Content-Type"] == "application/json"
    assert response.json()["code"] == "not_authenticated"
    assert response["WWW-Authenticate"].startswith("Token")


def test_the_schema_asked_for_as_html_is_refused_in_json() -> None:
    response = Client().get("/api/schema/", headers={"Accept": "text/html"})

    assert response.status_code == 406
    assert response["Content-Type"] == "application/json"
    assert response.json()["code"] == "not_acceptable"


def test_the_schema_refuses_a_wrong_method_in_json() -> None:
    response = full_client().post("/api/schema/", {}, format="json")

    assert response.status_code == 405
    assert response["Content-Type"] == "application/json"
    assert response.json()["code"] == "method_not_allowed"


def test_the_schema_itself_is_still_served_in_the_format_asked_for() -> None:
    client = full_client()

    yaml = client.get("/api/schema/")
    as_json = client.get("/api/schema/", headers={"Accept": "application/vnd.oai.openapi+json"})

    assert yaml.status_code == as_json.status_code == 200
    assert yaml["Content-Type"].startswith("application/vnd.oai.openapi")
    assert yaml.content.startswith(b"openapi: ")
    assert json.loads(as_json.content)["openapi"].startswith("3.")


# --- trailing slashes ---------------------------------------------------------------


def test_a_post_to_a_collection_without_its_slash_is_a_308_that_keeps_the_method() -> None:
    client = full_client()

    response = post(client, "/api/locks?x=1", {"key": "job:1"})

    assert response.status_code == 308
    assert response["Location"] == "/api/locks/?x=1"
    body = response.json()
    assert body["code"] == "permanent_redirect"
    assert body["location"] == "/api/locks/?x=1"
    assert not Lock.objects.exists()


def test_a_client_that_follows_the_redirect_repeats_the_post_and_is_told_the_method_is_wrong() -> None:
    response = post(full_client(), "/api/locks", {"key": "job:1"}, follow=True)

    assert response.redirect_chain == [("/api/locks/", 308)]
    assert response.status_code == 405  # a POST to the list, not a GET answered 200
    assert response.json()["code"] == "method_not_allowed"


@pytest.mark.parametrize("path", [other_form(route) for route in api_routes()])
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("who", ["anonymous", "authenticated"])
def test_every_api_path_in_its_other_slash_form_answers_json_and_never_301(
    path: str, method: str, who: str
) -> None:
    client = APIClient() if who == "anonymous" else full_client()

    response = getattr(client, method)(path, {}, format="json")

    assert response.status_code in {308, 404}, (path, method, response.status_code)
    body = assert_json_error_shape(response, method)
    if response.status_code == 308:
        assert path + "/" == response["Location"]
        assert body in ({}, {**body, "code": "permanent_redirect", "location": path + "/"})
    else:
        assert body in ({}, {**body, "code": "not_found"})


@pytest.mark.parametrize("method", METHODS)
def test_the_api_root_without_its_slash_answers_json_and_never_301(method: str) -> None:
    response = getattr(full_client(), method)("/api", {}, format="json")

    assert response.status_code == 404, response.status_code
    body = assert_json_error_shape(response, method)
    assert body in ({}, {**body, "code": "not_found"})


def test_the_sweep_covers_every_collection_and_the_schema() -> None:
    routes = api_routes()
    assert {"/api/locks/", "/api/fences/", "/api/rejections/", "/api/schema/"} <= set(routes)
    assert "/api/locks/key-1/acquire" in routes


# --- an error that is not a refusal ---------------------------------------------------


def break_the_lock_list(monkeypatch: pytest.MonkeyPatch) -> None:
    def fails(self: Any) -> Any:
        raise RuntimeError("a bug in the view")

    monkeypatch.setattr(api_views.LockListView, "get_queryset", fails)


def test_an_unexpected_error_is_a_json_500_with_its_traceback_logged(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, settings: Any
) -> None:
    settings.DEBUG = False
    break_the_lock_list(monkeypatch)
    client = full_client()
    client.raise_request_exception = False
    with caplog.at_level("ERROR", logger="django.request"):
        response = client.get("/api/locks/")

    assert response.status_code == 500
    assert assert_json_error_shape(response, "get")["code"] == "server_error"
    assert b"a bug in the view" not in response.content  # nothing of the error leaks out
    logged = [record for record in caplog.records if record.name == "django.request"]
    assert len(logged) == 1, [record.getMessage() for record in logged]  # logged once, not twice
    assert logged[0].exc_info is not None and logged[0].exc_info[0] is RuntimeError


def test_an_unexpected_error_still_reaches_error_reporters(
    monkeypatch: pytest.MonkeyPatch, settings: Any
) -> None:
    # got_request_exception is what error reporters (and Django's test client)
    # listen to: the client raises what the view raised.
    settings.DEBUG = False
    break_the_lock_list(monkeypatch)
    with pytest.raises(RuntimeError, match="a bug in the view"):
        full_client().get("/api/locks/")
