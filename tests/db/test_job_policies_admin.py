"""Job policies in the admin, on the jobs page and over REST: who may see and steer
which task (permissions and access rules, a policy being the key ``task:<name>``),
what a change records, and what pausing with revocation ends."""

from __future__ import annotations

from typing import Any

import pytest
from django.contrib.admin.helpers import ACTION_CHECKBOX_NAME
from django.contrib.auth.models import Permission, User
from django.test import Client
from django.urls import reverse

from coordination import jobs, locks
from coordination.dashboard import build_jobs
from coordination.exceptions import LeaseLost
from coordination.models import (
    AccessRule,
    Grant,
    GrantEnd,
    JobPolicy,
    JobPolicyChange,
    JobTally,
    Rejection,
)
from coordination.semaphores import acquire_permit
from tests.support.api_support import client_for, make_user

pytestmark = pytest.mark.django_db

CHANGELIST = "admin:coordination_jobpolicy_changelist"
JOBS = "admin:coordination_jobs"
STEER = "admin:coordination_jobs_steer"
POLICY_PERMISSIONS = ("view_jobpolicy", "add_jobpolicy", "change_jobpolicy", "delete_jobpolicy")


# The tasks these tests name, as a worker reports them when it starts.
SITE_TASKS = [
    "billing.settle", "tenant-a.sync", "tenant-a.tasks.sync",
    "tenant-b.tasks.settle", "tenant-b.tasks.unused",
]


@pytest.fixture(autouse=True)
def site_tasks() -> None:
    jobs.report_tasks(SITE_TASKS)


@pytest.fixture(autouse=True)
def fast_password_hashing(settings: Any) -> None:
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


def staff(*codenames: str, rules: tuple[str, ...] = ()) -> Client:
    user = User.objects.create_user(f"staff-{len(codenames)}-{len(rules)}", is_staff=True)
    user.user_permissions.set(
        Permission.objects.filter(content_type__app_label="coordination", codename__in=codenames)
    )
    for pattern in rules:
        AccessRule.objects.create(user=user, pattern=pattern, read=True, revoke=True)
    client = Client()
    client.force_login(user)
    return client


def saved(task: str, **fields: Any) -> JobPolicy:
    policy = JobPolicy(task=task, **fields)
    policy.save(changed_by="setup")
    return policy


def running_execution(task: str, key: str, *, cap: int = 2) -> tuple[Any, Any]:
    """An execution of ``task`` as the decorator would hold it: its key and a permit."""
    holder = f"{task}[id-1]#1 on worker-host:4242"
    grant = locks.acquire(key, holder=holder, ttl=60)
    permit = acquire_permit(jobs.permit_name(task), limit=cap, holder=holder, ttl=60)
    jobs.record_execution(task, grant, task_id="id-1", attempt=1, worker="worker-host:4242", permit=permit)
    return grant, permit


# --- the admin ---------------------------------------------------------------------


def test_a_policy_added_in_the_admin_records_who_and_shows_its_changes(admin_client: Client) -> None:
    response = admin_client.post(reverse("admin:coordination_jobpolicy_add"), {
        "task": "billing.settle", "paused": "on", "when_paused": "defer", "defer_seconds": "10",
        "max_running": "2", "ttl": "", "on_busy": "", "note": "", "_save": "Save",
    })
    assert response.status_code == 302, response.content.decode()[:3000]
    policy = JobPolicy.objects.get(task="billing.settle")
    assert (policy.paused, policy.max_running) == (True, 2)

    response = admin_client.post(reverse("admin:coordination_jobpolicy_change", args=[policy.pk]), {
        "task": "billing.settle", "when_paused": "defer", "defer_seconds": "10",
        "max_running": "3", "ttl": "12", "on_busy": "skip", "note": "", "_save": "Save",
    })
    assert response.status_code == 302

    [change, created] = JobPolicyChange.objects.filter(task="billing.settle").order_by("-id")
    assert (created.changed_by, created.via, created.summary) == ("admin", "admin", "created")
    assert change.before["paused"] is True and change.after["paused"] is False
    assert "max_running: 2 -> 3" in change.summary
    page = admin_client.get(reverse("admin:coordination_jobpolicy_change", args=[policy.pk]))
    text = page.content.decode()
    assert 'id="policy-changes"' in text and "max_running: 2 -&gt; 3" in text


