"""Every admin page of the app keeps to the reader's access rules: a walk as a limited user.

Two tenants, ``tenant-a:*`` and ``tenant-b:*``, each with a row of every model
the app's admins show (locks, grants, fences, refused and accepted writes,
documents, idempotency records, access rules, election roles, beat slots,
unfenced saves, job policies) and of every
:class:`~coordination.admin.FencedModelAdmin` of the site (the demo's
accounts). A staff user with every permission of those apps and rules on
tenant-a's keys only walks every URL each registered admin serves (list,
search, change, history, delete, the operator pages, the dashboard), every
autocomplete that leads to one, and runs every action offered with every row
selected. No answer may carry a trace of tenant-b (a key, a name, a holder),
and no tenant-b row may change. An admin registered later is walked the same
way; the walk fails until the seed below gives it a tenant-b row.
"""

from __future__ import annotations

import datetime as dt
import re
from decimal import Decimal
from typing import Any

import pytest
from django.contrib import admin
from django.contrib.admin.helpers import ACTION_CHECKBOX_NAME
from django.contrib.auth.models import Permission, User
from django.db.models import ForeignKey, Model
from django.test import Client
from django.urls import URLPattern, reverse

from coordination import documents, jobs, locks
from coordination.admin import FencedModelAdmin
from coordination.exceptions import DuplicateWrite
from coordination.fencing import unfenced
from coordination.models import AccessRule, BeatSlot, IdempotencyRecord, JobPolicy
from coordination.stores.outbox import record_call
from project.demo.models import Account
from tests.support.hostile import tally_requests  # noqa: F401  (the module's fixture)

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("tally_requests")]

# What a page of tenant-b's rows shows; the walk's own requests never echo these.
TRACES = ("tenant-b:", "tenant-b-", "b-host-17")
HOLDER_B = "bob-scheduler@b-host-17"


@pytest.fixture(autouse=True)
def fast_password_hashing(settings: Any) -> None:
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


def walked_admins() -> list[tuple[type[Model], admin.ModelAdmin]]:  # type: ignore[type-arg]
    """Every admin of the app's models, and every FencedModelAdmin of the site."""
    return sorted(
        (
            (model, model_admin) for model, model_admin in admin.site._registry.items()
            if model._meta.app_label == "coordination" or isinstance(model_admin, FencedModelAdmin)
        ),
        key=lambda pair: pair[0]._meta.label,
    )


def seed_tenant(tenant: str, host: str, owner: User) -> Account:
    """One row of every walked model under ``tenant``'s keys and names."""
    holder = f"{tenant[-1]}ob-scheduler@{host}"
    lease = locks.acquire(f"{tenant}:job", holder=holder, ttl=300)
    documents.put_document(f"{tenant}-doc", lease, {"tenant": tenant}, step=1)
    with pytest.raises(DuplicateWrite):  # a refused write
        documents.put_document(f"{tenant}-doc", lease, {"tenant": tenant}, step=1)
    IdempotencyRecord.objects.create(key=f"{tenant}:idempotency", result={"tenant": tenant})
    record_call(f"https://{host}/{tenant}/hook", {"tenant": tenant}, grant=lease)  # an outbox call
    AccessRule.objects.create(user=owner, pattern=f"{tenant}:*", read=True, write=True)
    locks.acquire(f"election:{tenant}:beat", holder=holder, ttl=300)  # a role and its leader
    BeatSlot.objects.create(
        role=f"{tenant}:beat", entry=f"{tenant}-nightly", task=f"billing.{tenant}-invoices",
        due_at=dt.datetime(2026, 12, 1, 3, tzinfo=dt.UTC), term=1, claimed_by=holder,
    )
    JobPolicy(task=f"{tenant}-jobs.nightly", max_running=2).save(changed_by=holder)
    jobs.tally(f"{tenant}-jobs.nightly", "deferred")
    nightly = locks.acquire(f"{tenant}:nightly", holder=f"{tenant}-jobs.nightly[1]#1 on {host}:1", ttl=300)
    jobs.record_execution(f"{tenant}-jobs.nightly", nightly, task_id="1", attempt=1, worker=f"{host}:1")
    account = Account.objects.create(owner=f"{tenant}-owner", balance=Decimal("10.00"))
    loaded_before = Account.objects.get(pk=account.pk)
    lease = locks.acquire(f"account:{account.pk}", holder=holder, ttl=300)
    Account.objects.filter(pk=account.pk).fenced_update(lease, balance=Decimal("20.00"))
    with unfenced(reason=f"{tenant}-correction", by=holder):  # an audited stale save
        loaded_before.save()
    account.refresh_from_db()
    return account


