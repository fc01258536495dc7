"""Access rules in the admin and the dashboard, the rules' own admin, and re-binding documents.

The dashboard shows grants, refused and accepted writes only to users with the
matching view permissions, and only of the keys their rules let them read; the
admin lists of per-key rows leave out the other keys. Re-binding a document
needs its own permission, goes through a confirmation page, leaves a log entry
and never lowers the document's watermark.
"""

from __future__ import annotations

import re
from io import StringIO
from typing import Any

import pytest
from django.contrib.admin.models import CHANGE, LogEntry
from django.contrib.auth.models import Group, Permission, User
from django.core.management import call_command
from django.test import Client
from django.urls import reverse
from rest_framework.authtoken.models import Token

from coordination import documents, locks
from coordination.exceptions import DuplicateWrite, InvalidInput, StaleToken, WrongLock
from coordination.leases import Lease
from coordination.models import AccessRule, Document, Fence, IdempotencyRecord, Lock
from tests.support.admin_story import tell_the_seed_story

pytestmark = pytest.mark.django_db

DASHBOARD = "admin:coordination_dashboard"
VIEW_ALL = ("view_lock", "view_grant", "view_fence", "view_rejection", "view_acceptedwrite",
            "view_document", "view_idempotencyrecord")


@pytest.fixture(autouse=True)
def fast_password_hashing(settings: Any) -> None:
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


def staff(*codenames: str, pattern: str | None = None, **actions: bool) -> Client:
    """A logged-in staff user with these permissions and, given a pattern, one access rule."""
    user = User.objects.create_user(f"operator-{User.objects.count()}", is_staff=True)
    user.user_permissions.set(
        Permission.objects.filter(content_type__app_label="coordination", codename__in=codenames)
    )
    if pattern is not None:
        AccessRule.objects.create(user=user, pattern=pattern, **(actions or {"read": True}))
    client = Client()
    client.force_login(user)
    return client


def billing_keys() -> tuple[Lease, Lease]:
    """billing:1 with a refused and an accepted document write, billing:2 held."""
    one = locks.acquire("billing:1", holder="billing-one", ttl=60)
    documents.put_document("bill-1", one, {"total": 1}, step=1)
    with pytest.raises(DuplicateWrite):
        documents.put_document("bill-1", one, {"total": 1}, step=1)
    return one, locks.acquire("billing:2", holder="billing-two", ttl=60)


# --- the dashboard finding ----------------------------------------------------------


def test_a_user_who_may_only_view_locks_sees_no_grants_or_writes_on_the_dashboard() -> None:
    story = tell_the_seed_story()
    response = staff("view_lock").get(reverse(DASHBOARD), {"key": story.key, "refresh": "0"})
    assert response.status_code == 200
    html = response.content.decode()
    data = response.context["dashboard"]
    assert (data.counts.held, data.counts.free) == (1, 0)  # locks: theirs to see
    assert data.counts.grants_hour is None and data.counts.refused_hour is None
    assert data.counts.accepted_hour is None
    assert data.chart is None and data.contended is None and data.timelines == []
    for hidden in ("worker-A", "worker-B", 'data-kind="grant"', "refused-write", "accepted-write",
                   'data-metric="grants"', 'data-metric="refused"', 'data-metric="accepted"'):
        assert hidden not in html, hidden
    assert "who may view grants" in html


def test_grants_without_the_rejection_permission_show_no_refused_writes() -> None:
    story = tell_the_seed_story()
    response = staff("view_lock", "view_grant").get(reverse(DASHBOARD), {"key": story.key})
    html = response.content.decode()
    data = response.context["dashboard"]
    (timeline,) = data.timelines
    assert [lane.holder for lane in timeline.lanes] == ["worker-A", "worker-B"]
    assert [mark.kind for mark in timeline.marks] == []
    assert data.counts.refused_hour is None and data.chart.refused_total is None
    assert data.contended[0].refused is None
    assert "refused-write" not in html and "accepted-write" not in html
    assert 'data-kind="refused"' not in html and 'data-metric="refused"' not in html