def test_a_ttl_outside_the_settings_bounds_is_refused_by_the_form(admin_client: Client) -> None:
    response = admin_client.post(reverse("admin:coordination_jobpolicy_add"), {
        "task": "billing.settle", "when_paused": "defer", "defer_seconds": "10",
        "max_running": "", "ttl": "0.001", "on_busy": "", "note": "", "_save": "Save",
    })
    assert response.status_code == 200 and "ttl must be from" in response.content.decode()
    assert not JobPolicy.objects.exists()


def test_pause_and_resume_actions_need_their_permission_even_on_a_forged_post() -> None:
    policy = saved("billing.settle")
    viewer = staff(*POLICY_PERMISSIONS)
    forged = viewer.post(reverse(CHANGELIST), {
        "action": "pause_selected", ACTION_CHECKBOX_NAME: [policy.pk],
    })
    assert forged.status_code == 403
    assert not JobPolicy.objects.get(pk=policy.pk).paused

    operator = staff(*POLICY_PERMISSIONS, "pause_jobpolicy")
    done = operator.post(reverse(CHANGELIST), {"action": "pause_selected", ACTION_CHECKBOX_NAME: [policy.pk]})
    assert done.status_code == 302 and JobPolicy.objects.get(pk=policy.pk).paused
    operator.post(reverse(CHANGELIST), {"action": "resume_selected", ACTION_CHECKBOX_NAME: [policy.pk]})
    assert not JobPolicy.objects.get(pk=policy.pk).paused
    assert [c.summary for c in policy.changes.order_by("id")][1:] == [
        "paused: False -> True", "paused: True -> False",
    ]


def test_pause_and_revoke_confirms_then_ends_the_running_leases(admin_client: Client) -> None:
    policy = saved("billing.settle", max_running=2)
    grant, permit = running_execution("billing.settle", "account:7")
    other = locks.acquire("account:8", holder="someone else", ttl=60)
    data = {"action": "pause_and_revoke_selected", ACTION_CHECKBOX_NAME: [policy.pk]}

    confirm = admin_client.post(reverse(CHANGELIST), data)
    assert confirm.status_code == 200 and "Pause and revoke" in confirm.content.decode()
    assert jobs.running("billing.settle")  # the confirmation page itself revokes nothing

    done = admin_client.post(reverse(CHANGELIST), {**data, "confirm": "yes"})
    assert done.status_code == 302
    assert JobPolicy.objects.get(pk=policy.pk).paused
    ended = {row.lock.key: row.end_reason for row in Grant.objects.filter(holder=grant.holder)}
    assert ended == {"account:7": GrantEnd.REVOKED, permit.key: GrantEnd.REVOKED}
    assert jobs.running("billing.settle") == []
    locks.renew(other)  # another task's lease is untouched


def test_the_jobs_page_shows_each_task_its_executions_counts_and_policy(admin_client: Client) -> None:
    saved("billing.settle", paused=True, max_running=2)
    grant, _ = running_execution("reports.build", "report:eu")
    jobs.tally("billing.settle", "deferred")
    jobs.tally("billing.settle", "deferred")
    jobs.tally("reports.build", "skipped")
    jobs.tally("reports.build", "finished")
    saved("reports.*", rate_limit=10, rate_period=60, rate_key="{region}", key_cap=2, cap_key="{region}")

    text = admin_client.get(reverse(JOBS)).content.decode()

    billing = text[text.index('data-task="billing.settle"'):]
    billing = billing[: billing.index("</section>")]
    assert 'data-paused="yes"' in billing and '<td data-metric="deferred">2</td>' in billing
    assert 'value="resume"' in billing and "at most 2 at once" in billing
    reports = text[text.index('data-task="reports.build"'):]
    reports = reports[: reports.index("</section>")]
    assert '<td data-metric="running">1</td>' in reports and '<td data-metric="skipped">1</td>' in reports
    assert "report:eu" in reports and str(grant.token) in reports and "worker-host:4242" in reports
    assert '<td data-metric="finished">1</td>' in reports
    assert "10 starts per 60 s per {region}" in reports and "at most 2 at once per {region}" in reports
    assert 'value="pause"' in reports