@pytest.fixture
def tenants() -> tuple[Client, Account]:
    """Both tenants' rows, and a client of tenant-a's operator, limited by rules."""
    seed_tenant("tenant-b", "b-host-17", User.objects.create_user("bob"))
    operator = User.objects.create_user("alice", is_staff=True)
    apps = {model._meta.app_label for model, _ in walked_admins()}
    operator.user_permissions.set(Permission.objects.filter(content_type__app_label__in=apps))
    account = seed_tenant("tenant-a", "a-host-3", operator)
    everything = {"read": True, "write": True, "acquire": True, "revoke": True}
    for pattern in ("election:tenant-a:*", "task:tenant-a-*", f"account:{account.pk}"):
        AccessRule.objects.create(user=operator, pattern=pattern, **everything)
    AccessRule.objects.filter(user=operator, pattern="tenant-a:*").update(**everything)
    client = Client()
    client.force_login(operator)
    return client, account


def traces(response: Any) -> list[str]:
    body = b"".join(response) if response.streaming else response.content
    text = body.decode(errors="replace")
    return [trace for trace in TRACES if trace in text]


def tenant_b_rows() -> dict[str, list[dict[str, Any]]]:
    """Every row of the walked models that belongs to tenant-b, as stored."""
    found: dict[str, list[dict[str, Any]]] = {}
    for model, _ in walked_admins():
        rows = [row for row in model._default_manager.order_by("pk").values()
                if any(trace in str(row) for trace in TRACES) or HOLDER_B in str(row)]
        found[model._meta.label] = rows
    return found


def object_urls(model_admin: admin.ModelAdmin) -> tuple[list[str], list[str]]:  # type: ignore[type-arg]
    """The names of the admin's URLs without arguments and of those naming one row."""
    plain, per_row = [], []
    for pattern in model_admin.get_urls():
        if not isinstance(pattern, URLPattern) or not pattern.name:
            continue
        route = str(pattern.pattern)
        if "<path:object_id>" in route:
            per_row.append(pattern.name)
        elif "<" not in route:
            plain.append(pattern.name)
    return plain, per_row


def test_the_seed_gives_every_walked_admin_a_tenant_b_row(tenants: Any, admin_client: Client) -> None:
    """An unfiltered list shows tenant-b: so the walk below would see a leak on every admin."""
    for model, _ in walked_admins():
        url = reverse(f"admin:{model._meta.app_label}_{model._meta.model_name}_changelist")
        response = admin_client.get(url)
        assert response.status_code == 200, model
        assert traces(response), f"seed a tenant-b row of {model._meta.label} in seed_tenant()"


def test_a_limited_user_sees_nothing_of_another_tenant_on_any_admin_page(tenants: Any) -> None:
    client, _ = tenants
    before = tenant_b_rows()
    pages = 0
    for model, model_admin in walked_admins():
        plain, per_row = object_urls(model_admin)
        for name in plain:
            for query in ("", "?q=b-host-1", "?q=tenant", "?o=-1"):
                response = client.get(reverse(f"admin:{name}") + query)
                assert response.status_code in (200, 302, 403), (name, query)
                assert not traces(response), (name, query, traces(response))
                pages += 1
        for pk in model._default_manager.values_list("pk", flat=True):
            for name in per_row:
                response = client.get(reverse(f"admin:{name}", args=[pk]))
                assert not traces(response), (name, pk, traces(response))
                pages += 1
    assert pages > 100
    assert tenant_b_rows() == before


def test_autocomplete_leads_to_no_row_of_another_tenant(tenants: Any) -> None:
    client, _ = tenants
    walked = {model for model, _ in walked_admins()}
    asked = 0
    for source in admin.site._registry:
        for field in source._meta.get_fields():
            if not isinstance(field, ForeignKey) or field.related_model not in walked:
                continue
            for term in ("", "tenant", "b-host"):
                response = client.get(reverse("admin:autocomplete"), {
                    "app_label": source._meta.app_label, "model_name": source._meta.model_name,
                    "field_name": field.name, "term": term,
                })
                assert response.status_code in (200, 403, 404), (source, field.name)
                assert not traces(response), (source, field.name, term)
                asked += 1
    assert asked >= 6  # grant.lock and document.fence at least


