"""The outbox's admin: what a user sees and may do, by permission and access rules.

Retry and mark reconciled are operator actions like revoking a lock: the
permission (403 without it, even on a forged POST), a confirmation page,
``write`` on every chosen call's key (403 unless all allow it), an admin log
entry per call moved and a message.
"""

from __future__ import annotations

from typing import Any

import pytest
from django.contrib import admin
from django.contrib.admin.models import CHANGE, LogEntry
from django.contrib.auth.models import Permission, User
from django.test import Client
from django.urls import reverse

from coordination import locks
from coordination.admin import OutboxCallAdmin
from coordination.models import AccessRule, OutboxCall, OutboxState
from coordination.stores.outbox import record_call

pytestmark = pytest.mark.django_db

LIST = "admin:coordination_outboxcall_changelist"


@pytest.fixture(autouse=True)
def fast_password_hashing(settings: Any) -> None:
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


def operator(*codenames: str, **rule: Any) -> User:
    user = User.objects.create_user(f"op-{User.objects.count()}", is_staff=True)
    user.user_permissions.set(Permission.objects.filter(codename__in=codenames))
    if rule:
        AccessRule.objects.create(user=user, **rule)
    return User.objects.get(pk=user.pk)  # a fresh permission cache


def client_of(user: User) -> Client:
    client = Client()
    client.force_login(user)
    return client


def failed_calls() -> tuple[OutboxCall, OutboxCall]:
    one = record_call("http://127.0.0.1:9/a", {}, grant=locks.acquire("billing:1", holder="t", ttl=30))
    two = record_call("http://127.0.0.1:9/b", {}, grant=locks.acquire("payroll:1", holder="t", ttl=30))
    OutboxCall.objects.update(state=OutboxState.FAILED)
    return OutboxCall.objects.get(pk=one.pk), OutboxCall.objects.get(pk=two.pk)


def act(client: Client, action: str, *calls: OutboxCall, confirm: bool = True) -> Any:
    fields: dict[str, Any] = {"action": action, "_selected_action": [call.pk for call in calls]}
    if confirm:
        fields["confirm"] = "yes"
    return client.post(reverse(LIST), fields, follow=True)


def states(*calls: OutboxCall) -> list[str]:
    return [OutboxCall.objects.get(pk=call.pk).state for call in calls]


def test_the_list_shows_the_calls_of_the_keys_the_user_may_read() -> None:
    billing, _ = failed_calls()
    user = operator("view_outboxcall", "relay_outboxcall", pattern="billing:*", read=True, write=True)
    response = client_of(user).get(reverse(LIST))
    assert response.status_code == 200
    assert list(response.context["cl"].queryset) == [billing]
    model_admin = OutboxCallAdmin(OutboxCall, admin.site)
    request = response.wsgi_request
    assert not model_admin.has_add_permission(request)
    assert not model_admin.has_delete_permission(request)


def test_retry_asks_for_confirmation_then_moves_logs_and_says_so() -> None:
    billing, payroll = failed_calls()
    client = client_of(operator("view_outboxcall", "relay_outboxcall"))
    asked = act(client, "retry", billing, confirm=False)
    assert asked.status_code == 200
    html = asked.content.decode()
    assert "Retry this call?" in html and "Yes, retry" in html and billing.target in html
    assert states(billing) == [OutboxState.FAILED]  # nothing moved before the confirmation

    done = act(client, "retry", billing)
    assert done.status_code == 200
    assert states(billing, payroll) == [OutboxState.PENDING, OutboxState.FAILED]
    entry = LogEntry.objects.get(object_id=str(billing.pk), action_flag=CHANGE)
    assert entry.user.username.startswith("op-")
    assert billing.idempotency_key in entry.get_change_message()
    said = [str(message) for message in done.context["messages"]]
    assert any("1 call set to pending" in text for text in said), said


def test_mark_reconciled_records_the_operator_and_skips_calls_in_other_states() -> None:
    billing, payroll = failed_calls()
    OutboxCall.objects.filter(pk=payroll.pk).update(state=OutboxState.SENT)
    user = operator("view_outboxcall", "relay_outboxcall")
    done = act(client_of(user), "reconcile", billing, payroll)
    billing.refresh_from_db()
    assert billing.state == OutboxState.SENT and billing.note == f"marked reconciled by {user.username}"
    assert LogEntry.objects.filter(action_flag=CHANGE).count() == 1  # only the call it moved
    said = [str(message) for message in done.context["messages"]]
    assert any("1 call marked reconciled" in text for text in said), said
    assert any("1 call was not failed" in text for text in said), said


@pytest.mark.parametrize("action", ["retry", "reconcile"])
def test_the_actions_need_the_relay_permission_even_on_a_forged_post(action: str) -> None:
    billing, _ = failed_calls()
    viewer = operator("view_outboxcall")
    model_admin = OutboxCallAdmin(OutboxCall, admin.site)
    response = client_of(viewer).get(reverse(LIST))
    assert action not in model_admin.get_actions(response.wsgi_request)
    assert act(client_of(viewer), action, billing).status_code == 403
    assert states(billing) == [OutboxState.FAILED]
    assert not LogEntry.objects.exists()


@pytest.mark.parametrize("action", ["retry", "reconcile"])
def test_the_actions_need_write_on_the_calls_key(action: str) -> None:
    billing, _ = failed_calls()
    reader = operator("view_outboxcall", "relay_outboxcall", pattern="billing:*", read=True)
    assert act(client_of(reader), action, billing, confirm=False).status_code == 403
    assert act(client_of(reader), action, billing).status_code == 403
    assert states(billing) == [OutboxState.FAILED]
    assert not LogEntry.objects.exists()
    writer = operator("view_outboxcall", "relay_outboxcall", pattern="billing:*", read=True, write=True)
    assert act(client_of(writer), action, billing).status_code == 200
    assert states(billing) != [OutboxState.FAILED]


def test_metrics_count_calls_by_state() -> None:
    pytest.importorskip("prometheus_client")
    from prometheus_client import CollectorRegistry, generate_latest

    from coordination.stores import outbox_metrics

    failed_calls()
    registry = CollectorRegistry()
    outbox_metrics.install(registry)
    text = generate_latest(registry).decode()
    assert 'coordination_outbox_calls{state="failed"} 2.0' in text
    assert 'coordination_outbox_calls{state="sent"} 0.0' in text
