"""The admin: read-only history, operator actions with permissions and audit, the dashboard."""

from __future__ import annotations

import itertools
import re
from typing import Any

import pytest
from django.contrib.admin.models import CHANGE, LogEntry
from django.contrib.auth.models import Permission, User
from django.test import Client
from django.urls import reverse

from coordination import fencing, locks, restore
from coordination.admin import FenceAdmin, LockAdmin
from coordination.exceptions import DuplicateWrite, StaleToken
from coordination.models import (
    MAX_TOKEN,
    AcceptedWrite,
    Document,
    Fence,
    Grant,
    GrantEnd,
    IdempotencyRecord,
    Lock,
    Rejection,
)
from coordination.semaphores import acquire_permit, permit_slot
from coordination.shared import acquire_shared
from tests.support.admin_story import tell_the_seed_story
from tests.support.waiting import wait_until_database_time_passes

pytestmark = pytest.mark.django_db

LOCKS = "admin:coordination_lock_changelist"
FENCES = "admin:coordination_fence_changelist"
DASHBOARD = "admin:coordination_dashboard"


@pytest.fixture(autouse=True)
def fast_password_hashing(settings: Any) -> None:
    # admin_user's password hash would otherwise cost ~1 s per test.
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


def staff(django_user_model: type[User], *codenames: str) -> Client:
    user = django_user_model.objects.create_user("operator", is_staff=True)
    user.user_permissions.set(
        Permission.objects.filter(content_type__app_label="coordination", codename__in=codenames)
    )
    client = Client()
    client.force_login(user)
    return client


def three_locks() -> dict[str, Grant]:
    """A held, an expired-not-released and a free lock."""
    held = locks.acquire("job:held", holder="w1", ttl=60)
    expired = locks.acquire("job:expired", holder="w2", ttl=0.2)
    free = locks.acquire("job:free", holder="w3", ttl=60)
    locks.release(free)
    wait_until_database_time_passes(expired.expires_at)
    return {"held": held, "expired": expired, "free": free}


def keys_in(html: str) -> set[str]:
    return set(re.findall(r'<th class="field-key"><a [^>]*>([^<]+)</a>', html))


def states_in(html: str) -> dict[str, str]:
    rows = re.findall(r'field-key"><a [^>]*>([^<]+)</a>.*?data-state="(\w+)"', html, re.S)
    return dict(rows)


def message_texts(response: Any) -> list[str]:
    return [str(message) for message in response.context["messages"]]


# --- locks ------------------------------------------------------------------


def test_lock_states_are_decided_with_the_database_clock(admin_client: Client) -> None:
    three_locks()
    html = admin_client.get(reverse(LOCKS)).content.decode()
    assert states_in(html) == {"job:held": "held", "job:expired": "expired", "job:free": "free"}
    assert "expired " in html and " ago" in html  # "expires in" of the expired lease


@pytest.mark.parametrize("state", ["held", "expired", "free"])
def test_state_filter_lists_only_locks_in_that_state(admin_client: Client, state: str) -> None:
    three_locks()
    html = admin_client.get(reverse(LOCKS), {"state": state}).content.decode()
    assert keys_in(html) == {f"job:{state}"}


def test_lock_search_finds_key_and_holder(admin_client: Client) -> None:
    three_locks()
    assert keys_in(admin_client.get(reverse(LOCKS), {"q": "w1"}).content.decode()) == {"job:held"}
    assert keys_in(admin_client.get(reverse(LOCKS), {"q": "expired"}).content.decode()) == {
        "job:expired"
    }


def test_lock_list_shows_the_token_floor(admin_client: Client) -> None:
    assert 'data-token-floor="0"' in admin_client.get(reverse(LOCKS)).content.decode()

    restore.raise_floor_to(1000)

    page = admin_client.get(reverse(LOCKS)).content.decode()
    assert 'data-token-floor="1000"' in page
    assert "Token floor: <strong>1000</strong>" in page


