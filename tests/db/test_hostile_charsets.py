"""Hostile charsets: a request body is decoded only as UTF-8 (or UTF-16/32), and a
charset that is no text encoding is refused on every URL before anything reads it.

Python's codec registry holds codecs that decompress or transform (``bz2``,
``zlib``, ``hex``, ``rot13``...). Named as a request's charset, they must never
run on a body (a bz2 body of 157 bytes expands to 100 MB), and Django, which
decodes the query string with the request's charset while it builds the
request, must not answer 500. Every request here is counted
(tests/support/hostile.py), and the module fails on any 5xx.
"""

from __future__ import annotations

import bz2
import codecs
import functools
import json
import re
import tracemalloc
from collections.abc import Iterator
from typing import Any

import pytest
from django.urls import URLPattern, URLResolver, get_resolver, resolve

from coordination.models import Document, Fence, Grant, JobPolicy, Lock, Rejection
from tests.support.api_support import ALL_PERMISSIONS, client_with, post, put
from tests.support.hostile import Tally, tally_requests, wsgi_request  # noqa: F401

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("tally_requests")]

# Codecs that are no text encoding: Django cannot decode text with them.
NOT_TEXT = ["bz2", "zlib", "base64", "hex", "uu", "quopri", "rot13"]
# Text encodings (or unknown names) that are not UTF-8, -16 or -32: the API refuses them.
OTHER_TEXT = ["latin-1", "cp1252", "utf-7", "unicode_escape", "punycode", "no-such-charset"]
ACCEPTED = ["utf-8", "UTF8", "utf-16", "utf-32-le", "ascii"]


def database_state() -> tuple[list[Any], ...]:
    return (
        list(Lock.objects.order_by("key").values_list("key", "token", "holder", "expires_at")),
        list(Grant.objects.order_by("pk").values_list("lock_id", "token", "expires_at", "ended_at")),
        list(Fence.objects.order_by("resource").values_list("resource", "token", "step")),
        list(Document.objects.order_by("name").values_list("name", "data", "updated_at")),
        list(Rejection.objects.values_list("pk")),
        list(JobPolicy.objects.order_by("task").values_list("task", "paused")),
    )


@pytest.fixture
def held() -> tuple[Any, dict[str, Any]]:
    """A client with every permission, holding job:1 and having written the document."""
    client = client_with(*ALL_PERMISSIONS, "add_jobpolicy", "change_jobpolicy")
    grant = post(client, "/api/locks/job:1/acquire", {"holder": "worker-1", "ttl": 60}).json()
    proof = {"lock_key": "job:1", "token": grant["token"], "lease_id": grant["lease_id"]}
    assert put(client, "/api/documents/doc", {**proof, "data": 1, "step": 1}).status_code == 200
    return client, grant


