"""The REST API of the primitives: shared (read) grants, semaphore permits and
all-or-none sets; each refusal a 4xx with a stable code, never a 500."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest
from rest_framework.test import APIClient

from coordination.models import AccessRule, Fence, Grant, GrantMode, Lock
from tests.support.api_support import client_for, client_with, full_client, make_user, post
from tests.support.waiting import wait_until_database_time_passes

pytestmark = pytest.mark.django_db


def acquire(client: APIClient, path: str, **body: Any) -> Any:
    return post(client, path, {"holder": "worker-1", "ttl": 30, **body})


def parse_time(value: str) -> dt.datetime:
    return dt.datetime.fromisoformat(value.replace("Z", "+00:00"))


def proof(grant: dict[str, Any]) -> dict[str, Any]:
    return {"token": grant["token"], "lease_id": grant["lease_id"]}


# --- shared grants: POST /api/locks/{key}/acquire with mode ---------------------------


def test_shared_acquires_grant_readers_together_and_refuse_a_writer_until_they_release() -> None:
    client = full_client()
    first = acquire(client, "/api/locks/doc:1/acquire", mode="shared")
    second = acquire(client, "/api/locks/doc:1/acquire", mode="shared", holder="worker-2")
    assert (first.status_code, second.status_code) == (201, 201)
    readers = [first.json(), second.json()]
    assert [r["mode"] for r in readers] == ["shared", "shared"]
    assert readers[1]["token"] == readers[0]["token"] + 1

    refused = acquire(client, "/api/locks/doc:1/acquire")
    assert refused.status_code == 409
    assert refused.json()["code"] == "lock_held"
    assert refused.json()["holder"] == "2 shared holders"
    assert "Retry-After" in refused.headers

    renewed = post(client, "/api/locks/doc:1/renew", {**proof(readers[0]), "ttl": 60})
    assert renewed.status_code == 200 and renewed.json()["mode"] == "shared"
    for reader in readers:
        released = post(client, "/api/locks/doc:1/release", proof(reader))
        assert released.status_code == 200 and released.json()["end_reason"] == "released"
    writer = acquire(client, "/api/locks/doc:1/acquire", mode="exclusive")
    assert writer.status_code == 201
    assert writer.json()["mode"] == "exclusive"
    assert writer.json()["token"] > readers[1]["token"]
    history = client.get("/api/locks/doc:1/grants").json()["results"]
    assert [g["mode"] for g in history] == ["exclusive", "shared", "shared"]


def test_a_readers_late_document_write_is_refused_after_a_writer_wrote() -> None:
    client = full_client()
    reader = acquire(client, "/api/locks/doc:2/acquire", mode="shared", ttl=0.5).json()
    wait_until_database_time_passes(parse_time(reader["expires_at"]))
    writer = acquire(client, "/api/locks/doc:2/acquire").json()  # takes the expired reader over
    body = {"lock_key": "doc:2", "data": {"v": 1}}
    assert client.put("/api/documents/d2", {**body, **proof(writer)}, format="json").status_code == 200

    late = client.put("/api/documents/d2", {**body, **proof(reader)}, format="json")
    assert late.status_code == 409
    assert late.json()["code"] == "stale_token"
    assert late.json()["current_token"] == writer["token"] == reader["token"] + 1


@pytest.mark.parametrize("mode", ["read", "", 1, None, ["shared"], {"shared": True}])
def test_an_unknown_mode_is_a_400_naming_the_field(mode: Any) -> None:
    response = acquire(full_client(), "/api/locks/doc:3/acquire", mode=mode)
    assert response.status_code == 400
    assert response.json()["code"] == "invalid"
    assert "mode" in response.json()["errors"]
    assert not Lock.objects.filter(key="doc:3").exists()


# --- permits: POST /api/semaphores/{name}/acquire -------------------------------------


def test_permits_are_slots_with_their_own_tokens_and_all_held_is_a_409() -> None:
    client = full_client()
    permits = [
        acquire(client, "/api/semaphores/exports/acquire", limit=2, holder=f"w{n}") for n in (1, 2)
    ]
    assert [p.status_code for p in permits] == [201, 201]
    granted = [p.json() for p in permits]
    assert sorted(p["slot"] for p in granted) == [1, 2]
    assert sorted(p["key"] for p in granted) == ["exports@1", "exports@2"]
    assert all(p["mode"] == "exclusive" and p["token"] == 1 for p in granted)

    refused = acquire(client, "/api/semaphores/exports/acquire", limit=2)
    assert refused.status_code == 409
    assert refused.json()["code"] == "lock_held"
    assert "all 2 permits" in refused.json()["holder"]

    # A permit is its slot's lease: renewed and released at the slot's key.
    slot_key = granted[0]["key"]
    assert post(client, f"/api/locks/{slot_key}/renew", proof(granted[0])).status_code == 200
    assert post(client, f"/api/locks/{slot_key}/release", proof(granted[0])).status_code == 200
    again = acquire(client, "/api/semaphores/exports/acquire", limit=2)
    assert again.status_code == 201
    assert (again.json()["key"], again.json()["token"]) == (slot_key, 2)


@pytest.mark.parametrize(
    ("name", "body", "field"),
    [
        ("exports", {"limit": 0}, "limit"),
        ("exports", {"limit": 1001}, "limit"),
        ("exports", {"limit": "2"}, "limit"),
        ("exports", {"limit": True}, "limit"),
        ("exports", {}, "limit"),
        ("exports", {"limit": 2, "mode": "shared"}, "mode"),
        ("x" * 199, {"limit": 20}, "name"),
        ("-bad", {"limit": 2}, "name"),
    ],
)
def test_bad_permit_requests_are_400s_naming_the_field(name: str, body: dict[str, Any], field: str) -> None:
    response = acquire(full_client(), f"/api/semaphores/{name}/acquire", **body)
    assert response.status_code == 400, response.content
    assert response.json()["code"] == "invalid"
    assert field in response.json()["errors"]
    assert not Grant.objects.exists()


# --- sets: POST /api/lock-sets/acquire --------------------------------------------------


def test_a_set_is_granted_all_or_none_in_sorted_order() -> None:
    client = full_client()
    granted = acquire(client, "/api/lock-sets/acquire", keys=["acct:b", "acct:a", "acct:b"])
    assert granted.status_code == 201
    grants = granted.json()["grants"]
    assert [g["key"] for g in grants] == ["acct:a", "acct:b"]
    assert all(g["lease_id"] and g["mode"] == "exclusive" for g in grants)

    refused = acquire(client, "/api/lock-sets/acquire", keys=["acct:c", "acct:a"])
    assert refused.status_code == 409
    assert refused.json()["code"] == "lock_held"
    assert not Grant.objects.filter(lock__key="acct:c").exists()  # none of the set
    for grant in grants:
        assert post(client, f"/api/locks/{grant['key']}/release", proof(grant)).status_code == 200


@pytest.mark.parametrize("keys", [[], "acct:a", ["ok", 7], ["-bad"], [f"k{n}" for n in range(101)], None])
def test_bad_sets_are_400s(keys: Any) -> None:
    response = acquire(full_client(), "/api/lock-sets/acquire", keys=keys)
    assert response.status_code == 400, response.content
    assert response.json()["code"] == "invalid"
    assert not Lock.objects.exists()


# --- permissions and access rules ---------------------------------------------------------


def test_the_new_endpoints_need_the_acquire_permission_and_follow_access_rules() -> None:
    viewer = client_with("view_lock")
    for path, body in [
        ("/api/locks/doc:9/acquire", {"mode": "shared"}),
        ("/api/semaphores/exports/acquire", {"limit": 2}),
        ("/api/lock-sets/acquire", {"keys": ["a", "b"]}),
    ]:
        response = acquire(viewer, path, **body)
        assert response.status_code == 403 and response.json()["code"] == "permission_denied"

    user = make_user("acquire_lock")
    AccessRule.objects.create(user=user, pattern="a*", acquire=True)
    limited = client_for(user)
    assert acquire(limited, "/api/lock-sets/acquire", keys=["a", "b"]).json()["code"] == "key_forbidden"
    assert acquire(limited, "/api/semaphores/bx/acquire", limit=2).json()["code"] == "key_forbidden"
    assert acquire(limited, "/api/semaphores/ax/acquire", limit=2).status_code == 201
    assert not Fence.objects.exists()
    assert Grant.objects.filter(mode=GrantMode.SHARED).count() == 0