def test_lock_change_page_is_read_only_and_links_grants(admin_client: Client) -> None:
    grant = locks.acquire("job:page", holder="w1", ttl=60)
    lock = Lock.objects.get(key="job:page")
    html = admin_client.get(reverse("admin:coordination_lock_change", args=[lock.pk])).content.decode()
    assert 'name="_save"' not in html
    assert f"?lock__id__exact={lock.pk}" in html
    assert reverse("admin:coordination_lock_revoke", args=[lock.pk]) in html
    grants = admin_client.get(
        reverse("admin:coordination_grant_changelist"), {"lock__id__exact": lock.pk}
    )
    assert grants.status_code == 200
    assert list(grants.context["cl"].result_list) == [Grant.objects.get(token=grant.token, lock=lock)]


def test_revoke_action_asks_first_then_revokes_and_bumps_the_next_token(
    admin_client: Client,
) -> None:
    grant = locks.acquire("job:stuck", holder="w1", ttl=60)
    lock = Lock.objects.get(key="job:stuck")
    form = {"action": "revoke_selected", "_selected_action": [lock.pk]}

    asked = admin_client.post(reverse(LOCKS), form)
    assert asked.status_code == 200
    assert asked.templates[0].name == "coordination/admin/confirm_action.html"
    assert Lock.objects.held().filter(key="job:stuck").exists()

    done = admin_client.post(reverse(LOCKS), {**form, "confirm": "yes"}, follow=True)
    assert message_texts(done) == ["Revoked 1 lock; its next grant gets a higher token."]
    assert Lock.objects.free().filter(key="job:stuck").exists()
    assert Grant.objects.get(lock=lock, token=grant.token).end_reason == GrantEnd.REVOKED
    assert locks.acquire("job:stuck", holder="w2", ttl=5).token == grant.token + 1
    entry = LogEntry.objects.get(object_id=str(lock.pk))
    assert entry.action_flag == CHANGE
    assert f"token {grant.token} held by w1" in entry.get_change_message()


def test_revoke_messages_use_plurals(admin_client: Client) -> None:
    for name in ("a", "b"):
        locks.acquire(f"job:{name}", holder="w", ttl=60)
    locks.release(locks.acquire("job:c", holder="w", ttl=60))
    chosen = list(Lock.objects.values_list("pk", flat=True))
    done = admin_client.post(
        reverse(LOCKS),
        {"action": "revoke_selected", "_selected_action": chosen, "confirm": "yes"},
        follow=True,
    )
    assert message_texts(done) == [
        "Revoked 2 locks; their next grants get higher tokens.",
        "1 lock was already free; nothing to revoke.",
    ]
    assert LogEntry.objects.count() == 2


def test_revoke_page_of_one_lock_confirms_then_revokes(admin_client: Client) -> None:
    locks.acquire("job:one", holder="w1", ttl=60)
    lock = Lock.objects.get(key="job:one")
    url = reverse("admin:coordination_lock_revoke", args=[lock.pk])
    page = admin_client.get(url)
    assert page.status_code == 200 and b"Yes, revoke" in page.content
    done = admin_client.post(url, {"confirm": "yes"})
    assert done.status_code == 302
    assert Lock.objects.get(pk=lock.pk).holder == ""


def test_revoked_holder_is_fenced_out_by_the_next_grant(admin_client: Client) -> None:
    story = tell_the_seed_story()
    lock = Lock.objects.get(key=story.key)
    admin_client.post(
        reverse(LOCKS), {"action": "revoke_selected", "_selected_action": [lock.pk], "confirm": "yes"}
    )
    c = locks.acquire(story.key, holder="worker-C", ttl=30)
    story.account.__class__.objects.filter(pk=story.account.pk).fenced_update(c, owner="carol")
    with pytest.raises(StaleToken):
        story.account.__class__.objects.filter(pk=story.account.pk).fenced_update(
            story.b, owner="bob"
        )


# --- fences -----------------------------------------------------------------


