"""Stranded executions: a fenced task's lease that expired without a release is listed
on the jobs page once it has expired by the database clock (not before), and the
clear action ends it and fences its token out, as an audited operator action under
the permissions and access rules of a revoke."""

from __future__ import annotations

import datetime as dt
from dataclasses import replace
from decimal import Decimal
from typing import Any

import pytest
from django.contrib.admin.models import LogEntry
from django.contrib.auth.models import Permission, User
from django.test import Client, override_settings
from django.urls import reverse
from prometheus_client.parser import text_string_to_metric_families

from coordination import jobs, locks, stranded
from coordination.dashboard import build_jobs
from coordination.exceptions import LeaseLost, StaleToken
from coordination.fencing import fence
from coordination.leases import Lease
from coordination.models import AccessRule, Fence, Grant, GrantEnd, Lock
from coordination.semaphores import acquire_permit
from project.demo.models import Account
from tests.support.api_support import client_for, make_user
from tests.support.factories import AccountFactory
from tests.support.waiting import wait_until_database_time_passes

pytestmark = pytest.mark.django_db

JOBS = "admin:coordination_jobs"
CLEAR = "admin:coordination_jobs_clear_stranded"
TASK = "billing.settle"
TTL = 0.5


@pytest.fixture(autouse=True)
def fast_password_hashing(settings: Any) -> None:
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


def staff(name: str, *codenames: str, rules: tuple[str, ...] = ()) -> Client:
    user = User.objects.create_user(name, is_staff=True)
    user.user_permissions.set(
        Permission.objects.filter(content_type__app_label="coordination", codename__in=codenames)
    )
    for pattern in rules:
        AccessRule.objects.create(user=user, pattern=pattern, read=True, revoke=True)
    client = Client()
    client.force_login(user)
    return client


def operator() -> Client:
    return staff("operator", "view_jobpolicy", "view_grant", "revoke_lock")


def lost_execution(
    key: str, *, task: str = TASK, ttl: float = TTL, permit: bool = False, cap: str = ""
) -> Lease:
    """An execution as the decorator records it, whose worker then dies: its lease
    is never renewed nor released. Returns the dead lease, expired by the database
    clock (and its permits': ``max_running``'s, and with ``cap`` one of that cap's)."""
    holder = f"{task}[id-7]#2 on worker-host:4242"
    grant = locks.acquire(key, holder=holder, ttl=ttl)
    slot = acquire_permit(jobs.permit_name(task), limit=2, holder=holder, ttl=ttl) if permit else None
    capped = acquire_permit(cap, limit=2, holder=holder, ttl=ttl) if cap else None
    jobs.record_execution(task, grant, task_id="id-7", attempt=2, worker="worker-host:4242", permit=slot,
                          cap_permit=capped)
    wait_until_database_time_passes(max(lease.expires_at for lease in (grant, slot, capped) if lease))
    return grant


def test_an_execution_is_stranded_once_its_lease_expired_by_the_database_clock_not_before() -> None:
    grant = locks.acquire("account:1", holder="billing.settle[id-1]#1 on w:1", ttl=3600)
    jobs.record_execution(TASK, grant, task_id="id-1", attempt=1, worker="w:1")
    assert stranded.stranded_executions() == []  # an hour left: running, not stranded
    assert [run.key for run in jobs.running(TASK)] == ["account:1"]

    dead = lost_execution("account:2")

    (found,) = stranded.stranded_executions()
    assert (found.task, found.task_id, found.attempt, found.worker) == (TASK, "id-7", 2, "worker-host:4242")
    assert (found.key, found.token, found.expired_at) == ("account:2", dead.token, dead.expires_at)
    assert found.ttl == pytest.approx(TTL)
    assert found.last_renewal == dead.expires_at - dt.timedelta(seconds=TTL) == dead.acquired_at
    assert stranded.count() == 1


def test_a_renewal_moves_the_last_renewal_shown() -> None:
    grant = locks.acquire("account:3", holder="w", ttl=2.0)
    jobs.record_execution(TASK, grant, task_id="id-3", attempt=1, worker="w:3")
    locks.renew(grant, ttl=2.0)
    wait_until_database_time_passes(grant.expires_at)

    (found,) = stranded.stranded_executions()
    assert found.last_renewal == grant.expires_at - dt.timedelta(seconds=2.0)
    assert found.last_renewal > grant.acquired_at


def test_a_released_or_taken_over_execution_is_not_stranded() -> None:
    released = locks.acquire("account:4", holder="w", ttl=TTL)
    jobs.record_execution(TASK, released, task_id="a", attempt=1, worker="w")
    locks.release(released)
    lost_execution("account:5")
    locks.acquire("account:5", holder="the next worker", ttl=60)  # takes the expired lease over

    assert stranded.stranded_executions() == []


