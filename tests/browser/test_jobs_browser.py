"""The jobs page and a job policy's page in a real headless Chromium: what runs now,
what was deferred, and the pause, resume and pause-and-revoke buttons."""

from __future__ import annotations

from typing import Any

from django.contrib.auth.models import User
from playwright.sync_api import Page, expect

from coordination import jobs, locks
from coordination.models import Grant, GrantEnd, JobPolicy
from coordination.semaphores import acquire_permit
from tests.browser.test_admin_browser import (  # noqa: F401  (fixtures, used by name)
    ARTIFACTS,
    browser,
    log_in,
    operator,
    page,
)

TASK = "reports.build"


def test_the_jobs_page_shows_executions_and_pauses_resumes_and_revokes(
    page: Page, live_server: Any, operator: User  # noqa: F811
) -> None:
    holder = f"{TASK}[c0ffee]#1 on worker-7:4242"
    grant = locks.acquire("report:eu", holder=holder, ttl=120)
    permit = acquire_permit(jobs.permit_name(TASK), limit=2, holder=holder, ttl=120)
    jobs.record_execution(  # what the task's decorator records as it starts
        TASK, grant, task_id="c0ffee", attempt=1, worker="worker-7:4242", permit=permit
    )
    jobs.tally(TASK, "deferred")
    jobs.tally(TASK, "deferred")
    log_in(page, live_server.url)

    page.click("#coordination-dashboard-link a")
    page.click("#coordination-jobs-link")
    page.goto(page.url + "?refresh=0")  # no reload in the middle of the clicks
    job = page.locator(f'section.coordination-job[data-task="{TASK}"]')
    expect(job).to_have_attribute("data-paused", "no")
    expect(job.locator('[data-metric="running"]')).to_have_text("1")
    expect(job.locator('[data-metric="deferred"]')).to_have_text("2")
    execution = job.locator('tr.coordination-execution[data-key="report:eu"]')
    expect(execution).to_contain_text(str(grant.token))
    expect(execution).to_contain_text("worker-7:4242")
    expect(job.locator('[data-metric="policy"]')).to_contain_text("none")

    job.locator('button[value="pause"]').click()
    expect(page.locator(".messagelist")).to_contain_text("Paused 1 task")
    job = page.locator(f'section.coordination-job[data-task="{TASK}"]')
    expect(job).to_have_attribute("data-paused", "yes")
    assert JobPolicy.objects.get(task=TASK).paused

    job.locator('button[value="resume"]').click()
    job = page.locator(f'section.coordination-job[data-task="{TASK}"]')
    expect(job).to_have_attribute("data-paused", "no")
    assert not JobPolicy.objects.get(task=TASK).paused

    job.locator('button[value="pause_and_revoke"]').click()
    expect(page.locator(".messagelist")).to_contain_text("Revoked 2 leases")
    job = page.locator(f'section.coordination-job[data-task="{TASK}"]')
    expect(job).to_have_attribute("data-paused", "yes")
    expect(job.locator('[data-metric="running"]')).to_have_text("0")
    ends = set(Grant.objects.filter(holder=holder).values_list("end_reason", flat=True))
    assert ends == {GrantEnd.REVOKED} and permit.key.startswith(f"task:{TASK}@")

    job.locator('[data-metric="policy"] a').click()
    changes = page.locator("#policy-changes tr.policy-change")
    expect(changes).to_have_count(3)  # created paused, resumed, paused again: newest first
    expect(changes.first).to_contain_text("paused: False -> True")
    expect(changes.first).to_contain_text("operator")
    expect(changes.last).to_contain_text("created")
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "job-policy.png"), full_page=True)