def restored_fence() -> tuple[Fence, Grant, Grant]:
    """A fence whose watermark is behind its lock's tokens, as after a restore."""
    old = locks.acquire("mailer:1", holder="w1", ttl=0.2)
    with fencing.fence("mailbox-1", old):
        pass
    wait_until_database_time_passes(old.expires_at)
    newer = locks.acquire("mailer:1", holder="w2", ttl=60)
    return Fence.objects.get(resource="mailbox-1"), old, newer


def test_raise_action_makes_older_tokens_stale(admin_client: Client) -> None:
    fence, old, newer = restored_fence()
    form = {"action": "raise_to_lock_token", "_selected_action": [fence.pk]}
    asked = admin_client.post(reverse(FENCES), form)
    assert asked.templates[0].name == "coordination/admin/confirm_action.html"
    assert Fence.objects.get(pk=fence.pk).token == old.token

    done = admin_client.post(reverse(FENCES), {**form, "confirm": "yes"}, follow=True)
    assert message_texts(done) == [
        "Raised 1 fence to its lock's last token; older tokens are refused."
    ]
    with pytest.raises(StaleToken), fencing.fence("mailbox-1", old):
        pass  # pragma: no cover
    with fencing.fence("mailbox-1", newer):
        pass
    entry = LogEntry.objects.get(object_id=str(fence.pk))
    assert f"from {old.token} (step 1) to {newer.token} (step 0)" in entry.get_change_message()


def test_raise_messages_use_plurals_and_never_lower(admin_client: Client) -> None:
    _fence, _old, newer = restored_fence()
    with fencing.fence("mailbox-2", newer):
        pass
    chosen = list(Fence.objects.values_list("pk", flat=True))
    done = admin_client.post(
        reverse(FENCES),
        {"action": "raise_to_lock_token", "_selected_action": chosen, "confirm": "yes"},
        follow=True,
    )
    assert message_texts(done) == [
        "Raised 1 fence to its lock's last token; older tokens are refused.",
        "1 fence was already at its lock's last token; left as it is.",
    ]
    assert Fence.objects.get(resource="mailbox-2").step == 1


def test_raise_page_of_one_fence_confirms_then_raises(admin_client: Client) -> None:
    fence, _old, newer = restored_fence()
    url = reverse("admin:coordination_fence_raise", args=[fence.pk])
    assert b"Yes, raise" in admin_client.get(url).content
    assert admin_client.post(url, {"confirm": "yes"}).status_code == 302
    assert Fence.objects.get(pk=fence.pk).token == newer.token


def test_raise_fence_to_lock_keeps_a_higher_watermark_and_can_seal_the_last_token() -> None:
    fence, old, newer = restored_fence()
    result = fencing.raise_fence_to_lock(fence, step=MAX_TOKEN)
    assert result.raised and result.after == (newer.token, MAX_TOKEN)
    with pytest.raises(DuplicateWrite), fencing.fence("mailbox-1", newer):
        pass  # pragma: no cover
    again = fencing.raise_fence_to_lock("mailbox-1")
    assert not again.raised and again.after == (newer.token, MAX_TOKEN)
    assert old.token < newer.token


# --- permissions ------------------------------------------------------------


def test_staff_without_operator_permissions_sees_no_actions_and_gets_403(
    django_user_model: type[User],
) -> None:
    fence, _old, _newer = restored_fence()
    lock = Lock.objects.get(key="mailer:1")
    client = staff(django_user_model, "view_lock", "view_fence", "view_grant")

    lock_list = client.get(reverse(LOCKS)).content.decode()
    fence_list = client.get(reverse(FENCES)).content.decode()
    assert "revoke_selected" not in lock_list and "raise_to_lock_token" not in fence_list
    change = client.get(reverse("admin:coordination_lock_change", args=[lock.pk])).content.decode()
    assert "/revoke/" not in change

    forged = [
        client.post(reverse(LOCKS), {"action": "revoke_selected", "_selected_action": [lock.pk],
                                     "confirm": "yes"}),
        client.post(reverse(FENCES), {"action": "raise_to_lock_token",
                                      "_selected_action": [fence.pk], "confirm": "yes"}),
        client.get(reverse("admin:coordination_lock_revoke", args=[lock.pk])),
        client.post(reverse("admin:coordination_lock_revoke", args=[lock.pk]), {"confirm": "yes"}),
        client.get(reverse("admin:coordination_fence_raise", args=[fence.pk])),
        client.post(reverse("admin:coordination_fence_raise", args=[fence.pk]), {"confirm": "yes"}),
    ]
    assert [response.status_code for response in forged] == [403] * 6
    assert Lock.objects.held().filter(pk=lock.pk).exists()
    assert LogEntry.objects.count() == 0