def test_with_every_view_permission_the_dashboard_shows_everything() -> None:
    story = tell_the_seed_story()
    data = staff(*VIEW_ALL).get(reverse(DASHBOARD), {"key": story.key}).context["dashboard"]
    (timeline,) = data.timelines
    assert sorted(mark.kind for mark in timeline.marks) == ["accepted", "refused"]
    assert (data.counts.refused_hour, data.counts.accepted_hour) == (1, 1)


def test_the_dashboard_shows_only_the_keys_the_rules_let_the_user_read() -> None:
    story = tell_the_seed_story()
    billing_keys()
    client = staff(*VIEW_ALL, pattern="billing:*")
    response = client.get(reverse(DASHBOARD), {"refresh": "0"})
    html = response.content.decode()
    data = response.context["dashboard"]
    assert {timeline.key for timeline in data.timelines} == {"billing:1", "billing:2"}
    assert {row.key for row in data.contended} == {"billing:1", "billing:2"}
    assert (data.counts.held, data.counts.expired, data.counts.free) == (2, 0, 0)
    assert (data.counts.grants_hour, data.counts.refused_hour, data.counts.accepted_hour) == (2, 1, 1)
    assert data.chart.grants_total == 2 and data.chart.refused_total == 1
    assert story.key not in html and "worker-A" not in html and "worker-B" not in html
    # Asking for a key outside is as asking for one that does not exist.
    asked = client.get(reverse(DASHBOARD), {"key": story.key})
    assert asked.context["dashboard"].timelines == []
    assert "worker-A" not in asked.content.decode() and "No such lock." in asked.content.decode()


# --- admin lists --------------------------------------------------------------------------


def changelist_rows(client: Client, model: str) -> str:
    response = client.get(reverse(f"admin:coordination_{model}_changelist"))
    assert response.status_code == 200, model
    return response.content.decode()


def test_admin_lists_leave_out_the_keys_outside_the_rules() -> None:
    story = tell_the_seed_story()
    locks.acquire("account:other", holder="someone", ttl=60)
    billing_keys()
    client = staff(*VIEW_ALL, pattern="billing:*")
    for model in ("lock", "grant", "fence", "rejection", "acceptedwrite", "document"):
        html = changelist_rows(client, model)
        assert "billing:1" in html, model
        assert story.key not in html and "account:other" not in html, model
        assert "worker-A" not in html and "worker-B" not in html, model
    lock = Lock.objects.get(key=story.key)
    outside = client.get(reverse("admin:coordination_lock_change", args=[lock.pk]))
    assert outside.status_code == 302  # the admin's "does not exist" redirect


def test_idempotency_records_are_hidden_from_a_user_limited_by_rules() -> None:
    IdempotencyRecord.objects.create(key="coordination.api.document:abc", result={"data": "secret"})
    assert "coordination.api.document:abc" in changelist_rows(staff(*VIEW_ALL), "idempotencyrecord")
    limited = staff(*VIEW_ALL, pattern="billing:*")
    assert "coordination.api.document:abc" not in changelist_rows(limited, "idempotencyrecord")


def test_revoking_needs_the_revoke_action_on_the_key() -> None:
    billing_keys()
    lock = Lock.objects.get(key="billing:2")
    url = reverse("admin:coordination_lock_revoke", args=[lock.pk])
    reader = staff("view_lock", "revoke_lock", pattern="billing:*", read=True)
    assert reader.get(url).status_code == 403
    assert reader.post(url, {"confirm": "yes"}).status_code == 403
    assert Lock.objects.get(pk=lock.pk).holder == "billing-two"
    operator = staff("view_lock", "revoke_lock", pattern="billing:*", read=True, revoke=True)
    assert operator.post(url, {"confirm": "yes"}).status_code == 302
    assert Lock.objects.get(pk=lock.pk).holder == ""


