"""The outbox's admin: what a user sees and may do, by permission and access rules."""

from __future__ import annotations

from typing import Any

import pytest
from django.contrib import admin
from django.contrib.auth.models import Permission, User
from django.contrib.messages.storage.fallback import FallbackStorage
from django.test import RequestFactory

from coordination import locks
from coordination.models import AccessRule, OutboxCall, OutboxState
from coordination.stores.outbox import record_call
from coordination.stores.outbox_admin import OutboxCallAdmin

pytestmark = pytest.mark.django_db


def request_of(user: User) -> Any:
    request = RequestFactory().post("/admin/coordination/outboxcall/")
    request.user = user
    request.session = {}
    request._messages = FallbackStorage(request)
    return request


def operator(*codenames: str, **rule: Any) -> User:
    user = User.objects.create_user(f"op-{User.objects.count()}", is_staff=True)
    user.user_permissions.set(Permission.objects.filter(codename__in=codenames))
    if rule:
        AccessRule.objects.create(user=user, **rule)
    return User.objects.get(pk=user.pk)  # a fresh permission cache


def failed_calls() -> tuple[OutboxCall, OutboxCall]:
    one = record_call("http://127.0.0.1:9/a", {}, grant=locks.acquire("billing:1", holder="t", ttl=30))
    two = record_call("http://127.0.0.1:9/b", {}, grant=locks.acquire("payroll:1", holder="t", ttl=30))
    OutboxCall.objects.update(state=OutboxState.FAILED)
    return OutboxCall.objects.get(pk=one.pk), OutboxCall.objects.get(pk=two.pk)


def test_access_rules_narrow_the_list_and_the_actions() -> None:
    billing, payroll = failed_calls()
    model_admin = OutboxCallAdmin(OutboxCall, admin.site)
    user = operator("view_outboxcall", "relay_outboxcall", pattern="billing:*", read=True, write=True)
    request = request_of(user)
    assert list(model_admin.get_queryset(request)) == [billing]
    assert model_admin.has_relay_permission(request)
    assert not model_admin.has_add_permission(request)
    assert not model_admin.has_delete_permission(request)
    model_admin.retry(request, OutboxCall.objects.all())
    billing.refresh_from_db()
    payroll.refresh_from_db()
    assert (billing.state, payroll.state) == (OutboxState.PENDING, OutboxState.FAILED)


def test_reconcile_needs_the_permission() -> None:
    billing, _ = failed_calls()
    model_admin = OutboxCallAdmin(OutboxCall, admin.site)
    viewer = request_of(operator("view_outboxcall"))
    assert not model_admin.has_relay_permission(viewer)
    assert "reconcile" not in model_admin.get_actions(viewer)
    relay = request_of(operator("view_outboxcall", "relay_outboxcall"))
    assert "reconcile" in model_admin.get_actions(relay)
    model_admin.reconcile(relay, OutboxCall.objects.filter(pk=billing.pk))
    billing.refresh_from_db()
    assert billing.state == OutboxState.SENT and billing.note.startswith("marked reconciled by op-")


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