def test_operator_with_the_permissions_can_act(django_user_model: type[User]) -> None:
    locks.acquire("job:op", holder="w1", ttl=60)
    lock = Lock.objects.get(key="job:op")
    client = staff(django_user_model, "view_lock", "revoke_lock")
    assert "revoke_selected" in client.get(reverse(LOCKS)).content.decode()
    client.post(reverse("admin:coordination_lock_revoke", args=[lock.pk]), {"confirm": "yes"})
    assert Lock.objects.free().filter(pk=lock.pk).exists()


def test_operator_actions_are_csrf_protected(admin_user: User) -> None:
    locks.acquire("job:csrf", holder="w1", ttl=60)
    lock = Lock.objects.get(key="job:csrf")
    client = Client(enforce_csrf_checks=True)
    client.force_login(admin_user)
    responses = [
        client.post(reverse(LOCKS), {"action": "revoke_selected", "_selected_action": [lock.pk],
                                     "confirm": "yes"}),
        client.post(reverse("admin:coordination_lock_revoke", args=[lock.pk]), {"confirm": "yes"}),
    ]
    assert [response.status_code for response in responses] == [403, 403]
    assert Lock.objects.held().filter(pk=lock.pk).exists()


@pytest.mark.parametrize(
    "model", [Lock, Fence, Grant, Rejection, IdempotencyRecord, Document, AcceptedWrite]
)
def test_nothing_can_be_deleted_added_or_edited_through_the_admin(
    admin_client: Client, rf: Any, admin_user: User, model: Any
) -> None:
    from django.contrib import admin

    model_admin = admin.site._registry[model]
    request = rf.get("/")
    request.user = admin_user
    assert not model_admin.has_delete_permission(request)
    assert not model_admin.has_add_permission(request)
    assert not model_admin.has_change_permission(request)
    assert "delete_selected" not in model_admin.get_actions(request)


def test_delete_url_of_a_lock_is_forbidden(admin_client: Client) -> None:
    locks.acquire("job:keep", holder="w1", ttl=60)
    lock = Lock.objects.get(key="job:keep")
    response = admin_client.post(
        reverse("admin:coordination_lock_delete", args=[lock.pk]), {"post": "yes"}
    )
    assert response.status_code == 403
    assert Lock.objects.filter(pk=lock.pk).exists()


def test_operator_permissions_are_checked_by_the_admins(rf: Any, admin_user: User) -> None:
    from django.contrib import admin

    request = rf.get("/")
    request.user = admin_user
    lock_admin = admin.site._registry[Lock]
    fence_admin = admin.site._registry[Fence]
    assert isinstance(lock_admin, LockAdmin) and isinstance(fence_admin, FenceAdmin)
    assert lock_admin.has_revoke_permission(request)
    assert fence_admin.has_raise_permission(request)


# --- read-only pages ------------------------------------------------------------


def test_every_history_page_renders(admin_client: Client) -> None:
    story = tell_the_seed_story(release_b=True)
    fencing.idempotent("charge:1", lambda: {"ok": True})
    with fencing.fence("mailbox-9", story.b):
        pass
    for model in ("lock", "grant", "fence", "rejection", "idempotencyrecord", "acceptedwrite",
                  "document"):
        listing = admin_client.get(reverse(f"admin:coordination_{model}_changelist"))
        assert listing.status_code == 200, model
        rows = listing.context["cl"].result_list
        if model != "document":
            assert rows, model
            change = admin_client.get(
                reverse(f"admin:coordination_{model}_change", args=[rows[0].pk])
            )
            assert change.status_code == 200, model
    grants = admin_client.get(
        reverse("admin:coordination_grant_changelist"), {"end": "expired"}
    ).context["cl"].result_list
    assert [grant.holder for grant in grants] == ["worker-A"]
    refused = admin_client.get(
        reverse("admin:coordination_rejection_changelist"), {"reason": "stale_token"}
    ).context["cl"].result_list
    assert [(row.token, row.watermark_token) for row in refused] == [(story.a.token, story.b.token)]