def test_clearing_fences_the_dead_token_out_of_every_watermark_of_its_key() -> None:
    account = AccountFactory(balance=Decimal("10.00"))
    key = f"account:{account.pk}"
    dead = lost_execution(key)
    # It wrote once before it was lost; a Fence row of its key too.
    assert Account.objects.filter(pk=account.pk).fenced_update(dead, balance=Decimal("11.00")) == 1
    with fence("ledger:billing", dead):
        pass
    Fence.objects.filter(resource="ledger:billing").update(lock_key=key)
    (found,) = stranded.stranded_executions()

    cleared = stranded.clear(found, by="alice")

    assert cleared is not None and cleared.token == dead.token + 1 and cleared.raised == 2
    assert stranded.stranded_executions() == []
    # The paused copy wakes up and writes under its token: refused as stale everywhere.
    with pytest.raises(StaleToken):
        Account.objects.filter(pk=account.pk).fenced_update(dead, balance=Decimal("99.00"))
    with pytest.raises(StaleToken), fence("ledger:billing", dead):
        pass
    with pytest.raises(LeaseLost):
        locks.renew(dead)
    account.refresh_from_db()
    assert account.balance == Decimal("11.00")
    # The next worker writes as usual.
    nxt = locks.acquire(key, holder="next", ttl=30)
    assert Account.objects.filter(pk=account.pk).fenced_update(nxt, balance=Decimal("12.00")) == 1
    # Audited in the grant history: the dead lease ended, the operator's grant released.
    ended = Grant.objects.get(lock__key=key, token=dead.token)
    taken = Grant.objects.get(lock__key=key, token=cleared.token)
    assert ended.end_reason == GrantEnd.EXPIRED
    assert taken.holder.startswith("operator alice") and taken.end_reason == GrantEnd.RELEASED


def test_clearing_also_fences_the_permit_out() -> None:
    lost_execution("account:6", permit=True)
    (found,) = stranded.stranded_executions()
    assert found.permit.startswith("task:billing.settle@")

    cleared = stranded.clear(found, by="alice")

    assert cleared is not None and cleared.permit_token == found.permit_token + 1  # type: ignore[operator]
    assert not Lock.objects.get(key=found.permit).holder


def test_clearing_also_fences_the_cap_per_key_permit_out() -> None:
    """The permit of a cap per key is a lease the execution holds too: a resource its
    slot guards refuses the dead copy's token once cleared."""
    dead = lost_execution("account:13", permit=True, cap="cap:billing.settle:7")
    (found,) = stranded.stranded_executions()
    assert found.cap_permit.startswith("cap:billing.settle:7@") and found.cap_permit_token is not None
    assert found.keys == ["account:13", found.permit, found.cap_permit]
    slot = replace(dead, key=found.cap_permit, token=found.cap_permit_token)  # the copy's cap permit
    with fence("exports:7", slot):  # it wrote under its slot before it was lost
        pass

    cleared = stranded.clear(found, by="alice")

    assert cleared is not None and cleared.cap_permit_token == found.cap_permit_token + 1
    assert cleared.permit_token == found.permit_token + 1  # type: ignore[operator]
    assert f"its permit {found.cap_permit} fenced at token {cleared.cap_permit_token}" in cleared.summary
    with pytest.raises(StaleToken), fence("exports:7", slot):
        pass
    assert not Lock.objects.get(key=found.cap_permit).holder


def test_clearing_leaves_a_key_a_worker_took_again_meanwhile() -> None:
    lost_execution("account:7")
    (found,) = stranded.stranded_executions()
    new = locks.acquire("account:7", holder="the next worker", ttl=60)

    assert stranded.clear(found, by="alice") is None
    assert Lock.objects.get(key="account:7").holder == "the next worker"
    locks.renew(new)  # still its lease


def test_the_jobs_page_lists_them_and_the_operator_clears_them_with_a_confirmation() -> None:
    dead = lost_execution("account:8")
    with fence("account:8", dead):  # it wrote once before it was lost
        pass
    client = operator()

    page = client.get(reverse(JOBS))
    assert page.status_code == 200
    html = page.content.decode()
    assert 'id="coordination-stranded"' in html and 'data-count="1"' in html
    for shown in (TASK, "id-7", "worker-host:4242", "account:8", f'data-token="{dead.token}"'):
        assert shown in html
    assert 'id="coordination-clear-stranded"' in html
    (found,) = build_jobs().stranded
    assert found.key == "account:8"

    asked = client.post(reverse(CLEAR), {"stranded": [found.pk]})
    assert asked.status_code == 200 and b"Yes, clear" in asked.content
    assert stranded.count() == 1  # nothing done before the confirmation

    done = client.post(reverse(CLEAR), {"stranded": [found.pk], "confirm": "yes"}, follow=True)

    assert done.status_code == 200
    assert b"Cleared 1 stranded execution" in done.content
    assert stranded.count() == 0
    entry = LogEntry.objects.get()
    assert entry.user.username == "operator" and entry.object_repr == "account:8"
    assert f"token {dead.token} can no longer write" in entry.get_change_message()
    with pytest.raises(StaleToken), fence("account:8", dead):
        pass


