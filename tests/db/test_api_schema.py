"""The OpenAPI schema validates, and a schema-driven fuzz run finds no server error.

schemathesis generates requests from ``/api/schema/`` (valid ones, then invalid
ones) and sends them to the WSGI app with the token of a user holding every
permission; every response must be a non-5xx whose status, content type and
body the schema documents. The example count is bounded to keep the run short,
and derandomised so that it is the same run every time.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from django.core.signals import request_finished, request_started
from django.core.wsgi import get_wsgi_application
from django.db import close_old_connections
from drf_spectacular.validation import validate_schema
from hypothesis import HealthCheck, given
from hypothesis import settings as hypothesis_settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from coordination import locks
from tests.support.api_support import ALL_PERMISSIONS, full_client, make_user, token_for

pytestmark = pytest.mark.django_db

CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]
EXAMPLES_PER_OPERATION = 20


def test_schema_validates_as_openapi_3() -> None:
    response = full_client().get("/api/schema/", HTTP_ACCEPT="application/json")
    assert response.status_code == 200
    schema = response.json()
    validate_schema(schema)
    assert schema["openapi"].startswith("3.")
    paths = set(schema["paths"])
    assert {
        "/api/locks/",
        "/api/locks/{key}",
        "/api/locks/{key}/acquire",
        "/api/locks/{key}/renew",
        "/api/locks/{key}/release",
        "/api/locks/{key}/grants",
        "/api/fences/",
        "/api/fences/{resource}",
        "/api/documents/{name}",
        "/api/rejections/",
    } <= paths


def test_schema_needs_authentication() -> None:
    from rest_framework.test import APIClient

    response = APIClient().get("/api/schema/?format=json")
    assert response.status_code == 401
    assert response.json()["code"] == "not_authenticated"
    assert response["WWW-Authenticate"] == "Token"


@pytest.fixture
def wsgi_app() -> Iterator[Any]:
    """The site's WSGI app, keeping the test's connection open across requests.

    Django's handler closes the connection at each request's start and end; the
    test client disconnects that, and so must a WSGI client inside a test transaction.
    """
    request_started.disconnect(close_old_connections)
    request_finished.disconnect(close_old_connections)
    try:
        yield get_wsgi_application()
    finally:
        request_started.connect(close_old_connections)
        request_finished.connect(close_old_connections)


@pytest.mark.legs(
    "pg",
    reason="a minute of generated requests; the other legs run the schema checks above",
)
def test_fuzzing_the_schema_finds_no_server_error(wsgi_app: Any, settings: Any) -> None:
    # Generated acquires of held keys would otherwise wait up to 30 s each.
    settings.COORDINATION = {**settings.COORDINATION, "API_MAX_WAIT": 0.1, "API_THROTTLE_RATE": None}
    user = make_user(*ALL_PERMISSIONS)
    auth = {"Authorization": f"Token {token_for(user)}"}
    # Some state to read, so reads of existing rows are generated too.
    grant = locks.acquire("fuzz", holder="seed", ttl=60)
    from coordination.documents import put_document

    put_document("fuzz", grant, {"seed": True})
    schema = schemathesis.openapi.from_wsgi(
        "/api/schema/?format=json", wsgi_app, headers=auth
    )
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 10
    failures: list[str] = []
    statuses: Counter[int] = Counter()
    for operation in operations:
        for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):
            _fuzz(operation, mode, auth, failures, statuses)
    assert not failures, "\n".join(failures)
    # The run reached the handlers, not only the gates in front of them.
    assert statuses[200] and statuses[201] and statuses[400], statuses
    assert sum(statuses.values()) >= len(operations) * EXAMPLES_PER_OPERATION


def _fuzz(
    operation: Any, mode: Any, auth: dict[str, str], failures: list[str], statuses: Counter[int]
) -> None:
    @given(case=operation.as_strategy(generation_mode=mode))
    @hypothesis_settings(
        max_examples=EXAMPLES_PER_OPERATION,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    def run(case: Any) -> None:
        response = case.call(headers=auth)
        statuses[response.status_code] += 1
        try:
            case.validate_response(response, checks=CHECKS, headers=auth)
        except Exception as error:  # collect every operation's failures, not only the first
            failures.append(f"{operation.label} [{mode.value}]: {error}"[:2000])

    run()
