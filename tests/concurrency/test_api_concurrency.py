"""The seed's rules over HTTP: the timeline of a paused client, and many clients at once."""

from __future__ import annotations

import datetime as dt
import itertools
import json
import urllib.error
import urllib.request
from typing import Any

import pytest
from rest_framework.test import APIClient

from coordination.models import Document, Fence, Grant, Rejection
from tests.support.api_support import (
    ALL_PERMISSIONS,
    client_for,
    full_client,
    make_user,
    post,
    put,
    token_for,
)
from tests.support.factories import LockFactory
from tests.support.waiting import run_in_threads, wait_until_database_time_passes


def parse_time(value: str) -> dt.datetime:
    return dt.datetime.fromisoformat(value.replace("Z", "+00:00"))


def fenced_put(client: APIClient, name: str, grant: dict[str, Any], data: Any) -> Any:
    body = {"lock_key": grant["key"], "token": grant["token"], "lease_id": grant["lease_id"], "data": data}
    return put(client, f"/api/documents/{name}", body)


@pytest.mark.django_db
def test_seed_timeline_paused_client_is_fenced_out_after_its_lease_expires() -> None:
    LockFactory(key="storage:file", token=40)
    a, b = full_client(), full_client()

    # A acquires token 41, then pauses (GC, VM pause) past the end of its lease.
    response = post(a, "/api/locks/storage:file/acquire", {"holder": "client-a", "ttl": 0.3})
    grant_a = response.json()
    assert grant_a["token"] == 41
    wait_until_database_time_passes(parse_time(grant_a["expires_at"]))
    assert a.get("/api/locks/storage:file").json()["state"] == "expired"

    # The lease expired: B acquires token 42 and writes, accepted.
    response = post(b, "/api/locks/storage:file/acquire", {"holder": "client-b", "ttl": 30})
    assert response.status_code == 201
    grant_b = response.json()
    assert grant_b["token"] == 42
    assert fenced_put(b, "file", grant_b, {"by": "B"}).status_code == 200

    # A wakes up and writes with 41: refused at the resource, B's data stays.
    response = fenced_put(a, "file", grant_a, {"by": "A"})
    assert response.status_code == 409
    assert response.json()["code"] == "stale_token"
    assert response.json()["current_token"] == 42
    document = a.get("/api/documents/file").json()
    assert (document["data"], document["token"]) == ({"by": "B"}, 42)

    # A also learns that its lease is gone; the refusal is on record.
    for action in ("renew", "release"):
        body = {"token": 41, "lease_id": grant_a["lease_id"]}
        refused = post(a, f"/api/locks/storage:file/{action}", body)
        assert refused.status_code == 409
        assert refused.json()["code"] == "lease_lost"
    rejections = a.get("/api/rejections/?resource=document:file").json()["results"]
    assert [(r["token"], r["watermark_token"], r["reason"]) for r in rejections] == [
        (41, 42, "stale_token")
    ]


@pytest.mark.django_db
def test_a_paused_client_whose_lease_expired_may_still_write_if_nobody_newer_did() -> None:
    # The lease is not the protection, the fence is: with no newer token written,
    # the late write is not stale, and the fence accepts it.
    client = full_client()
    grant = post(client, "/api/locks/job/acquire", {"holder": "a", "ttl": 0.2}).json()
    wait_until_database_time_passes(parse_time(grant["expires_at"]))
    assert fenced_put(client, "doc", grant, 1).status_code == 200


@pytest.mark.django_db(transaction=True)
def test_many_clients_acquiring_one_key_get_unique_increasing_tokens() -> None:
    clients = 8
    rounds = 3
    users = [make_user(*ALL_PERMISSIONS) for _ in range(clients)]

    def work(index: int) -> list[dict[str, Any]]:
        client = client_for(users[index])
        grants = []
        for round_ in range(rounds):
            response = post(
                client, "/api/locks/hot/acquire", {"holder": f"client-{index}", "ttl": 10, "wait": 30}
            )
            assert response.status_code == 201, response.content
            grant = response.json()
            written = fenced_put(client, "shared", grant, {"client": index, "round": round_})
            assert written.status_code == 200, written.content
            released = post(
                client, "/api/locks/hot/release", {"token": grant["token"], "lease_id": grant["lease_id"]}
            )
            assert released.status_code == 200, released.content
            grants.append(grant)
        return grants

    grants = [grant for per_client in run_in_threads(clients, work) for grant in per_client]
    tokens = [grant["token"] for grant in grants]
    assert len(set(tokens)) == len(tokens) == clients * rounds
    # Strictly increasing in grant order, and leases never overlap in database time.
    by_time = sorted(grants, key=lambda grant: parse_time(grant["acquired_at"]))
    assert [grant["token"] for grant in by_time] == sorted(tokens)
    history = list(Grant.objects.filter(lock__key="hot").order_by("token"))
    assert [grant.token for grant in history] == sorted(tokens)
    for earlier, later in itertools.pairwise(history):
        assert earlier.ended_at is not None and earlier.ended_at <= later.acquired_at
    # Every write was accepted in token order: the document holds the last one.
    assert Fence.objects.get(resource="document:shared").token == max(tokens)
    assert Document.objects.get(name="shared").fence.token == max(tokens)
    assert not Rejection.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_concurrent_acquires_without_waiting_grant_exactly_one() -> None:
    clients = 8
    users = [make_user("acquire_lock") for _ in range(clients)]

    def work(index: int) -> tuple[int, dict[str, Any]]:
        body = {"holder": f"c{index}", "ttl": 30}
        response = post(client_for(users[index]), "/api/locks/once/acquire", body)
        return response.status_code, response.json()

    results = run_in_threads(clients, work)
    statuses = sorted(status for status, _ in results)
    assert statuses == [201] + [409] * (clients - 1)
    winner = next(body for status, body in results if status == 201)
    for status, body in results:
        if status == 409:
            assert body["code"] == "lock_held"
            assert body["holder"] == winner["holder"]
    assert Grant.objects.filter(lock__key="once").count() == 1


def test_real_http_clients_acquiring_one_key_get_unique_increasing_tokens(live_server: Any) -> None:
    # Real sockets and a threaded WSGI server in front of the same views.
    clients = 6
    tokens_of_users = [token_for(make_user("acquire_lock")) for _ in range(clients)]

    def call(index: int, action: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        request = urllib.request.Request(
            f"{live_server.url}/api/locks/wire/{action}",
            data=json.dumps(body).encode(),
            method="POST",
            headers={"Authorization": f"Token {tokens_of_users[index]}", "Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                return response.status, json.load(response)
        except urllib.error.HTTPError as error:
            return error.code, json.load(error)

    def work(index: int) -> list[int]:
        tokens = []
        for _ in range(2):
            status, grant = call(index, "acquire", {"holder": f"http-{index}", "ttl": 10, "wait": 30})
            assert status == 201, grant
            tokens.append(grant["token"])
            status, body = call(index, "release", {"token": grant["token"], "lease_id": grant["lease_id"]})
            assert status == 200, body
        return tokens

    per_client = run_in_threads(clients, work)
    tokens = [token for own in per_client for token in own]
    assert len(set(tokens)) == len(tokens) == clients * 2
    # Each client's later grant has the higher token.
    assert all(first < second for first, second in per_client)
    status, refused = call(0, "release", {"token": 1, "lease_id": "forged"})
    assert (status, refused["code"]) == (409, "lease_lost")
