"""Access rules over the REST API: a user limited to ``billing:*`` on every endpoint.

Outside the prefix every request is refused (403 ``key_forbidden``, or 404 for a
fence or document that is not theirs to see) and changes no table; lists leave
those keys out. Inside it, everything works as without rules. Superusers bypass
rules, rules never stand in for a Django permission, and with no rule at all
("auto", the default) nothing changes for anybody.
"""

from __future__ import annotations

from typing import Any

import pytest
from django.contrib.auth.models import Group, User
from django.db import connection
from django.test.utils import CaptureQueriesContext
from rest_framework.test import APIClient

from coordination import access, documents, locks
from coordination.exceptions import DuplicateWrite, StaleToken
from coordination.leases import Lease
from coordination.models import AccessRule, Document, Fence, Grant, IdempotencyRecord, Lock, Rejection
from tests.support.api_support import ALL_PERMISSIONS, client_for, make_user, post, put

pytestmark = pytest.mark.django_db


def database_state() -> tuple[list[Any], ...]:
    return (
        list(Lock.objects.order_by("key").values_list("key", "token", "holder", "lease_hash", "expires_at")),
        list(Grant.objects.order_by("pk").values_list("lock_id", "token", "expires_at", "ended_at")),
        list(Fence.objects.order_by("resource").values_list("resource", "lock_key", "token", "step")),
        list(Document.objects.order_by("name").values_list("name", "data", "updated_at")),
        list(Rejection.objects.values_list("pk")),
        list(IdempotencyRecord.objects.values_list("key", "completed")),
    )


def refused(response: Any, before: Any, status: int = 403, code: str = "key_forbidden") -> dict[str, Any]:
    assert response.status_code == status, response.content
    body = dict(response.json())
    assert body["code"] == code, body
    assert database_state() == before
    return body


def billing_user(*codenames: str) -> User:
    user = make_user(*(codenames or ALL_PERMISSIONS))
    AccessRule.objects.create(user=user, pattern="billing:*", acquire=True, write=True, read=True)
    return user


def proof(grant: Lease | dict[str, Any]) -> dict[str, Any]:
    if isinstance(grant, Lease):
        return {"token": grant.token, "lease_id": grant.lease_id}
    return {"token": grant["token"], "lease_id": grant["lease_id"]}


class World:
    """Rows inside and outside ``billing:*``, made by trusted code (the Python API)."""

    def __init__(self) -> None:
        self.outside = locks.acquire("account:1", holder="celery-task", ttl=60)
        documents.put_document("invoice-777", self.outside, {"total": 1})
        old = locks.acquire("billing:1", holder="billing-svc", ttl=0.05, wait=0)
        self.inside = locks.acquire("billing:2", holder="billing-svc", ttl=60)
        documents.put_document("bill-1", self.inside, {"total": 2})
        self.refuse(self.outside, "invoice-777", step=1)  # a rejection on account:1
        self.refuse(self.inside, "bill-1", step=1)  # and one on billing:2
        self.old = old

    @staticmethod
    def refuse(grant: Lease, name: str, step: int) -> None:
        with pytest.raises(DuplicateWrite):
            documents.put_document(name, grant, {"again": True}, step=step)


@pytest.fixture
def world() -> World:
    return World()


@pytest.fixture
def billing() -> APIClient:
    return client_for(billing_user())


# --- acquire, renew, release ------------------------------------------------------------


def test_acquire_outside_the_prefix_is_refused_and_changes_nothing(world: World, billing: APIClient) -> None:
    before = database_state()
    for key in ("account:2", "account:1", "billing", "Billing:1", "billing-archive:1"):
        body = refused(post(billing, f"/api/locks/{key}/acquire", {"holder": "h", "ttl": 30}), before)
        assert body["key"] == key and body["action"] == "acquire"
    # Before the body is read: a bad body outside the prefix is refused the same way.
    refused(post(billing, "/api/locks/account:2/acquire", {"holder": ""}), before)


def test_acquire_renew_release_inside_the_prefix_work(world: World, billing: APIClient) -> None:
    response = post(billing, "/api/locks/billing:new/acquire", {"holder": "billing-svc", "ttl": 30})
    assert response.status_code == 201, response.content
    grant = response.json()
    renewed = post(billing, "/api/locks/billing:new/renew", {**proof(grant), "ttl": 60})
    assert renewed.status_code == 200, renewed.content
    released = post(billing, "/api/locks/billing:new/release", proof(grant))
    assert released.status_code == 200 and released.json()["end_reason"] == "released"


@pytest.mark.parametrize("action", ["renew", "release"])
def test_renew_and_release_outside_are_refused_even_with_the_real_lease(
    world: World, billing: APIClient, action: str
) -> None:
    before = database_state()
    refused(post(billing, f"/api/locks/account:1/{action}", proof(world.outside)), before)
    assert Grant.objects.live().filter(lock__key="account:1").count() == 1