def write_requests(grant: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    """Every endpoint that reads a JSON body, with a body it would accept."""
    proof = {"token": grant["token"], "lease_id": grant["lease_id"]}
    return [
        ("post", "/api/locks/free-key/acquire", {"holder": "h", "ttl": 5}),
        ("post", "/api/lock-sets/acquire", {"holder": "h", "ttl": 5, "keys": ["set-a", "set-b"]}),
        ("post", "/api/semaphores/pool/acquire", {"holder": "h", "ttl": 5, "limit": 2}),
        ("post", "/api/locks/job:1/renew", {**proof, "ttl": 30}),
        ("post", "/api/locks/job:1/release", proof),
        ("put", "/api/documents/doc", {"lock_key": "job:1", **proof, "data": 2, "step": 2}),
        ("put", "/api/job-policies/app.tasks.settle", {"paused": True}),
        ("patch", "/api/job-policies/app.tasks.settle", {"paused": True}),
    ]


def encoded(body: dict[str, Any], charset: str) -> bytes:
    raw = json.dumps(body).encode()
    try:
        codec = codecs.lookup(charset)
    except LookupError:
        return raw
    if charset == "rot13":  # str to str
        return codecs.encode(raw.decode(), charset).encode()
    if not codec._is_text_encoding:
        return codecs.encode(raw, charset)  # what the codec would decode back to the JSON
    return raw.decode().encode(charset)


def send(client: Any, method: str, path: str, body: bytes, charset: str) -> Any:
    return getattr(client, method)(path, data=body, content_type=f"application/json; charset={charset}")


def assert_charset_refused(response: Any) -> None:
    assert response.status_code == 415, (response.status_code, response.content[:300])
    answer = response.json()
    assert answer["code"] == "unsupported_charset"
    assert "UTF-8" in answer["detail"]


@pytest.mark.parametrize("charset", NOT_TEXT + OTHER_TEXT)
def test_every_write_endpoint_refuses_a_body_in_another_charset(held: Any, charset: str) -> None:
    client, grant = held
    before = database_state()
    for method, path, body in write_requests(grant):
        response = send(client, method, path, encoded(body, charset), charset)
        assert_charset_refused(response)
    assert database_state() == before


@pytest.mark.parametrize("charset", ACCEPTED)
def test_utf8_and_what_json_allows_are_decoded(held: Any, charset: str) -> None:
    client, _ = held
    response = send(
        client, "post", "/api/locks/other-key/acquire",
        encoded({"holder": "h", "ttl": 5}, charset.lower()), charset,
    )
    assert response.status_code == 201, response.content
    assert response.json()["key"] == "other-key"


@functools.cache
def bomb(codec: str, expanded: int) -> bytes:
    """A JSON body of ``expanded`` bytes, compressed with ``codec``."""
    body = b'{"holder": "' + b"a" * (expanded - 24) + b'", "ttl": 5}'
    return bz2.compress(body) if codec == "bz2" else codecs.encode(body, codec)


@pytest.mark.parametrize(("codec", "expanded"), [("bz2", 100_000_000), ("zlib", 100_000_000)])
def test_a_compressed_body_is_refused_without_being_expanded(held: Any, codec: str, expanded: int) -> None:
    client, _ = held
    body = bomb(codec, expanded)
    assert len(body) < 1_000_000  # under the API's body limit: only its charset can refuse it
    before = database_state()
    tracemalloc.start()
    try:
        response = send(client, "post", "/api/locks/bomb/acquire", body, codec)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert_charset_refused(response)
    # Expanded, the body alone would take 100 MB; refused, the request takes a few.
    assert peak < 10_000_000, f"{peak / 1e6:.1f} MB allocated while refusing a {len(body)}-byte body"
    assert database_state() == before


# --- every URL of the site, anonymous, through the WSGI application a server runs -------

SAMPLES = {
    "app_label": "coordination", "object_id": "1", "content_type_id": "1", "key": "job-1",
    "name": "job-1", "resource": "job-1", "task": "app.tasks.settle", "url": "x", "rest": "x",
}
GROUP = re.compile(r"\(\?P<(?P<name>\w+)>(?:[^()]|\([^()]*\))*\)")


def concrete(regex: str) -> str:
    """A path that ``regex`` (one level of a URLconf) matches, from the samples."""
    text = regex.removeprefix("^").removesuffix(r"\Z").removesuffix("$")
    text = GROUP.sub(lambda match: SAMPLES.get(match["name"], "1"), text)
    return text.replace("\\", "")


def site_paths(patterns: list[Any] | None = None, prefix: str = "/") -> Iterator[tuple[str, URLPattern]]:
    for pattern in get_resolver().url_patterns if patterns is None else patterns:
        here = prefix + concrete(pattern.pattern.regex.pattern)
        if isinstance(pattern, URLResolver):
            yield from site_paths(pattern.url_patterns, here)
        else:
            yield here, pattern


def test_the_sweep_reaches_every_url_pattern_of_the_site() -> None:
    paths = list(site_paths())
    assert len(paths) > 100  # the admin's, the API's, the metrics
    for path, pattern in paths:
        match = resolve(path)
        # The site's throttled login stands before the admin's own (project/urls.py).
        assert match.func is pattern.callback or match.url_name == "admin-login", path


@pytest.mark.parametrize("charset", ["zlib", "bz2", "hex", "rot13"])
@pytest.mark.parametrize("method", ["get", "post"])
def test_any_url_with_an_undecodable_charset_is_refused_before_login(
    tally_requests: Tally, charset: str, method: str  # noqa: F811
) -> None:
    for path, _ in site_paths():
        answer = wsgi_request(
            tally_requests, method, path, query="next=/x&a=b",
            content_type=f"text/plain; charset={charset}", body=b"x=1" if method == "post" else b"",
        )
        assert answer.status == 415, (path, answer.status, answer.body[:200])
        if path.startswith("/api"):
            assert json.loads(answer.body)["code"] == "unsupported_charset", path
        else:
            assert answer.headers["Content-Type"].startswith("text/plain"), path
            assert b"UTF-8" in answer.body


def test_the_same_urls_in_utf8_are_answered_without_a_server_error(tally_requests: Tally) -> None:  # noqa: F811
    for path, _ in site_paths():
        for method in ("get", "post"):
            answer = wsgi_request(
                tally_requests, method, path, query="next=/x&a=b",
                content_type="text/plain; charset=utf-8", body=b"x=1" if method == "post" else b"",
            )
            assert answer.status < 500, (path, method, answer.status)