def test_the_jobs_page_buttons_pause_and_resume_and_a_get_changes_nothing(admin_client: Client) -> None:
    assert admin_client.get(reverse(STEER)).status_code == 302
    admin_client.post(reverse(STEER), {"task": "reports.build", "how": "pause"})
    assert JobPolicy.objects.get(task="reports.build").paused
    admin_client.post(reverse(STEER), {"task": "reports.build", "how": "resume"})
    assert not JobPolicy.objects.get(task="reports.build").paused
    assert admin_client.post(reverse(STEER), {"task": "reports.build", "how": "drop"}).status_code == 403


def test_pausing_one_task_of_a_pattern_keeps_the_patterns_cap(admin_client: Client) -> None:
    saved("billing.*", max_running=3, ttl=20)
    admin_client.post(reverse(STEER), {"task": "billing.settle", "how": "pause"})
    own = JobPolicy.objects.get(task="billing.settle")
    assert (own.paused, own.max_running, own.ttl) == (True, 3, 20)


def test_access_rules_limit_the_policies_a_user_sees_and_steers() -> None:
    mine, theirs = saved("tenant-a.sync"), saved("tenant-b.sync")
    running_execution("tenant-b.sync", "tenant-b:1")
    client = staff(*POLICY_PERMISSIONS, "pause_jobpolicy", "view_grant", rules=("task:tenant-a.*",))

    listed = client.get(reverse(CHANGELIST)).content.decode()
    assert "tenant-a.sync" in listed and "tenant-b" not in listed
    assert client.get(reverse("admin:coordination_jobpolicy_change", args=[theirs.pk])).status_code == 302
    assert "tenant-b" not in client.get(reverse(JOBS)).content.decode()
    assert client.post(reverse(STEER), {"task": "tenant-b.sync", "how": "pause"}).status_code == 403
    assert not JobPolicy.objects.get(pk=theirs.pk).paused
    client.post(reverse(STEER), {"task": "tenant-a.sync", "how": "pause"})
    assert JobPolicy.objects.get(pk=mine.pk).paused
    added = client.post(reverse("admin:coordination_jobpolicy_add"), {
        "task": "tenant-b.other", "when_paused": "defer", "defer_seconds": "10", "_save": "Save",
    })
    assert added.status_code == 403 and not JobPolicy.objects.filter(task="tenant-b.other").exists()


# --- REST ------------------------------------------------------------------------


def test_rest_puts_patches_reads_and_deletes_a_policy_and_records_the_user() -> None:
    user = make_user(*POLICY_PERMISSIONS)
    api = client_for(user)
    url = "/api/job-policies/billing.settle"

    created = api.put(url, {"paused": True, "max_running": 2}, format="json")
    assert created.status_code == 201, created.json()
    assert created.json()["paused"] is True and created.json()["max_running"] == 2
    patched = api.patch(url, {"max_running": None, "ttl": 15}, format="json")
    assert patched.status_code == 200 and patched.json()["max_running"] is None
    assert patched.json()["paused"] is True  # a PATCH leaves the rest
    replaced = api.put(url, {"note": "night only"}, format="json")
    assert replaced.json()["paused"] is False and replaced.json()["ttl"] is None  # a PUT replaces
    assert [p["task"] for p in api.get("/api/job-policies/").json()["results"]] == ["billing.settle"]
    assert api.get(url).json()["note"] == "night only"
    assert api.delete(url).status_code == 204
    assert api.get(url).status_code == 404
    vias = set(JobPolicyChange.objects.filter(task="billing.settle").values_list("changed_by", "via"))
    assert vias == {(user.username, "api")}


