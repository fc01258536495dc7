"""The hostile-input suite: bad input is a 4xx with a code and a clear message, never
a 5xx, and changes nothing.

Each case starts from the same state (a held lock and a written document), sends
one bad request with an otherwise valid proof, and checks the status, the code
and that every table the API can touch is exactly as before. Beyond the body
and path of each endpoint it covers the site's limits (Django's upload limits,
unknown paths for every method, error size, nesting), anonymous throttling,
log lines a client-chosen value could forge, and the admin's own URLs.

Every request the module sends is counted (tests/support/hostile.py): the run
ends with one line, ``hostile inputs (test_api_input): N requests; answers:
...; 5xx seen: 0``, and fails if any request got a 5xx.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from django.db import connection
from rest_framework.test import APIClient

from coordination.api.serializers import data_max_depth
from coordination.models import Document, Fence, Grant, IdempotencyRecord, Lock, Rejection
from tests.support.api_support import full_client, post, put
from tests.support.hostile import tally_requests  # noqa: F401  (the module's fixture)

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("tally_requests")]

MAX_TOKEN = 2**63 - 1


def database_state() -> tuple[list[Any], ...]:
    return (
        list(Lock.objects.order_by("key").values_list("key", "token", "holder", "lease_hash", "expires_at")),
        list(Grant.objects.order_by("pk").values_list("lock_id", "token", "expires_at", "ended_at")),
        list(Fence.objects.order_by("resource").values_list("resource", "lock_key", "token", "step")),
        list(Document.objects.order_by("name").values_list("name", "data", "updated_at")),
        list(Rejection.objects.values_list("pk")),
        list(IdempotencyRecord.objects.values_list("key", "completed")),
    )


@pytest.fixture
def setup() -> tuple[APIClient, dict[str, Any]]:
    client = full_client()
    response = post(client, "/api/locks/job:1/acquire", {"holder": "worker-1", "ttl": 60})
    grant = response.json()
    body = {"lock_key": "job:1", "token": grant["token"], "lease_id": grant["lease_id"], "data": 1}
    assert put(client, "/api/documents/doc", {**body, "step": 1}).status_code == 200
    return client, grant


def send_json(client: APIClient, method: str, path: str, raw: bytes, **extra: Any) -> Any:
    return getattr(client, method)(path, data=raw, content_type="application/json", **extra)


def assert_refused(response: Any, status: int, code: str, before: Any, field: str | None = None) -> None:
    assert response.status_code == status, response.content
    body = response.json()
    assert body["code"] == code, body
    assert isinstance(body["detail"], str) and body["detail"]
    if field is not None:
        assert field in body["errors"], body
    assert database_state() == before


WRONG_TYPES_FOR_INTEGERS = ["1", 1.5, 1.0, True, None, {"v": 1}, [1]]
BAD_TOKENS = [*WRONG_TYPES_FOR_INTEGERS, 0, -1, 2**63, 2**64, MAX_TOKEN * 10, 10**400, -(10**400)]
BAD_SECONDS = ["1", True, None, {"v": 1}, [1], 0, -1, 10**9, 10**400, -(10**400)]
BAD_HOLDERS = [1, True, None, {"v": 1}, ["a"], "", "   ", "x" * 201, "tab\there", "nul\x00"]


# --- acquire ---------------------------------------------------------------------------


@pytest.mark.parametrize("holder", BAD_HOLDERS)
def test_acquire_refuses_a_bad_holder(setup: Any, holder: Any) -> None:
    client, _ = setup
    before = database_state()
    response = post(client, "/api/locks/free-key/acquire", {"holder": holder, "ttl": 5})
    assert_refused(response, 400, "invalid", before, "holder")


@pytest.mark.parametrize("ttl", BAD_SECONDS)
def test_acquire_refuses_a_bad_ttl(setup: Any, ttl: Any) -> None:
    client, _ = setup
    before = database_state()
    response = post(client, "/api/locks/free-key/acquire", {"holder": "h", "ttl": ttl})
    assert_refused(response, 400, "invalid", before, "ttl")


@pytest.mark.parametrize("wait", ["0", True, None, -1, 10**6])
def test_acquire_refuses_a_bad_wait(setup: Any, wait: Any) -> None:
    client, _ = setup
    before = database_state()
    response = post(client, "/api/locks/free-key/acquire", {"holder": "h", "ttl": 5, "wait": wait})
    assert_refused(response, 400, "invalid", before, "wait")


@pytest.mark.parametrize(
    "raw",
    [
        b'{"holder": "h", "ttl": NaN}',
        b'{"holder": "h", "ttl": Infinity}',
        b'{"holder": "h", "ttl": -Infinity}',
    ],
)
def test_non_finite_numbers_are_malformed_json(setup: Any, raw: bytes) -> None:
    client, _ = setup
    before = database_state()
    response = send_json(client, "post", "/api/locks/free-key/acquire", raw)
    assert_refused(response, 400, "parse_error", before)


def test_a_number_too_large_for_a_float_is_invalid(setup: Any) -> None:
    client, _ = setup
    before = database_state()
    response = send_json(client, "post", "/api/locks/free-key/acquire", b'{"holder": "h", "ttl": 1e400}')
    assert_refused(response, 400, "invalid", before, "ttl")


@pytest.mark.parametrize(
    "raw",
    [
        b'{"holder": "h", "ttl": 5',
        b"{'holder': 'h'}",
        b'{"holder": "h", "ttl": 5} trailing',
        b'{"holder": "h", "holder": "again", "ttl": 5}',
        b"\xff\xfe not utf-8",
        b"[" * 100_000,
    ],
    ids=["truncated", "single-quotes", "trailing", "duplicate-key", "not-utf8", "deeply-nested"],
)
def test_malformed_json_is_a_parse_error(setup: Any, raw: bytes) -> None:
    client, _ = setup
    before = database_state()
    response = send_json(client, "post", "/api/locks/free-key/acquire", raw)
    assert_refused(response, 400, "parse_error", before)


@pytest.mark.parametrize("raw", [b"[]", b"null", b"1", b'"text"', b"true"])
def test_a_body_that_is_not_an_object_is_invalid(setup: Any, raw: bytes) -> None:
    client, _ = setup
    before = database_state()
    response = send_json(client, "post", "/api/locks/free-key/acquire", raw)
    assert_refused(response, 400, "invalid", before)


def test_an_empty_body_names_the_missing_fields(setup: Any) -> None:
    client, _ = setup
    before = database_state()
    response = send_json(client, "post", "/api/locks/free-key/acquire", b"")
    assert_refused(response, 400, "invalid", before)
    assert set(response.json()["errors"]) == {"holder", "ttl"}


def test_unknown_fields_are_refused_with_the_other_errors(setup: Any) -> None:
    client, _ = setup
    before = database_state()
    response = post(client, "/api/locks/free-key/acquire", {"holder": "h", "ttl": "5", "tll": 5})
    assert_refused(response, 400, "invalid", before)
    assert response.json()["errors"]["tll"] == ["Unknown field."]
    assert "ttl" in response.json()["errors"]


def test_an_oversized_body_is_413(setup: Any, settings: Any) -> None:
    settings.COORDINATION = {**settings.COORDINATION, "API_MAX_BODY_BYTES": 1000}
    client, grant = setup
    before = database_state()
    body = {"lock_key": "job:1", "token": grant["token"], "lease_id": grant["lease_id"], "step": 2}
    response = put(client, "/api/documents/doc", {**body, "data": "x" * 2000})
    assert_refused(response, 413, "request_too_large", before)


def test_a_form_body_is_415(setup: Any) -> None:
    client, _ = setup
    before = database_state()
    response = client.post("/api/locks/free-key/acquire", {"holder": "h", "ttl": "5"})
    assert_refused(response, 415, "unsupported_media_type", before)


@pytest.mark.parametrize(
    "key",
    ["x" * 201, "-starts-with-dash", "has%20space", "tab%09", "caf%C3%A9", "semi;colon", "a%2Fb", "q%3Fx"],
)
def test_bad_keys_in_the_path_are_invalid(setup: Any, key: str) -> None:
    client, _ = setup
    before = database_state()
    response = post(client, f"/api/locks/{key}/acquire", {"holder": "h", "ttl": 5})
    if response.status_code == 404:  # a key with "/" never reaches the view: no such path
        assert response.json()["code"] == "not_found"
        assert database_state() == before
        return
    assert_refused(response, 400, "invalid", before, "key")


# --- renew, release --------------------------------------------------------------------


@pytest.mark.parametrize("action", ["renew", "release"])
@pytest.mark.parametrize("token", BAD_TOKENS, ids=repr)
def test_renew_and_release_refuse_a_bad_token(setup: Any, action: str, token: Any) -> None:
    client, grant = setup
    before = database_state()
    response = post(client, f"/api/locks/job:1/{action}", {"token": token, "lease_id": grant["lease_id"]})
    assert_refused(response, 400, "invalid", before, "token")


@pytest.mark.parametrize("action", ["renew", "release"])
@pytest.mark.parametrize("lease_id", [1, None, True, "", ["x"], "x" * 129])
def test_renew_and_release_refuse_a_bad_lease_id(setup: Any, action: str, lease_id: Any) -> None:
    client, grant = setup
    before = database_state()
    response = post(client, f"/api/locks/job:1/{action}", {"token": grant["token"], "lease_id": lease_id})
    assert_refused(response, 400, "invalid", before, "lease_id")


def test_renew_refuses_a_bad_ttl(setup: Any) -> None:
    client, grant = setup
    before = database_state()
    body = {"token": grant["token"], "lease_id": grant["lease_id"], "ttl": -5}
    assert_refused(post(client, "/api/locks/job:1/renew", body), 400, "invalid", before, "ttl")


# --- documents -----------------------------------------------------------------------


def document_body(grant: dict[str, Any], **changes: Any) -> dict[str, Any]:
    body = {"lock_key": "job:1", "token": grant["token"], "lease_id": grant["lease_id"], "data": 2, "step": 2}
    body.update(changes)
    return {name: value for name, value in body.items() if value is not ...}


@pytest.mark.parametrize("token", BAD_TOKENS, ids=repr)
def test_document_put_refuses_a_bad_token(setup: Any, token: Any) -> None:
    client, grant = setup
    before = database_state()
    response = put(client, "/api/documents/doc", document_body(grant, token=token))
    assert_refused(response, 400, "invalid", before, "token")


@pytest.mark.parametrize("step", [*WRONG_TYPES_FOR_INTEGERS, 0, -1, 2**63])
def test_document_put_refuses_a_bad_step(setup: Any, step: Any) -> None:
    client, grant = setup
    before = database_state()
    response = put(client, "/api/documents/doc", document_body(grant, step=step))
    assert_refused(response, 400, "invalid", before, "step")


@pytest.mark.parametrize("lock_key", [1, None, "", "bad key", "x" * 201, "-x"])
def test_document_put_refuses_a_bad_lock_key(setup: Any, lock_key: Any) -> None:
    client, grant = setup
    before = database_state()
    response = put(client, "/api/documents/doc", document_body(grant, lock_key=lock_key))
    assert_refused(response, 400, "invalid", before, "lock_key")


@pytest.mark.parametrize("missing", ["lock_key", "token", "lease_id", "data"])
def test_document_put_names_a_missing_field(setup: Any, missing: str) -> None:
    client, grant = setup
    before = database_state()
    response = put(client, "/api/documents/doc", document_body(grant, **{missing: ...}))
    assert_refused(response, 400, "invalid", before, missing)


def test_document_put_refuses_unknown_fields(setup: Any) -> None:
    client, grant = setup
    before = database_state()
    response = put(client, "/api/documents/doc", document_body(grant, fence=99))
    assert_refused(response, 400, "invalid", before, "fence")


@pytest.mark.parametrize("name", ["x" * 192, "-dash", "sp%20ace"])
def test_document_names_follow_the_key_rule(setup: Any, name: str) -> None:
    client, grant = setup
    before = database_state()
    response = put(client, f"/api/documents/{name}", document_body(grant))
    assert_refused(response, 400, "invalid", before, "name")
    assert client.get(f"/api/documents/{name}").status_code == 400


@pytest.mark.parametrize("value", ["", "x" * 129, "caf\u00e9"])
def test_a_bad_idempotency_key_is_invalid(setup: Any, value: str) -> None:
    client, grant = setup
    before = database_state()
    response = client.generic(
        "PUT",
        "/api/documents/doc",
        json.dumps(document_body(grant)).encode(),
        content_type="application/json",
        headers={"Idempotency-Key": value},
    )
    assert_refused(response, 400, "invalid", before, "Idempotency-Key")


@pytest.mark.parametrize(
    "raw",
    [b'{"lock_key": "job:1", "token": 1, "lease_id": "x", "data": NaN}', b'{"data": 1, "data": 2}'],
)
def test_document_data_must_be_strict_json(setup: Any, raw: bytes) -> None:
    client, _ = setup
    before = database_state()
    assert_refused(send_json(client, "put", "/api/documents/doc", raw), 400, "parse_error", before)


# --- reads ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path",
    ["/api/locks/-bad", "/api/locks/" + "x" * 201, "/api/fences/bad%20name", "/api/locks/-bad/grants"],
)
def test_reads_with_bad_names_are_invalid(setup: Any, path: str) -> None:
    client, _ = setup
    response = client.get(path)
    assert response.status_code == 400
    assert response.json()["code"] == "invalid"


@pytest.mark.parametrize("query", ["page=0", "page=abc", "page=999"])
def test_a_bad_page_is_404(setup: Any, query: str) -> None:
    client, _ = setup
    response = client.get(f"/api/locks/?{query}")
    assert response.status_code == 404
    assert response.json()["code"] == "not_found"


def test_an_unsupported_method_is_405_with_a_code(setup: Any) -> None:
    client, _ = setup
    response = client.delete("/api/locks/job:1")
    assert response.status_code == 405
    assert response.json()["code"] == "method_not_allowed"
    assert Lock.objects.filter(key="job:1").exists()


def test_unknown_paths_under_the_api_are_404_in_the_error_shape(setup: Any) -> None:
    client, _ = setup
    response = client.get("/api/nothing/here")
    assert response.status_code == 404
    assert response.json()["code"] == "not_found"


def test_a_collection_without_its_slash_redirects_keeping_the_method(setup: Any) -> None:
    client, _ = setup
    response = client.get("/api/locks?page_size=1")
    assert response.status_code == 308
    assert response["Location"] == "/api/locks/?page_size=1"
    assert response.json()["code"] == "permanent_redirect"


@pytest.mark.parametrize(
    "raw_data",
    [b'"nul\\u0000"', b'{"k\\u0000": 1}', b'"\\ud800"', b'{"\\udfff": 1}', b"[" * 102 + b"]" * 102],
    ids=["nul", "nul-in-key", "lone-surrogate", "surrogate-key", "too-deep"],
)
def test_document_data_a_json_column_cannot_store_is_invalid(setup: Any, raw_data: bytes) -> None:
    client, grant = setup
    before = database_state()
    body = json.dumps(document_body(grant, data=...))[:-1].encode() + b', "data": ' + raw_data + b"}"
    response = send_json(client, "put", "/api/documents/doc", body)
    assert_refused(response, 400, "invalid", before, "data")


# --- nesting: the limit is 100 levels (31 on MariaDB) --------------------------------


@pytest.mark.parametrize(("over", "accepted"), [(0, True), (1, False)])
def test_document_data_nests_at_most_100_levels(setup: Any, over: int, accepted: bool) -> None:
    client, grant = setup
    limit = data_max_depth()
    assert limit == (31 if connection.vendor == "mysql" else 100)
    levels = limit + over
    before = database_state()
    raw = b"[" * levels + b"]" * levels
    body = json.dumps(document_body(grant, data=...))[:-1].encode() + b', "data": ' + raw + b"}"
    response = send_json(client, "put", "/api/documents/doc", body)
    if accepted:
        assert response.status_code == 200, response.content
        assert Document.objects.get(name="doc").data == json.loads(raw)
    else:
        assert_refused(response, 400, "invalid", before, "data")
        assert f"{limit} levels" in response.json()["errors"]["data"][0]


# --- error responses are bounded -------------------------------------------------------


def test_sixty_thousand_unknown_fields_get_a_small_answer(setup: Any) -> None:
    client, _ = setup
    before = database_state()
    raw = json.dumps({"holder": "", "ttl": 5, **{f"f{number}": 0 for number in range(60_000)}})
    assert len(raw) < 1_048_576  # under API_MAX_BODY_BYTES: it is parsed

    response = send_json(client, "post", "/api/locks/free-key/acquire", raw.encode())

    assert_refused(response, 400, "invalid", before, "holder")
    body = response.json()
    assert len(response.content) < 8_000, len(response.content)
    assert len(body["errors"]) == 20
    assert body["errors_omitted"] == 60_001 - 20  # the unknown fields and holder, less those shown
    assert "more fields not listed" in body["detail"]


@pytest.mark.parametrize(
    "body",
    [
        {"holder": "h", "ttl": 5, "x" * 500_000: 1},
        {"holder": ["h"] * 100_000, "ttl": 5},
        {"holder": {f"k{n}": "v" for n in range(50_000)}, "ttl": 5},
        {"holder": "h", "ttl": 5, "wait": [[[[[[[[[[1]]]]]]]]]] * 10_000},
    ],
    ids=["long-field-name", "long-list", "wide-object", "deep-list"],
)
def test_error_answers_stay_small_whatever_the_body(setup: Any, body: dict[str, Any]) -> None:
    client, _ = setup
    before = database_state()
    response = post(client, "/api/locks/free-key/acquire", body)
    assert_refused(response, 400, "invalid", before)
    assert len(response.content) < 8_000, len(response.content)


# --- Django's own upload limits: 413 in the error shape -------------------------------


@pytest.fixture
def session_client(setup: Any) -> APIClient:
    """A logged-in browser session whose CSRF check runs (and reads a form body)."""
    from django.contrib.auth.models import User

    client = APIClient(enforce_csrf_checks=True)
    client.force_login(User.objects.create_user("browser", is_superuser=True))
    client.cookies["csrftoken"] = "a" * 32
    return client


def test_a_body_over_djangos_memory_limit_is_413(setup: Any, settings: Any) -> None:
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 1000  # below API_MAX_BODY_BYTES: Django's refuses first
    client, _ = setup
    before = database_state()
    response = post(client, "/api/locks/free-key/acquire", {"holder": "h" * 100, "ttl": 5, "x": "y" * 2000})
    assert_refused(response, 413, "request_too_large", before)


def test_more_query_parameters_than_django_allows_is_413(setup: Any, settings: Any) -> None:
    client, _ = setup
    query = "&".join(f"f{number}=1" for number in range(settings.DATA_UPLOAD_MAX_NUMBER_FIELDS + 1))
    before = database_state()
    assert_refused(client.get(f"/api/locks/?{query}"), 413, "request_too_large", before)


@pytest.mark.parametrize("size", ["fields", "bytes"])
def test_a_form_too_large_for_django_to_an_unknown_path_is_404(
    session_client: APIClient, settings: Any, size: str
) -> None:
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 1000
    before = database_state()
    form = "&".join(f"f{n}=1" for n in range(1001)) if size == "fields" else "a=" + "x" * 2000
    response = session_client.generic(
        "POST", "/api/nothing", form, content_type="application/x-www-form-urlencoded"
    )
    assert_refused(response, 404, "not_found", before)


# --- unknown paths: 404 in the error shape for every method -----------------------------


UNKNOWN_PATHS = [
    "/api/nothing", "/api/locks/job:1/steal", "/api/locks/job:1/acquire/more", "/api/documents/",
    "/api/admin/", "/api/locks/job:1/grants/1",
]


@pytest.mark.parametrize("path", UNKNOWN_PATHS)
@pytest.mark.parametrize("method", ["POST", "PUT", "PATCH", "DELETE", "GET", "OPTIONS"])
def test_unknown_paths_are_404_for_every_method_even_without_csrf(
    session_client: APIClient, method: str, path: str
) -> None:
    before = database_state()
    response = session_client.generic(method, path, b'{"holder": "h"}', content_type="application/json")
    assert_refused(response, 404, "not_found", before)


# --- anonymous clients are throttled ---------------------------------------------------


@pytest.mark.parametrize(
    "credentials", [{}, {"HTTP_AUTHORIZATION": "Token wrong"}], ids=["no-credentials", "wrong-token"]
)
def test_anonymous_requests_are_throttled_per_address(
    setup: Any, settings: Any, credentials: dict[str, str]
) -> None:
    settings.COORDINATION = {**settings.COORDINATION, "API_ANON_THROTTLE_RATE": "3/minute"}
    client, _ = setup
    anonymous = APIClient()
    before = database_state()
    for _ in range(3):
        response = post(anonymous, "/api/locks/job:1/acquire", {"holder": "h", "ttl": 5}, **credentials)
        assert_refused(response, 401, "not_authenticated", before)

    response = post(anonymous, "/api/locks/job:1/acquire", {"holder": "h", "ttl": 5}, **credentials)

    assert_refused(response, 429, "throttled", before)
    assert int(response["Retry-After"]) > 0
    assert anonymous.get("/api/schema/", **credentials).status_code == 429  # the schema too
    # Another address, and authenticated clients, are not held back.
    other = post(anonymous, "/api/locks/job:1", {}, REMOTE_ADDR="10.0.0.9", **credentials)
    assert other.status_code == 401
    assert client.get("/api/locks/job:1").status_code == 200


# --- log lines: a client-chosen value cannot forge a field ----------------------------------


def logfmt(line: str) -> dict[str, str]:
    """Parse ``name=value`` pairs as log tools do: a value is bare, or a JSON string."""
    fields: dict[str, str] = {}
    decoder = json.JSONDecoder()
    position = 0
    while position < len(line):
        if line[position] == " ":
            position += 1
            continue
        equals = line.index("=", position)
        name = line[position:equals]
        if line[equals + 1 : equals + 2] == '"':
            value, position = decoder.raw_decode(line, equals + 1)
        else:
            end = line.find(" ", equals)
            end = len(line) if end < 0 else end
            value, position = line[equals + 1 : end], end
        fields[name] = value
    return fields


@pytest.mark.parametrize(
    "holder",
    ['x reason=accepted key=other', 'x" token=1 key="other', "x\\ key=other", "caf\u00e9 key=\u00e9"],
)
def test_a_holder_cannot_add_fields_to_the_log_line(
    setup: Any, holder: str, caplog: pytest.LogCaptureFixture
) -> None:
    client, _ = setup
    with caplog.at_level("DEBUG", logger="coordination.locks"):
        response = post(client, "/api/locks/logged/acquire", {"holder": holder, "ttl": 5})
    assert response.status_code == 201, response.content
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("lock acquired ")]
    fields = logfmt(line.removeprefix("lock acquired "))
    assert set(fields) == {"key", "token", "holder", "expires_at"}
    assert fields["holder"] == holder
    assert fields["key"] == "logged"


# --- the admin's own URLs ---------------------------------------------------------------


@pytest.fixture
def operator() -> Any:
    from django.contrib.auth.models import User
    from django.test import Client

    client = Client()
    client.force_login(User.objects.create_user("root", is_staff=True, is_superuser=True))
    return client


@pytest.mark.parametrize("object_id", ["abc", "1.5", "-1", "99999999", "1%2F2", "%00", "9" * 40])
@pytest.mark.parametrize("url", ["lock/{}/revoke/", "fence/{}/raise/"])
@pytest.mark.parametrize("method", ["get", "post"])
def test_admin_operator_pages_of_no_such_row_are_404(
    setup: Any, operator: Any, url: str, object_id: str, method: str
) -> None:
    before = database_state()
    path = "/admin/coordination/" + url.format(object_id)
    response = getattr(operator, method)(path, {"confirm": "yes"} if method == "post" else {})
    assert response.status_code == 404
    assert database_state() == before


@pytest.mark.parametrize(
    "query", ["key=-bad&refresh=abc", "refresh=-5", "refresh=" + "9" * 50, "key=" + "x" * 5000]
)
def test_admin_dashboard_takes_any_query(setup: Any, operator: Any, query: str) -> None:
    before = database_state()
    response = operator.get(f"/admin/coordination/lock/dashboard/?{query}")
    assert response.status_code == 200
    assert database_state() == before


# --- more malformed requests -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "content_type"),
    [
        (b'{"holder": "h", "ttl": ' + b"9" * 5000 + b"}", "application/json"),
        (b'{"holder": "h", "ttl": 5}', "application/json; charset=utf-16"),
        (b"\x00" * 100, "application/json"),
    ],
    ids=["5000-digit-number", "wrong-charset", "nul-bytes"],
)
def test_bodies_that_cannot_be_read_as_json_are_parse_errors(
    setup: Any, raw: bytes, content_type: str
) -> None:
    client, _ = setup
    before = database_state()
    response = client.generic("POST", "/api/locks/free-key/acquire", raw, content_type=content_type)
    assert_refused(response, 400, "parse_error", before)


@pytest.mark.parametrize("query", ["page_size=0", "page_size=-1", "page_size=" + "9" * 40, "page_size=x"])
def test_any_page_size_is_answered(setup: Any, query: str) -> None:
    client, _ = setup
    response = client.get(f"/api/locks/?{query}")
    assert response.status_code == 200
    assert len(response.json()["results"]) == 1


@pytest.mark.parametrize("header", ["Token", "Token ", "Token a b", "Bearer x", "Token " + "x" * 10_000])
def test_malformed_authorization_headers_are_401(setup: Any, header: str) -> None:
    before = database_state()
    response = APIClient().post(
        "/api/locks/job:1/acquire", {"holder": "h", "ttl": 5}, format="json", HTTP_AUTHORIZATION=header
    )
    assert_refused(response, 401, "not_authenticated", before)