def test_raising_a_fence_needs_the_revoke_action_on_its_key() -> None:
    billing_keys()
    fence = Fence.objects.get(resource="document:bill-1")
    url = reverse("admin:coordination_fence_raise", args=[fence.pk])
    reader = staff("view_fence", "raise_fence", pattern="billing:*", read=True)
    assert reader.post(url, {"confirm": "yes"}).status_code == 403
    assert staff("view_fence", "raise_fence", pattern="billing:*", read=True,
                 revoke=True).post(url, {"confirm": "yes"}).status_code == 302


# --- the rules' own admin -------------------------------------------------------------------


def add_rule(client: Client, **fields: Any) -> Any:
    return client.post(reverse("admin:coordination_accessrule_add"), fields)


def test_the_rule_form_shows_what_is_wrong(admin_client: Client) -> None:
    user = User.objects.create_user("billing-bot")
    group = Group.objects.create(name="billing")
    cases = [
        ({"user": user.pk, "pattern": "billing:**", "read": "on"}, "pattern", "may only end"),
        ({"user": user.pk, "pattern": "bil ling", "read": "on"}, "pattern", "forbidden characters"),
        ({"user": user.pk, "pattern": "", "read": "on"}, "pattern", "required"),
        ({"user": user.pk, "group": group.pk, "pattern": "billing:*", "read": "on"}, "user", "not both"),
        ({"pattern": "billing:*", "read": "on"}, "user", "not both"),
        ({"user": user.pk, "pattern": "billing:*"}, "acquire", "at least one action"),
    ]
    for fields, field, message in cases:
        response = add_rule(admin_client, **fields)
        assert response.status_code == 200, fields
        errors = response.context["adminform"].form.errors
        assert message in " ".join(errors.get(field, [])), (fields, errors)
    assert AccessRule.objects.count() == 0
    added = add_rule(admin_client, user=user.pk, pattern="billing:*", acquire="on", write="on")
    assert added.status_code == 302
    rule = AccessRule.objects.get()
    assert (rule.user, rule.pattern, rule.actions) == (user, "billing:*", ["acquire", "write"])
    listed = admin_client.get(reverse("admin:coordination_accessrule_changelist")).content.decode()
    assert "user billing-bot" in listed and "Rules apply" in listed


def test_the_rule_list_says_whether_rules_apply(admin_client: Client, settings: Any) -> None:
    url = reverse("admin:coordination_accessrule_changelist")
    assert "No rule yet, so none applies" in admin_client.get(url).content.decode()
    settings.COORDINATION = {**settings.COORDINATION, "ACCESS_RULES": "enforce"}
    assert "Rules apply" in admin_client.get(url).content.decode()
    settings.COORDINATION = {**settings.COORDINATION, "ACCESS_RULES": "off"}
    assert "Rules are ignored" in admin_client.get(url).content.decode()


# --- re-binding a document -------------------------------------------------------------------


REBIND = "admin:coordination_document_rebind"


@pytest.fixture
def bound() -> tuple[Document, Lease]:
    """invoice-777 bound to attacker:1 at watermark token 5 (the squatting of the finding)."""
    lease = None
    for _ in range(5):
        if lease is not None:
            locks.release(lease)
        lease = locks.acquire("attacker:1", holder="attacker", ttl=60)
    assert lease is not None and lease.token == 5
    documents.put_document("invoice-777", lease, {"owned": True})
    return Document.objects.select_related("fence").get(name="invoice-777"), lease


def test_rebinding_needs_its_own_permission(bound: tuple[Document, Lease]) -> None:
    document, _ = bound
    url = reverse(REBIND, args=[document.pk])
    client = staff("view_document", "change_document")
    assert client.get(url).status_code == 403
    assert client.post(url, {"lock_key": "invoice:777", "confirm": "yes"}).status_code == 403
    assert Fence.objects.get(pk=document.fence_id).lock_key == "attacker:1"
    change = client.get(reverse("admin:coordination_document_change", args=[document.pk]))
    assert url not in change.content.decode()