def test_rest_input_is_strict_and_permissions_and_rules_apply() -> None:
    api = client_for(make_user(*POLICY_PERMISSIONS))
    url = "/api/job-policies/billing.settle"
    for body in ({"paused": "true"}, {"max_running": 0}, {"ttl": "5"}, {"when_paused": "later"},
                 {"color": "red"}):
        response = api.put(url, body, format="json")
        assert response.status_code == 400, body
    assert api.put("/api/job-policies/bad name", {}, format="json").status_code in (400, 404)
    assert not JobPolicy.objects.exists()

    reader = client_for(make_user("view_jobpolicy"))
    assert reader.put(url, {"paused": True}, format="json").status_code == 403
    no_add = client_for(make_user("view_jobpolicy", "change_jobpolicy"))
    assert no_add.put(url, {"paused": True}, format="json").status_code == 403

    saved("tenant-b.sync")
    limited_user = make_user(*POLICY_PERMISSIONS)
    AccessRule.objects.create(user=limited_user, pattern="task:tenant-a.*", read=True, revoke=True)
    limited = client_for(limited_user)
    assert limited.get("/api/job-policies/").json()["results"] == []
    refused = limited.patch("/api/job-policies/tenant-b.sync", {"paused": True}, format="json")
    assert refused.status_code == 403 and refused.json()["code"] == "key_forbidden"
    assert limited.put("/api/job-policies/tenant-a.sync", {}, format="json").status_code == 201


def test_deferred_and_skipped_counts_add_up_per_task() -> None:
    for _ in range(3):
        jobs.tally("a.task", "deferred")
    jobs.tally("a.task", "skipped")
    counts = dict(JobTally.objects.filter(task="a.task").values_list("outcome", "count"))
    assert counts == {"deferred": 3, "skipped": 1}


# --- what a limited user learns of the policies they may not see -------------------------

ADD = "admin:coordination_jobpolicy_add"
FORM = {"when_paused": "defer", "defer_seconds": "10", "_save": "Save"}


def test_adding_a_policy_named_like_another_tenants_answers_as_for_a_free_name() -> None:
    saved("tenant-b.tasks.settle")
    client = staff(*POLICY_PERMISSIONS, rules=("task:tenant-a.*",))

    taken = client.post(reverse(ADD), {**FORM, "task": "tenant-b.tasks.settle"})
    free = client.post(reverse(ADD), {**FORM, "task": "tenant-b.tasks.unused"})

    assert taken.status_code == free.status_code == 403
    assert b"already exists" not in taken.content
    assert JobPolicy.objects.filter(task__startswith="tenant-b").count() == 1


def test_renaming_a_policy_to_another_tenants_name_answers_as_for_a_free_name() -> None:
    mine = saved("tenant-a.tasks.sync")
    saved("tenant-b.tasks.settle")
    client = staff(*POLICY_PERMISSIONS, rules=("task:tenant-a.*",))
    change = reverse("admin:coordination_jobpolicy_change", args=[mine.pk])

    taken = client.post(change, {**FORM, "task": "tenant-b.tasks.settle"})
    free = client.post(change, {**FORM, "task": "tenant-b.tasks.unused"})

    assert taken.status_code == free.status_code == 403
    assert b"View job policy" not in taken.content and b"already exists" not in taken.content
    assert JobPolicy.objects.get(pk=mine.pk).task == "tenant-a.tasks.sync"


def test_a_name_the_user_may_steer_still_gets_the_forms_own_errors() -> None:
    saved("tenant-a.tasks.sync")
    client = staff(*POLICY_PERMISSIONS, rules=("task:tenant-a.*",))
    answer = client.post(reverse(ADD), {**FORM, "task": "tenant-a.tasks.sync"})
    assert answer.status_code == 200 and b"already exists" in answer.content


def test_a_unique_clash_with_a_row_the_user_may_not_read_is_403_in_a_fenced_admin_form() -> None:
    # The mechanism FencedModelAdmin adds to the forms of users' models.
    from django import forms as django_forms
    from django.core.exceptions import PermissionDenied

    from coordination.admin import _UniqueWithinRules

    saved("tenant-b.tasks.settle")
    form_class = type("PolicyForm", (_UniqueWithinRules, django_forms.ModelForm), {
        "Meta": type("Meta", (), {"model": JobPolicy, "fields": ["task", "when_paused", "defer_seconds"]}),
    })
    data = {"task": "tenant-b.tasks.settle", "when_paused": "defer", "defer_seconds": "10"}

    hidden = form_class(data)
    hidden.readable = JobPolicy.objects.none()
    with pytest.raises(PermissionDenied):
        hidden.is_valid()
    shown = form_class(data)
    shown.readable = JobPolicy.objects.all()
    assert not shown.is_valid() and "already exists" in str(shown.errors)


# --- what runs now comes from what the tasks recorded ------------------------------------