def test_accepted_writes_are_recorded_only_when_asked(settings: Any) -> None:
    story = tell_the_seed_story()
    assert list(AcceptedWrite.objects.values_list("lock_key", "token", "holder")) == [
        (story.key, story.b.token, "worker-B")
    ]
    settings.COORDINATION = {**settings.COORDINATION, "RECORD_WRITES": False}
    tell_the_seed_story(owner="bob")
    assert AcceptedWrite.objects.count() == 1


# --- dashboard ------------------------------------------------------------------


def test_index_links_the_dashboard(admin_client: Client) -> None:
    assert reverse(DASHBOARD) in admin_client.get(reverse("admin:index")).content.decode()


def test_dashboard_draws_the_seed_story_on_the_timeline(admin_client: Client) -> None:
    story = tell_the_seed_story()
    response = admin_client.get(reverse(DASHBOARD), {"key": story.key})
    html = response.content.decode()
    data = response.context["dashboard"]
    (timeline,) = data.timelines
    assert [(lane.token, lane.holder, lane.end) for lane in timeline.lanes] == [
        (story.a.token, "worker-A", "expired"),
        (story.b.token, "worker-B", "live"),
    ]
    a_lane, b_lane = timeline.lanes
    # A's bar ends at its expiry, before B's starts, on the database-time axis.
    assert a_lane.ends_at == story.a.expires_at <= b_lane.acquired_at
    assert a_lane.bar_x + a_lane.bar_width <= b_lane.bar_x + 0.5
    assert re.search(
        rf'data-kind="refused-write" data-token="{story.a.token}"[^>]*data-reason="stale_token"', html
    )
    assert re.search(rf'data-kind="accepted-write" data-token="{story.b.token}"', html)
    (refused,) = [mark for mark in timeline.marks if mark.kind == "refused"]
    assert refused.x > a_lane.bar_x + a_lane.bar_width  # A wrote after its lease ended
    assert '<meta http-equiv="refresh" content="10">' in html


def test_dashboard_and_grant_list_show_each_grants_mode(admin_client: Client) -> None:
    readers = [acquire_shared("report:1", holder=f"reader-{n}", ttl=30) for n in (1, 2)]
    for reader in readers:
        locks.release(reader)
    writer = locks.acquire("report:1", holder="writer", ttl=30)
    response = admin_client.get(reverse(DASHBOARD), {"key": "report:1"})
    (timeline,) = response.context["dashboard"].timelines
    assert [(lane.token, lane.mode) for lane in timeline.lanes] == [
        (readers[0].token, "shared"), (readers[1].token, "shared"), (writer.token, "exclusive"),
    ]
    html = response.content.decode()
    assert re.search(rf'data-token="{readers[0].token}" data-holder="reader-1"[^>]*data-mode="shared"', html)
    assert re.search(rf'data-token="{writer.token}" data-holder="writer"[^>]*data-mode="exclusive"', html)

    grants = admin_client.get(reverse("admin:coordination_grant_changelist"), {"mode": "shared"})
    assert grants.status_code == 200
    assert {g.token for g in grants.context["cl"].result_list} == {r.token for r in readers}


def permits_of_exports() -> list[Any]:
    """Five permits of semaphore "exports" (limit 2), one after another: two live now."""
    taken = []
    for n in range(5):
        taken.append(acquire_permit("exports", limit=2, holder=f"exporter-{n}", ttl=30))
        if n < 3:
            locks.release(taken[-1])
    return taken