def test_rebinding_asks_for_confirmation_then_moves_the_document(
    bound: tuple[Document, Lease], admin_client: Client
) -> None:
    document, attacker = bound
    early = locks.release(locks.acquire("invoice:777", holder="billing", ttl=60))  # token 1
    url = reverse(REBIND, args=[document.pk])
    assert url in admin_client.get(
        reverse("admin:coordination_document_change", args=[document.pk])
    ).content.decode()
    form = admin_client.get(url)
    assert form.status_code == 200 and b'name="lock_key"' in form.content
    for bad, message in (("bad key", "forbidden characters"), ("attacker:1", "already bound")):
        response = admin_client.post(url, {"lock_key": bad})
        assert message in " ".join(response.context["form"].errors["lock_key"])
    confirm = admin_client.post(url, {"lock_key": "invoice:777"})
    html = confirm.content.decode()
    assert "Yes, re-bind" in html and 'name="lock_key" value="invoice:777"' in html
    assert "1 \u2192 5" in html  # the new key's counter, now and after
    assert Fence.objects.get(pk=document.fence_id).lock_key == "attacker:1"  # not yet
    done = admin_client.post(url, {"lock_key": "invoice:777", "confirm": "yes"})
    assert done.status_code == 302
    fence = Fence.objects.get(pk=document.fence_id)
    assert (fence.lock_key, fence.token) == ("invoice:777", 5)  # the watermark stays
    assert Lock.objects.get(key="invoice:777").token == 5  # raised past the watermark
    entry = LogEntry.objects.get(object_id=str(document.pk), action_flag=CHANGE)
    assert "from lock attacker:1 to lock invoice:777" in entry.get_change_message()
    # The squatter is fenced out, the new key's early grant is stale, its next one writes.
    with pytest.raises(WrongLock):
        documents.put_document("invoice-777", attacker, {"owned": "again"}, step=9)
    with pytest.raises(StaleToken):
        documents.put_document("invoice-777", early, {"total": 1})
    fresh = locks.acquire("invoice:777", holder="billing", ttl=60)
    assert fresh.token == 6
    assert documents.put_document("invoice-777", fresh, {"total": 1}).data == {"total": 1}


def test_rebinding_waits_for_a_lease_whose_counter_it_would_raise(
    bound: tuple[Document, Lease], admin_client: Client
) -> None:
    document, _ = bound
    held = locks.acquire("invoice:777", holder="billing-7", ttl=60)
    url = reverse(REBIND, args=[document.pk])
    response = admin_client.post(url, {"lock_key": "invoice:777", "confirm": "yes"})
    assert "Release or revoke it first" in " ".join(response.context["form"].errors["lock_key"])
    with pytest.raises(InvalidInput, match="Release or revoke it first"):
        documents.rebind_document("invoice-777", "invoice:777")
    assert Lock.objects.get(key="invoice:777").token == held.token == 1
    assert Fence.objects.get(pk=document.fence_id).lock_key == "attacker:1"
    locks.revoke("invoice:777")
    assert admin_client.post(url, {"lock_key": "invoice:777", "confirm": "yes"}).status_code == 302
    assert Fence.objects.get(pk=document.fence_id).lock_key == "invoice:777"


def test_rebinding_never_lowers_a_counter_or_the_watermark(bound: tuple[Document, Lease]) -> None:
    document, _ = bound
    Lock.objects.create(key="busy:1", token=40)
    result = documents.rebind_document("invoice-777", "busy:1")
    assert (result.counter_before, result.counter_after, result.watermark) == (40, 40, (5, 1))
    assert Lock.objects.get(key="busy:1").token == 40
    fence = Fence.objects.get(pk=document.fence_id)
    assert (fence.lock_key, fence.token, fence.step) == ("busy:1", 5, 1)