SPOOF = "tenant-b.tasks.settle[fake-1]#1 on b-host-17:999"


def test_a_lock_taken_over_rest_with_a_task_like_holder_is_no_tasks_execution(
    admin_client: Client,
) -> None:
    saved("tenant-b.tasks.settle")
    api = client_for(make_user("acquire_lock"))
    taken = api.post("/api/locks/tenant-a:spoof/acquire", {"holder": SPOOF, "ttl": 60}, format="json")
    assert taken.status_code == 201
    Rejection.objects.create(
        resource="doc", lock_key="tenant-a:spoof", token=taken.json()["token"],
        reason="stale_token", holder=SPOOF,
    )

    assert jobs.running() == [] and jobs.running("tenant-b.tasks.settle") == []
    page = admin_client.get(reverse(JOBS)).content.decode()
    assert "b-host-17" not in page and "fake-1" not in page
    [row] = [row for row in build_jobs().rows if row.task == "tenant-b.tasks.settle"]
    assert row.running == [] and row.refused == 0


def test_a_recorded_execution_is_running_until_its_lease_ends(admin_client: Client) -> None:
    grant, permit = running_execution("tenant-b.tasks.settle", "tenant-b:7")
    [running] = jobs.running("tenant-b.tasks.settle")
    assert (running.key, running.token, running.worker, running.permit) == (
        "tenant-b:7", grant.token, "worker-host:4242", permit.key
    )
    assert "worker-host:4242" in admin_client.get(reverse(JOBS)).content.decode()
    locks.release(grant)
    assert jobs.running("tenant-b.tasks.settle") == []


# --- a policy names a task the site knows ---------------------------------------------


def test_the_admin_refuses_a_task_name_no_known_task_has_and_suggests_the_nearest(
    admin_client: Client,
) -> None:
    form = {**FORM, "task": "billing.setle"}
    answer = admin_client.post(reverse(ADD), form)
    assert answer.status_code == 200 and not JobPolicy.objects.filter(task="billing.setle").exists()
    text = answer.content.decode()
    assert "no fenced task named" in text and "billing.settle" in text and "Ahead of a deploy" in text

    assert admin_client.post(reverse(ADD), {**FORM, "task": "nothing.*"}).status_code == 200
    assert not JobPolicy.objects.filter(task="nothing.*").exists()
    assert admin_client.post(reverse(ADD), {**FORM, "task": "billing.*"}).status_code == 302


def test_a_policy_ahead_of_a_deploy_is_saved_when_asked_for(admin_client: Client) -> None:
    form = {**FORM, "task": "reports.tasks.nightly", "ahead_of_deploy": "on"}
    answer = admin_client.post(reverse(ADD), form)
    assert answer.status_code == 302
    assert JobPolicy.objects.filter(task="reports.tasks.nightly").exists()


def test_rest_refuses_an_unknown_task_unless_ahead_of_a_deploy() -> None:
    api = client_for(make_user(*POLICY_PERMISSIONS))
    refused = api.put("/api/job-policies/orders.tasks.typo_taks", {"paused": True}, format="json")
    assert refused.status_code == 400, refused.content
    assert refused.json()["code"] == "invalid" and "ahead_of_deploy" in str(refused.json()["errors"])
    created = api.put(
        "/api/job-policies/orders.tasks.typo_taks", {"paused": True, "ahead_of_deploy": True}, format="json"
    )
    assert created.status_code == 201 and "ahead_of_deploy" not in created.json()


def test_rest_says_how_to_go_on_when_the_known_names_are_long_or_there_is_no_policy() -> None:
    # Long task names close to the typo fill the bounded message: what to do
    # comes before them, so the cut takes names, not the remedy.
    jobs.report_tasks([f"mycompany.billing.tasks.send_monthly_invoice_{n}" for n in range(3)])
    api = client_for(make_user(*POLICY_PERMISSIONS))
    refused = api.put(
        "/api/job-policies/mycompany.billing.tasks.send_monthly_invoice", {"paused": True}, format="json"
    )
    assert refused.status_code == 400, refused.content
    message = refused.json()["errors"]["task"][0]
    assert 'send "ahead_of_deploy": true to create it before the task is deployed; did you mean' in message

    changed = api.patch("/api/job-policies/mycompany.billing.tasks.send_monthly_invoice_1",
                        {"paused": True}, format="json")
    assert changed.status_code == 404 and changed.json()["code"] == "not_found"
    assert "has no policy to change: create one with PUT" in changed.json()["detail"]
    assert not JobPolicy.objects.exists()