def test_no_action_reaches_a_row_of_another_tenant(tenants: Any) -> None:
    client, _ = tenants
    before = tenant_b_rows()
    ran = 0
    for model, _ in walked_admins():
        url = reverse(f"admin:{model._meta.app_label}_{model._meta.model_name}_changelist")
        page = client.get(url)
        form = page.context["action_form"] if page.context else None
        offered = [name for name, _ in form.fields["action"].choices if name] if form else []
        every_row = [str(pk) for pk in model._default_manager.values_list("pk", flat=True)]
        for action in offered:
            for confirm in ({}, {"confirm": "yes", "post": "yes"}):
                response = client.post(
                    url, {"action": action, ACTION_CHECKBOX_NAME: every_row, "index": 0, **confirm}
                )
                assert response.status_code in (200, 302, 403), (model, action)
                assert not traces(response), (model, action, traces(response))
                ran += 1
    assert ran >= 4  # revoke, raise, and the delete of rules and accounts
    assert tenant_b_rows() == before


# --- the findings, one by one ------------------------------------------------------


def changelist(client: Client, model: str, app: str = "coordination") -> str:
    response = client.get(reverse(f"admin:{app}_{model}_changelist"))
    assert response.status_code == 200, model
    return response.content.decode()


def test_roles_and_beat_slots_of_another_tenant_are_hidden(tenants: Any) -> None:
    client, _ = tenants
    roles = changelist(client, "role")
    assert "tenant-a:beat" in roles and "a-host-3" in roles
    assert "tenant-b" not in roles and HOLDER_B not in roles
    slots = changelist(client, "beatslot")
    assert "tenant-a-nightly" in slots
    assert "tenant-b" not in slots and HOLDER_B not in slots  # the role filter's choices too
    role_b = locks.Lock.objects.get(key="election:tenant-b:beat")
    for page in ("change", "history"):
        response = client.get(reverse(f"admin:coordination_role_{page}", args=[role_b.pk]))
        assert response.status_code == 302 and not traces(response)  # "does not exist"


def test_access_rules_of_others_are_hidden_from_a_limited_user(tenants: Any) -> None:
    client, _ = tenants
    rules = changelist(client, "accessrule")
    assert "tenant-a:*" in rules and "tenant-b:*" not in rules and "user bob" not in rules


def test_demo_accounts_keep_to_the_rules(tenants: Any) -> None:
    client, _ = tenants
    accounts = changelist(client, "account", app="demo")
    assert "tenant-a-owner" in accounts and "tenant-b-owner" not in accounts
    other = Account.objects.get(owner="tenant-b-owner")
    change = client.get(reverse("admin:demo_account_change", args=[other.pk]))
    assert change.status_code == 302
    delete = client.post(reverse("admin:demo_account_delete", args=[other.pk]), {"post": "yes"})
    assert delete.status_code == 302
    assert Account.objects.filter(pk=other.pk).exists()


def test_a_readable_account_is_read_only_without_the_write_rule(tenants: Any) -> None:
    client, account = tenants
    AccessRule.objects.filter(pattern=f"account:{account.pk}").update(write=False)
    change = client.get(reverse("admin:demo_account_change", args=[account.pk]))
    assert change.status_code == 200
    assert not re.search(rb'<input[^>]+name="balance"', change.content)  # shown, not editable
    client.post(reverse("admin:demo_account_change", args=[account.pk]),
                {"owner": "renamed", "balance": "99.00"})
    assert Account.objects.get(pk=account.pk).owner == "tenant-a-owner"


def test_metrics_are_refused_to_a_user_limited_by_rules(tenants: Any, admin_client: Client) -> None:
    """Counts over every key, process counters that cannot be split by key: not theirs."""
    client, _ = tenants
    refused = client.get("/metrics")
    assert refused.status_code == 403 and b"coordination_" not in refused.content
    assert not traces(refused)
    assert admin_client.get("/metrics").status_code == 200  # not limited by rules
