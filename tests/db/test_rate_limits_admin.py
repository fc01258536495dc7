"""A job policy's rate limit and cap per key, edited in the admin and over REST:
recorded as changes, templates checked against the tasks' parameters, bad
input refused with a 4xx naming the field."""

from __future__ import annotations

from typing import Any

import pytest
from django.test import Client
from django.urls import reverse

from coordination import jobs
from coordination.models import JobPolicy, JobPolicyChange, ReportedTask
from tests.support.api_support import client_for, make_user

pytestmark = pytest.mark.django_db

POLICY_PERMISSIONS = ("view_jobpolicy", "add_jobpolicy", "change_jobpolicy", "delete_jobpolicy")
FORM = {"when_paused": "defer", "defer_seconds": "10", "max_running": "", "ttl": "", "on_busy": "",
        "note": "", "_save": "Save"}


@pytest.fixture(autouse=True)
def site_tasks() -> None:
    """What workers report when they start: the names and each task's parameters."""
    jobs.report_tasks(["billing.settle", "billing.refund"])
    ReportedTask.objects.filter(task="billing.settle").update(parameters=["customer_id", "invoice_id"])
    ReportedTask.objects.filter(task="billing.refund").update(parameters=["customer_id"])


def test_a_rate_and_a_cap_per_key_set_in_the_admin_are_recorded(admin_client: Client) -> None:
    response = admin_client.post(reverse("admin:coordination_jobpolicy_add"), {
        **FORM, "task": "billing.*", "rate_limit": "10", "rate_period": "60",
        "rate_key": "{customer_id}", "key_cap": "2", "cap_key": "{customer_id}",
    })
    assert response.status_code == 302, response.content.decode()[:3000]
    policy = JobPolicy.objects.get(task="billing.*")
    assert (policy.rate_limit, policy.rate_period, policy.rate_key) == (10, 60.0, "{customer_id}")
    assert (policy.key_cap, policy.cap_key) == (2, "{customer_id}")

    response = admin_client.post(reverse("admin:coordination_jobpolicy_change", args=[policy.pk]), {
        **FORM, "task": "billing.*", "rate_limit": "20", "rate_period": "60",
        "rate_key": "{customer_id}", "key_cap": "", "cap_key": "",
    })
    assert response.status_code == 302, response.content.decode()[:3000]
    change = JobPolicyChange.objects.filter(task="billing.*").order_by("-id").first()
    assert change is not None and change.via == "admin"
    assert "rate_limit: 10 -> 20" in change.summary and "key_cap: 2 -> None" in change.summary
    assert jobs.policy_for("billing.settle") is not None


@pytest.mark.parametrize(("fields", "field", "message"), [
    ({"rate_limit": "10", "rate_period": "60", "rate_key": "{invoice_id}"}, "rate_key",
     "not an argument of task billing.refund"),
    ({"key_cap": "2", "cap_key": "{customer}"}, "cap_key", "not an argument of task billing."),
    ({"key_cap": "2", "cap_key": "{0}"}, "cap_key", "name an argument"),
    ({"key_cap": "2", "cap_key": "{customer_id"}, "cap_key", "not a valid template"),
    ({"rate_limit": "10"}, None, "rate limit is from 1"),
    ({"key_cap": "2"}, None, "needs a cap key"),
    ({"rate_limit": "0", "rate_period": "60"}, None, ""),
])
def test_the_admin_refuses_templates_the_tasks_cannot_render_and_half_set_limits(
    admin_client: Client, fields: dict[str, str], field: str | None, message: str
) -> None:
    response = admin_client.post(
        reverse("admin:coordination_jobpolicy_add"), {**FORM, "task": "billing.*", **fields}
    )
    assert response.status_code == 200  # the form again, with its errors
    errors = response.context["adminform"].form.errors
    assert errors, "the form saved"
    if field is not None:
        assert field in errors and message in " ".join(errors[field])
    else:
        assert message in " ".join(" ".join(messages) for messages in errors.values())
    assert not JobPolicy.objects.exists()


def test_rest_sets_a_rate_and_a_cap_per_key_and_records_the_user() -> None:
    user = make_user(*POLICY_PERMISSIONS)
    api = client_for(user)
    url = "/api/job-policies/billing.settle"
    body = {"rate_limit": 10, "rate_period": 60, "rate_key": "{customer_id}",
            "key_cap": 2, "cap_key": "{customer_id}"}
    created = api.put(url, body, format="json")
    assert created.status_code == 201, created.json()
    assert {name: created.json()[name] for name in body} == {**body, "rate_period": 60.0}
    patched = api.patch(url, {"rate_limit": None, "rate_period": None, "rate_key": ""}, format="json")
    assert patched.status_code == 200, patched.json()
    assert patched.json()["rate_limit"] is None and patched.json()["key_cap"] == 2
    [change, _created] = JobPolicyChange.objects.filter(task="billing.settle").order_by("-id")
    assert (change.changed_by, change.via) == (user.username, "api")
    assert change.before["rate_limit"] == 10 and change.after["rate_limit"] is None


@pytest.mark.parametrize(("body", "field"), [
    ({"rate_limit": 10}, "rate_period"),
    ({"rate_period": 60}, "rate_limit"),
    ({"rate_limit": 0, "rate_period": 60}, "rate_limit"),
    ({"rate_limit": "10", "rate_period": 60}, "rate_limit"),
    ({"rate_limit": 10, "rate_period": 0.01}, "rate_period"),
    ({"rate_limit": 10, "rate_period": 60, "rate_key": "{customer}"}, "rate_key"),
    ({"rate_key": "{customer_id}"}, "rate_key"),
    ({"key_cap": 2}, "cap_key"),
    ({"cap_key": "{customer_id}"}, "key_cap"),
    ({"key_cap": 1001, "cap_key": "{customer_id}"}, "key_cap"),
    ({"key_cap": 2, "cap_key": "{invoice_id"}, "cap_key"),
])
def test_rest_refuses_bad_limits_with_400_invalid_naming_the_field(body: dict[str, Any], field: str) -> None:
    api = client_for(make_user(*POLICY_PERMISSIONS))
    response = api.put("/api/job-policies/billing.settle", body, format="json")
    assert response.status_code == 400, (body, response.json())
    assert response.json()["code"] == "invalid"
    assert field in response.json()["errors"], response.json()
    assert not JobPolicy.objects.exists()