def test_rebinding_stays_within_the_operators_rules(bound: tuple[Document, Lease]) -> None:
    document, _ = bound
    documents.rebind_document("invoice-777", "billing:777")
    operator = staff("view_document", "rebind_document", pattern="billing:*", read=True, write=True)
    url = reverse(REBIND, args=[document.pk])
    response = operator.post(url, {"lock_key": "account:777"})
    assert "do not allow" in " ".join(response.context["form"].errors["lock_key"])
    assert operator.post(url, {"lock_key": "account:777", "confirm": "yes"}).status_code == 200
    assert Fence.objects.get(pk=document.fence_id).lock_key == "billing:777"
    other = documents.put_document("other", locks.acquire("account:9", holder="h", ttl=60), 1)
    assert operator.get(reverse(REBIND, args=[other.pk])).status_code == 404
    assert operator.get(reverse(REBIND, args=["abc"])).status_code == 404


def test_rebinding_to_a_key_the_operator_may_write_works_under_rules(bound: tuple[Document, Lease]) -> None:
    document, _ = bound
    documents.rebind_document("invoice-777", "billing:777")
    operator = staff("view_document", "rebind_document", pattern="billing:*", read=True, write=True)
    url = reverse(REBIND, args=[document.pk])
    assert operator.post(url, {"lock_key": "billing:778", "confirm": "yes"}).status_code == 302
    assert Fence.objects.get(pk=document.fence_id).lock_key == "billing:778"
    assert re.search(r"billing:777", LogEntry.objects.get().get_change_message())


# --- API tokens ---------------------------------------------------------------------------


TOKENS = "admin:authtoken_tokenproxy_changelist"


def token_staff(*codenames: str) -> tuple[User, Client]:
    """A staff user with these permissions on tokens (and nothing else)."""
    user = User.objects.create_user(f"token-user-{User.objects.count()}", is_staff=True)
    user.user_permissions.set(
        Permission.objects.filter(content_type__app_label="authtoken", codename__in=codenames)
    )
    client = Client()
    client.force_login(user)
    return user, client


def test_one_view_permission_shows_no_other_users_token() -> None:
    boss = User.objects.create_superuser("boss")
    boss_key = Token.objects.create(user=boss).key
    user, client = token_staff("view_tokenproxy")
    own = Token.objects.create(user=user).key
    html = client.get(reverse(TOKENS)).content.decode()
    assert boss_key not in html and boss_key[:8] not in html and "boss" not in html
    assert own not in html and f"{own[:4]}\u2026" in html  # one's own, masked
    other = client.get(reverse("admin:authtoken_tokenproxy_change", args=[boss.pk]))
    assert other.status_code == 302 and boss_key not in other.content.decode()


def test_superusers_see_every_token_masked_and_no_page_of_one(admin_client: Client) -> None:
    user = User.objects.create_user("api-client")
    key = Token.objects.create(user=user).key
    html = admin_client.get(reverse(TOKENS)).content.decode()
    assert "api-client" in html and key not in html and f"{key[:4]}\u2026" in html
    # Django names a row by its str(), and a token's is its key: no page of one.
    for page in ("change", "history", "delete"):
        response = admin_client.get(reverse(f"admin:authtoken_tokenproxy_{page}", args=[user.pk]))
        assert response.status_code == 403 and key not in response.content.decode(), page
    assert admin_client.get(reverse("admin:authtoken_tokenproxy_add")).status_code == 403


def test_a_token_is_rotated_and_revoked_with_drf_create_token() -> None:
    """As docs/security.md says: -r gives the user a new key, the old one stops at once."""
    user = User.objects.create_user("api-client")
    call_command("drf_create_token", "api-client", stdout=StringIO())
    old = Token.objects.get(user=user).key
    call_command("drf_create_token", "-r", "api-client", stdout=StringIO())
    new = Token.objects.get(user=user).key
    assert new != old
    client = Client()
    assert client.get("/api/locks/", HTTP_AUTHORIZATION=f"Token {old}").status_code == 401
    assert client.get("/api/locks/", HTTP_AUTHORIZATION=f"Token {new}").status_code == 403
