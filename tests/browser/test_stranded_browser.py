"""Stranded executions on the jobs page in a real headless Chromium: listed with
their worker and last renewal, cleared through the confirmation page."""

from __future__ import annotations

from typing import Any

from django.contrib.admin.models import LogEntry
from django.contrib.auth.models import User
from playwright.sync_api import Page, expect

from coordination import jobs, locks
from coordination.fencing import fence
from coordination.models import Fence
from tests.browser.test_admin_browser import (  # noqa: F401  (fixtures, used by name)
    ARTIFACTS,
    browser,
    log_in,
    operator,
    page,
)
from tests.support.waiting import wait_until_database_time_passes

TASK = "reports.build"


def test_the_operator_sees_a_stranded_execution_and_clears_it(
    page: Page, live_server: Any, operator: User  # noqa: F811
) -> None:
    grant = locks.acquire("report:eu", holder=f"{TASK}[dead]#3 on worker-9:999", ttl=0.5)
    jobs.record_execution(TASK, grant, task_id="dead", attempt=3, worker="worker-9:999")
    with fence("report:eu", grant):  # it wrote before its worker was killed
        pass
    wait_until_database_time_passes(grant.expires_at)
    log_in(page, live_server.url)

    page.click("#coordination-dashboard-link a")
    page.click("#coordination-jobs-link")
    page.goto(page.url + "?refresh=0")
    section = page.locator("#coordination-stranded")
    expect(section).to_have_attribute("data-count", "1")
    row = section.locator('tr.coordination-stranded-execution[data-key="report:eu"]')
    for shown in (TASK, "dead", "worker-9:999", str(grant.token)):
        expect(row).to_contain_text(shown)
    expect(row.locator('[data-field="last-renewal"]')).not_to_have_text("unknown")
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "stranded-executions.png"), full_page=True)

    page.click("#coordination-clear-stranded")
    expect(page.locator(".coordination-explanation")).to_contain_text("stale token")
    page.click("#coordination-confirm")

    expect(page.locator(".messagelist")).to_contain_text("Cleared 1 stranded execution")
    expect(page.locator("#coordination-stranded")).to_have_count(0)
    assert Fence.objects.get(resource="report:eu").token == grant.token + 1
    assert LogEntry.objects.filter(object_repr="report:eu", user=operator).exists()