# --- documents ----------------------------------------------------------------------------


def test_writing_with_a_grant_outside_is_refused_before_anything_is_stored(
    world: World, billing: APIClient
) -> None:
    before = database_state()
    body = {"lock_key": "account:1", **proof(world.outside), "data": {"owned": True}, "step": 5}
    # A new name would be bound to account:1; an existing one is account:1's already.
    for name in ("squatted", "invoice-777"):
        refused(put(billing, f"/api/documents/{name}", body, HTTP_IDEMPOTENCY_KEY="k-1"), before)


def test_a_document_bound_outside_cannot_be_written_with_an_inside_grant(
    world: World, billing: APIClient
) -> None:
    before = database_state()
    body = {"lock_key": "billing:2", **proof(world.inside), "data": 3, "step": 9}
    answer = refused(put(billing, "/api/documents/invoice-777", body), before)
    # Refused without the fence's wrong_lock: no rejection, and the key is not named.
    assert "account:1" not in answer["detail"] and "key" not in answer


def test_writing_inside_binds_a_new_document_to_the_prefix(world: World, billing: APIClient) -> None:
    body = {"lock_key": "billing:2", **proof(world.inside), "data": {"total": 9}, "step": 2}
    response = put(billing, "/api/documents/bill-2", body)
    assert response.status_code == 200, response.content
    assert Document.objects.get(name="bill-2").fence.lock_key == "billing:2"
    again = put(billing, "/api/documents/bill-1", {**body, "step": 3})
    assert again.status_code == 200 and again.json()["data"] == {"total": 9}


def test_documents_outside_are_not_there_for_the_reader(world: World, billing: APIClient) -> None:
    outside = billing.get("/api/documents/invoice-777")
    assert outside.status_code == 404 and outside.json()["code"] == "not_found"
    inside = billing.get("/api/documents/bill-1")
    assert inside.status_code == 200 and inside.json()["data"] == {"total": 2}


# --- reads and lists ----------------------------------------------------------------------


def keys(response: Any, field: str) -> list[str]:
    assert response.status_code == 200, response.content
    return [row[field] for row in response.json()["results"]]


def test_lists_leave_out_the_keys_outside(world: World, billing: APIClient) -> None:
    assert keys(billing.get("/api/locks/"), "key") == ["billing:1", "billing:2"]
    assert keys(billing.get("/api/fences/"), "lock_key") == ["billing:2"]
    assert keys(billing.get("/api/rejections/"), "lock_key") == ["billing:2"]
    assert keys(billing.get("/api/rejections/", {"lock_key": "account:1"}), "lock_key") == []
    assert keys(billing.get("/api/rejections/", {"resource": "document:invoice-777"}), "lock_key") == []


def test_reads_of_a_key_outside_are_refused(world: World, billing: APIClient) -> None:
    before = database_state()
    refused(billing.get("/api/locks/account:1"), before)
    refused(billing.get("/api/locks/account:1/grants"), before)
    refused(billing.get("/api/locks/account:404"), before)  # whether it exists or not
    fence = billing.get("/api/fences/document:invoice-777")
    assert fence.status_code == 404 and fence.json()["code"] == "not_found"


def test_reads_inside_work(world: World, billing: APIClient) -> None:
    assert billing.get("/api/locks/billing:2").json()["holder"] == "billing-svc"
    assert keys(billing.get("/api/locks/billing:2/grants"), "token") == [world.inside.token]
    assert billing.get("/api/fences/document:bill-1").json()["lock_key"] == "billing:2"


# --- who is bound, and by what ----------------------------------------------------------


def test_a_superuser_is_not_bound_by_rules(world: World) -> None:
    billing_user()
    admin = client_for(User.objects.create_superuser("root"))
    assert post(admin, "/api/locks/account:9/acquire", {"holder": "op", "ttl": 30}).status_code == 201
    assert admin.get("/api/documents/invoice-777").status_code == 200
    assert keys(admin.get("/api/locks/"), "key") == ["account:1", "account:9", "billing:1", "billing:2"]


def test_once_a_rule_exists_a_user_without_rules_may_use_no_key(world: World) -> None:
    other = client_for(make_user(*ALL_PERMISSIONS))
    assert post(other, "/api/locks/account:9/acquire", {"holder": "h", "ttl": 30}).status_code == 201
    billing_user()
    before = database_state()
    refused(post(other, "/api/locks/account:8/acquire", {"holder": "h", "ttl": 30}), before)
    assert keys(other.get("/api/locks/"), "key") == []