def test_dashboard_draws_a_semaphores_slots_together_on_one_timeline(admin_client: Client) -> None:
    taken = permits_of_exports()
    plain = locks.acquire("job:plain", holder="other", ttl=30)
    response = admin_client.get(reverse(DASHBOARD), {"refresh": "0"})
    data = response.context["dashboard"]
    # The slots' keys are the most recent, yet they make one timeline, not two.
    assert [t.key for t in data.timelines][:2] == ["job:plain", "exports@*"]
    semaphore = next(t for t in data.timelines if t.semaphore == "exports")
    assert not [t for t in data.timelines if t.key.startswith("exports@") and not t.semaphore]
    assert [(row.slot, row.key, row.state) for row in semaphore.slots] == [
        (1, "exports@1", "held"), (2, "exports@2", "held"),
    ]
    assert semaphore.held == 2
    drawn = sorted((lane.key, lane.token, lane.holder) for lane in semaphore.lanes)
    assert drawn == sorted((p.key, p.token, p.holder) for p in taken)
    for row in semaphore.slots:
        # Each row holds its own slot's grants only, in time order, never overlapping.
        assert {lane.key for lane in row.lanes} == {row.key}
        assert all(lane.y == row.y for lane in row.lanes)
        for earlier, later in itertools.pairwise(row.lanes):
            assert earlier.ends_at <= later.acquired_at and earlier.token < later.token
    html = response.content.decode()
    assert re.search(r'<g class="slot" data-slot="2" data-key="exports@2" data-state="held">', html)
    last = taken[-1]
    assert re.search(
        rf'data-token="{last.token}" data-holder="{last.holder}"[^>]*data-mode="exclusive" '
        rf'data-slot="{permit_slot(last)}" data-lock="{last.key}"', html,
    )
    # Chosen by name (or by any slot's key) it is the same timeline.
    for key in ("exports@*", "exports@2"):
        chosen = admin_client.get(reverse(DASHBOARD), {"key": key}).context["dashboard"]
        assert [t.key for t in chosen.timelines] == ["exports@*"]
    locks.release(plain)


def test_dashboard_counts_and_charts_the_last_hour(admin_client: Client) -> None:
    three_locks()
    tell_the_seed_story()
    data = admin_client.get(reverse(DASHBOARD), {"refresh": "0"}).context["dashboard"]
    counts = data.counts
    assert (counts.held, counts.expired, counts.free) == (2, 1, 1)
    assert (counts.grants_hour, counts.grants_day) == (5, 5)
    assert (counts.refused_hour, counts.accepted_hour) == (1, 1)
    assert data.chart.grants_total == 5 and data.chart.refused_total == 1
    assert sum(bar.count for bar in data.chart.bars if bar.kind == "grants") == 5
    assert data.contended[0].key.startswith("account:") and data.contended[0].holders == 2
    assert {timeline.key for timeline in data.timelines} >= {"job:held", "job:expired"}
    unreleased = next(t for t in data.timelines if t.key == "job:expired").lanes[0]
    assert unreleased.end == "expired-not-released"


def test_dashboard_needs_view_permission_on_locks(django_user_model: type[User]) -> None:
    assert staff(django_user_model).get(reverse(DASHBOARD)).status_code == 403
    assert Client().get(reverse(DASHBOARD)).status_code == 302  # to the login page


def test_dashboard_for_an_unknown_key_says_so(admin_client: Client) -> None:
    response = admin_client.get(reverse(DASHBOARD), {"key": "nope:1"})
    assert response.status_code == 200 and b"No such lock." in response.content


def test_timeline_labels_shorten_celery_task_holders() -> None:
    from coordination.dashboard import _short_holder

    holder = "project.demo.tasks.deposit[6dec905c-cd79-4c4f-9e36-94ed448d2f40]#1 on vm:5470"
    assert _short_holder(holder) == "deposit on vm:5470"
    assert _short_holder("worker-A") == "worker-A"
    assert _short_holder("x" * 40) == "x" * 19 + "\u2026"