def test_without_the_revoke_permission_nothing_is_cleared_and_no_button_shows() -> None:
    lost_execution("account:9")
    (found,) = stranded.stranded_executions()
    viewer = staff("viewer", "view_jobpolicy", "view_grant")

    html = viewer.get(reverse(JOBS)).content.decode()
    assert "account:9" in html and 'id="coordination-clear-stranded"' not in html
    for body in ({"stranded": [found.pk]}, {"stranded": [found.pk], "confirm": "yes"}):
        assert viewer.post(reverse(CLEAR), body).status_code == 403
    assert stranded.count() == 1
    assert not LogEntry.objects.exists()


def test_access_rules_limit_what_is_listed_and_cleared() -> None:
    lost_execution("tenant-a:1", task="tenant-a.sync")
    lost_execution("tenant-b:1", task="tenant-b.sync")
    other = next(e for e in stranded.stranded_executions() if e.key == "tenant-b:1")
    limited = staff(
        "limited", "view_jobpolicy", "view_grant", "revoke_lock",
        rules=("task:tenant-a.*", "tenant-a:*"),
    )

    html = limited.get(reverse(JOBS)).content.decode()
    assert "tenant-a:1" in html and "tenant-b:1" not in html
    refused = limited.post(reverse(CLEAR), {"stranded": [other.pk], "confirm": "yes"})

    assert refused.status_code == 403
    assert stranded.count() == 2


def test_without_view_grant_the_page_shows_no_stranded_execution() -> None:
    lost_execution("account:10")
    html = staff("no-grants", "view_jobpolicy").get(reverse(JOBS)).content.decode()
    assert 'id="coordination-stranded"' not in html


@override_settings(COORDINATION={"METRICS_PUBLIC": True})
def test_the_gauge_counts_stranded_executions(client: Client) -> None:
    def gauge() -> float:
        text = client.get("/metrics").content.decode()
        (value,) = [
            sample.value for family in text_string_to_metric_families(text)
            for sample in family.samples if sample.name == "coordination_jobs_stranded"
        ]
        return value

    assert gauge() == 0
    lost_execution("account:11")
    lost_execution("account:12")
    assert gauge() == 2
    stranded.clear(stranded.stranded_executions()[0], by="alice")
    assert gauge() == 1
    text = client.get("/metrics").content.decode()
    assert "coordination_jobs_rate_limited_total" in text
    assert "coordination_jobs_deduplicated_total" in text


# --- REST ----------------------------------------------------------------------------


def test_rest_lists_and_clears_with_the_permissions_and_rules_of_a_revoke() -> None:
    dead = lost_execution("tenant-a:2", task="tenant-a.sync")
    lost_execution("tenant-b:2", task="tenant-b.sync")
    listing_user = make_user("view_grant")
    AccessRule.objects.create(user=listing_user, pattern="*", read=True)
    listing = client_for(listing_user)
    clearing_user = make_user("view_grant", "revoke_lock")
    for pattern in ("task:tenant-a.*", "tenant-a:*"):
        AccessRule.objects.create(user=clearing_user, pattern=pattern, read=True, revoke=True)
    clearing = client_for(clearing_user)

    everything = listing.get("/api/executions/stranded/")
    assert everything.status_code == 200
    assert [row["key"] for row in everything.json()["results"]] == ["tenant-a:2", "tenant-b:2"]
    (mine,) = clearing.get("/api/executions/stranded/").json()["results"]
    assert (mine["task"], mine["token"], mine["worker"]) == ("tenant-a.sync", dead.token, "worker-host:4242")
    assert mine["last_renewal"] is not None and (mine["permit"], mine["cap_permit"]) == ("", "")
    other = next(row["id"] for row in everything.json()["results"] if row["key"] == "tenant-b:2")

    assert client_for(make_user()).get("/api/executions/stranded/").status_code == 403
    refused = listing.post(f"/api/executions/stranded/{mine['id']}/clear")
    assert (refused.status_code, refused.json()["code"]) == (403, "permission_denied")
    hidden = clearing.post(f"/api/executions/stranded/{other}/clear")
    assert (hidden.status_code, hidden.json()["code"]) == (404, "not_found")

    done = clearing.post(f"/api/executions/stranded/{mine['id']}/clear")

    assert done.status_code == 200, done.content
    assert done.json()["token"] == dead.token + 1
    assert (done.json()["permit_token"], done.json()["cap_permit_token"]) == (None, None)
    again = clearing.post(f"/api/executions/stranded/{mine['id']}/clear")
    assert (again.status_code, again.json()["code"]) == (404, "not_found")
    entry = LogEntry.objects.get()
    assert entry.user == clearing_user and "(REST)" in entry.get_change_message()
    assert stranded.count() == 1


def test_rest_says_409_lock_held_while_a_lock_delay_keeps_the_key_ungrantable() -> None:
    grant = locks.acquire("account:20", holder="w", ttl=TTL, lock_delay=60)
    jobs.record_execution(TASK, grant, task_id="d", attempt=1, worker="w:1")
    wait_until_database_time_passes(grant.expires_at)
    (found,) = stranded.stranded_executions()

    refused = client_for(make_user("revoke_lock")).post(f"/api/executions/stranded/{found.pk}/clear")

    assert (refused.status_code, refused.json()["code"]) == (409, "lock_held")
    assert stranded.count() == 1