def test_with_no_rule_at_all_nothing_changes(world: World) -> None:
    user = make_user(*ALL_PERMISSIONS)
    client = client_for(user)
    assert post(client, "/api/locks/account:9/acquire", {"holder": "h", "ttl": 30}).status_code == 201
    assert client.get("/api/documents/invoice-777").status_code == 200
    assert access.access_for(user) == access.UNRESTRICTED


def test_enforce_limits_users_without_rules_too(world: World, settings: Any) -> None:
    settings.COORDINATION = {**settings.COORDINATION, "ACCESS_RULES": "enforce"}
    client = client_for(make_user(*ALL_PERMISSIONS))
    before = database_state()
    refused(post(client, "/api/locks/account:9/acquire", {"holder": "h", "ttl": 30}), before)
    assert keys(client.get("/api/locks/"), "key") == []


def test_off_ignores_the_rules(world: World, settings: Any) -> None:
    billing = client_for(billing_user())
    settings.COORDINATION = {**settings.COORDINATION, "ACCESS_RULES": "off"}
    assert post(billing, "/api/locks/account:9/acquire", {"holder": "h", "ttl": 30}).status_code == 201


def test_a_groups_rule_binds_its_members(world: World) -> None:
    team = Group.objects.create(name="billing-team")
    AccessRule.objects.create(group=team, pattern="billing:*", acquire=True, read=True)
    member = make_user(*ALL_PERMISSIONS)
    member.groups.add(team)
    client = client_for(member)
    assert post(client, "/api/locks/billing:9/acquire", {"holder": "h", "ttl": 30}).status_code == 201
    before = database_state()
    refused(post(client, "/api/locks/account:9/acquire", {"holder": "h", "ttl": 30}), before)
    # The group's rule allows no writes.
    body = {"lock_key": "billing:2", **proof(world.inside), "data": 1, "step": 7}
    refused(put(client, "/api/documents/bill-1", body), before)


def test_a_rule_never_grants_what_the_django_permission_denies(world: World) -> None:
    client = client_for(billing_user("view_lock"))
    before = database_state()
    refused(post(client, "/api/locks/billing:9/acquire", {"holder": "h", "ttl": 30}), before,
            code="permission_denied")


def test_read_only_rules_do_not_allow_acquiring(world: World) -> None:
    user = make_user(*ALL_PERMISSIONS)
    AccessRule.objects.create(user=user, pattern="billing:*", read=True)
    client = client_for(user)
    before = database_state()
    refused(post(client, "/api/locks/billing:9/acquire", {"holder": "h", "ttl": 30}), before)
    assert keys(client.get("/api/locks/"), "key") == ["billing:1", "billing:2"]


def test_an_exact_key_rule_names_one_key_only(world: World) -> None:
    user = make_user(*ALL_PERMISSIONS)
    AccessRule.objects.create(user=user, pattern="billing:2", read=True)
    client = client_for(user)
    assert keys(client.get("/api/locks/"), "key") == ["billing:2"]
    assert client.get("/api/locks/billing:1").status_code == 403


def test_prefixes_are_case_sensitive_in_lists_on_every_database(billing: APIClient) -> None:
    locks.acquire("Billing:1", holder="h", ttl=30)
    locks.acquire("billing:1", holder="h", ttl=30)
    assert keys(billing.get("/api/locks/"), "key") == ["billing:1"]


# --- cost ------------------------------------------------------------------------------


def test_evaluating_the_rules_is_one_query(django_assert_num_queries: Any) -> None:
    user = billing_user()
    user = User.objects.get(pk=user.pk)  # no cached groups
    with django_assert_num_queries(1):
        rules = access.access_for(user)
    assert rules.allows("acquire", "billing:1") and not rules.allows("revoke", "billing:1")
    with django_assert_num_queries(0):
        access.access_for(User(is_superuser=True, is_active=True))


def test_the_api_reads_the_rules_once_per_request(world: World) -> None:
    client = client_for(billing_user())
    body = {"lock_key": "billing:2", **proof(world.inside), "data": 1, "step": 4}
    with CaptureQueriesContext(connection) as queries:
        assert put(client, "/api/documents/bill-1", body).status_code == 200
    # Checked twice (the grant's key, the document's key), read once.
    assert sum("coordination_accessrule" in query["sql"] for query in queries.captured_queries) == 1


def test_a_stale_write_inside_is_still_refused_by_the_fence(world: World, billing: APIClient) -> None:
    newer = locks.acquire("billing:1", holder="billing-svc", ttl=30, wait=5)
    documents.put_document("bill-9", newer, 1)
    body = {"lock_key": "billing:1", **proof(world.old), "data": 2}
    response = put(billing, "/api/documents/bill-9", body)
    assert response.status_code == 409 and response.json()["code"] == StaleToken.code