def test_a_task_a_worker_reported_or_that_ran_is_known_and_on_the_jobs_page(admin_client: Client) -> None:
    assert jobs.unknown_task("shop.tasks.ship", jobs.known_tasks()) is not None
    jobs.report_tasks(["shop.tasks.ship"])
    assert jobs.unknown_task("shop.tasks.ship", jobs.known_tasks()) is None
    assert "shop.tasks.ship" in admin_client.get(reverse("admin:coordination_jobs")).content.decode()


def test_rest_pauses_and_revokes_the_running_executions_it_may_and_resumes() -> None:
    saved("tenant-a.sync", max_running=2)
    mine, mine_permit = running_execution("tenant-a.sync", "tenant-a:1")
    theirs = locks.acquire("tenant-b:1", holder="tenant-a.sync[id-2]#1 on worker-host:4242", ttl=60)
    jobs.record_execution("tenant-a.sync", theirs, task_id="id-2", attempt=1, worker="worker-host:4242")
    user = make_user("view_jobpolicy", "pause_jobpolicy")
    AccessRule.objects.create(user=user, pattern="task:tenant-a.*", read=True, revoke=True)
    AccessRule.objects.create(user=user, pattern="tenant-a:*", read=True, revoke=True)
    api = client_for(user)

    paused = api.post("/api/job-policies/tenant-a.sync/pause", {"revoke_running": True}, format="json")

    assert paused.status_code == 200, paused.json()
    assert paused.json()["policy"]["paused"] is True
    revoked = {(row["key"], row["token"], row["end_reason"]) for row in paused.json()["revoked"]}
    assert revoked == {
        ("tenant-a:1", mine.token, GrantEnd.REVOKED), (mine_permit.key, mine_permit.token, GrantEnd.REVOKED),
    }
    locks.renew(theirs)  # a key the user may not revoke stays held
    with pytest.raises(LeaseLost):
        locks.renew(mine)
    resumed = api.post("/api/job-policies/tenant-a.sync/resume", format="json")
    assert resumed.status_code == 200 and resumed.json()["paused"] is False
    assert [c.via for c in JobPolicyChange.objects.filter(task="tenant-a.sync").order_by("id")][1:] == [
        "api", "api",
    ]


def test_rest_pause_without_revoking_leaves_running_leases_and_needs_its_permission() -> None:
    grant, _ = running_execution("billing.settle", "account:7")
    editor = client_for(make_user(*POLICY_PERMISSIONS))
    assert editor.post("/api/job-policies/billing.settle/pause", {}, format="json").status_code == 403
    api = client_for(make_user("pause_jobpolicy"))

    paused = api.post("/api/job-policies/billing.settle/pause", {}, format="json")

    assert paused.status_code == 200 and paused.json()["revoked"] == []
    assert JobPolicy.objects.get(task="billing.settle").paused
    locks.renew(grant)
    assert api.post("/api/job-policies/billing.settle/pause", {"revoke_running": "yes"},
                    format="json").status_code == 400
    assert api.post("/api/job-policies/reports.build/resume", format="json").status_code == 404


def test_rest_pause_refuses_an_unknown_task_unless_ahead_of_a_deploy_and_other_tenants() -> None:
    user = make_user("pause_jobpolicy")
    AccessRule.objects.create(user=user, pattern="task:tenant-a.*", read=True, revoke=True)
    api = client_for(user)
    typo = api.post("/api/job-policies/tenant-a.tasks.snyc/pause", {}, format="json")
    assert typo.status_code == 400 and "tenant-a.tasks.sync" in str(typo.json())
    ahead = api.post("/api/job-policies/tenant-a.tasks.later/pause", {"ahead_of_deploy": True}, format="json")
    assert ahead.status_code == 200
    refused = api.post("/api/job-policies/tenant-b.tasks.settle/pause", {}, format="json")
    assert refused.status_code == 403 and refused.json()["code"] == "key_forbidden"
    assert not JobPolicy.objects.filter(task="tenant-b.tasks.settle").exists()
