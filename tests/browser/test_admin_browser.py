"""The admin in a real headless Chromium: log in, read the dashboard, revoke a lock,
and see what ``manage.py coordination_demo`` (real Celery workers) left behind.

Driven by Playwright's Python client against the system's Chromium
(``CHROMIUM_PATH``, default /usr/bin/chromium); no browser is downloaded. The
dashboard screenshot is kept as a test artifact in ``var/artifacts/``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings
from django.contrib.auth.models import User
from playwright.sync_api import Browser, Page, expect, sync_playwright

from coordination import locks
from coordination.exceptions import StaleToken
from coordination.fencing import fence
from coordination.models import Grant, Lock, Rejection
from coordination.semaphores import acquire_permit, permit_slot
from coordination.shared import acquire_shared
from tests.support.admin_story import tell_the_seed_story
from tests.support.demo import run_demo
from tests.support.legs import missing_service
from tests.support.waiting import wait_until_database_time_passes

CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]
ARTIFACTS = Path(os.environ.get("COORDINATION_ARTIFACTS_DIR", settings.BASE_DIR / "var" / "artifacts"))
PASSWORD = "correct-horse-battery"


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    executable = os.environ.get("CHROMIUM_PATH", "/usr/bin/chromium")
    if not Path(executable).exists():
        missing_service(f"Chromium at {executable} (bin/test installs it when it can; or set CHROMIUM_PATH)")
    # Playwright's sync client keeps an event loop in this thread while the
    # browser is open; the tests' own ORM calls (and the database teardown) run
    # between browser steps, never concurrently with them.
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
        with sync_playwright() as playwright:
            chromium = playwright.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS)
            yield chromium
            chromium.close()


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    context.set_default_timeout(15_000)
    yield context.new_page()
    context.close()


@pytest.fixture
def operator(django_user_model: type[User], settings: Any) -> User:
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    return django_user_model.objects.create_superuser("operator", "op@example.com", PASSWORD)


def log_in(page: Page, base_url: str) -> None:
    page.goto(f"{base_url}/admin/login/?next=/admin/")
    page.fill("#id_username", "operator")
    page.fill("#id_password", PASSWORD)
    page.click("input[type=submit]")
    expect(page.locator("#site-name")).to_contain_text("Coordination")


def test_dashboard_marks_the_late_writers_refused_write_on_the_timeline(
    page: Page, live_server: Any, operator: User
) -> None:
    story = tell_the_seed_story()
    log_in(page, live_server.url)

    page.click("#coordination-dashboard-link a")
    timeline = page.locator(f'svg.coordination-timeline[data-key="{story.key}"]')
    expect(timeline).to_be_visible()

    a_bar = timeline.locator(f'rect[data-kind="grant"][data-token="{story.a.token}"]')
    b_bar = timeline.locator(f'rect[data-kind="grant"][data-token="{story.b.token}"]')
    refused = timeline.locator(f'[data-kind="refused-write"][data-token="{story.a.token}"]')
    accepted = timeline.locator(f'[data-kind="accepted-write"][data-token="{story.b.token}"]')
    expect(a_bar).to_have_attribute("data-end", "expired")
    expect(a_bar).to_have_attribute("data-holder", "worker-A")
    expect(b_bar).to_have_attribute("data-end", "live")
    expect(refused).to_have_count(1)
    expect(refused).to_have_attribute("data-reason", "stale_token")
    expect(accepted).to_have_count(1)

    # As drawn: A's bar ends before B's starts, and A's write lands after its bar.
    a_box, b_box, refused_box = a_bar.bounding_box(), b_bar.bounding_box(), refused.bounding_box()
    assert a_box and b_box and refused_box
    assert a_box["x"] + a_box["width"] <= b_box["x"] + 1
    assert refused_box["x"] + refused_box["width"] / 2 > a_box["x"] + a_box["width"]

    cards = page.locator(".coordination-cards")
    expect(cards.locator('[data-metric="refused"] [data-window="hour"]')).to_have_text("1")
    expect(page.locator("meta[http-equiv=refresh]")).to_have_attribute("content", "10")

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "dashboard.png"), full_page=True)


def test_dashboard_draws_a_semaphores_slots_as_rows_of_one_timeline_and_readers_apart(
    page: Page, live_server: Any, operator: User
) -> None:
    # Semaphore "exports" of limit 2: A's permit runs out (A paused), C takes
    # its slot and writes, A's late write is refused; B holds the other slot,
    # taken first so that it can never be A's slot once A's short permit ran out.
    b = acquire_permit("exports", limit=2, holder="exporter-B", ttl=60)
    a = acquire_permit("exports", limit=2, holder="exporter-A", ttl=0.5)
    assert a.key != b.key
    wait_until_database_time_passes(a.expires_at)
    c = acquire_permit("exports", limit=2, holder="exporter-C", ttl=60)
    assert c.key == a.key and c.token == a.token + 1
    target = f"export-target:{a.key}"
    with fence(target, c):
        pass
    with pytest.raises(StaleToken), fence(target, a):
        pass
    # And a key with readers and then a writer: the modes are drawn apart.
    reader = acquire_shared("report:7", holder="reader-1", ttl=30)
    locks.release(reader)
    writer = locks.acquire("report:7", holder="writer", ttl=30)
    log_in(page, live_server.url)

    page.click("#coordination-dashboard-link a")
    figure = page.locator('figure[data-semaphore="exports"]')
    expect(figure).to_be_visible()
    expect(figure.locator(".coordination-badge")).to_have_attribute("data-held", "2")
    # One timeline for the semaphore, none for its slots' keys on their own.
    expect(page.locator('svg.coordination-timeline[data-key^="exports@"]')).to_have_count(1)
    slots = figure.locator("svg.coordination-semaphore-timeline g.slot")
    expect(slots).to_have_count(2)
    a_row = figure.locator(f'g.slot[data-slot="{permit_slot(a)}"]')
    expect(a_row).to_have_attribute("data-key", a.key)
    expect(a_row.locator("rect[data-kind=grant]")).to_have_count(2)
    a_bar = a_row.locator(f'rect[data-token="{a.token}"]')
    c_bar = a_row.locator(f'rect[data-token="{c.token}"]')
    b_bar = figure.locator(f'g.slot[data-slot="{permit_slot(b)}"] rect[data-token="{b.token}"]')
    expect(a_bar).to_have_attribute("data-end", "expired")
    expect(c_bar).to_have_attribute("data-holder", "exporter-C")
    refused = figure.locator(f'[data-kind="refused-write"][data-token="{a.token}"]')
    expect(refused).to_have_attribute("data-reason", "stale_token")

    a_box, b_box, c_box = a_bar.bounding_box(), b_bar.bounding_box(), c_bar.bounding_box()
    refused_box = refused.bounding_box()
    assert a_box and b_box and c_box and refused_box
    # A slot's permits follow one another on its row; the other slot's run beside them.
    assert a_box["y"] == c_box["y"] != b_box["y"]
    assert a_box["x"] + a_box["width"] <= c_box["x"] + 1
    assert b_box["x"] < c_box["x"] + c_box["width"] and c_box["x"] < b_box["x"] + b_box["width"]
    # A's refused write is on A's row, after A's bar.
    assert a_box["y"] <= refused_box["y"] + refused_box["height"] / 2 <= a_box["y"] + a_box["height"]
    assert refused_box["x"] + refused_box["width"] / 2 > a_box["x"] + a_box["width"]

    report = page.locator('svg.coordination-timeline[data-key="report:7"]')
    reader_bar = report.locator(f'rect[data-token="{reader.token}"]')
    writer_bar = report.locator(f'rect[data-token="{writer.token}"]')
    expect(reader_bar).to_have_attribute("data-mode", "shared")
    expect(writer_bar).to_have_attribute("data-mode", "exclusive")
    # Drawn apart: a reader's bar is lighter than a writer's, and outlined.
    opacity = "e => parseFloat(getComputedStyle(e).fillOpacity)"
    assert reader_bar.evaluate(opacity) < writer_bar.evaluate(opacity)
    assert reader_bar.evaluate("e => getComputedStyle(e).strokeWidth") == "1.5px"
    expect(report.locator("text.lane-label", has_text=f"#{reader.token} R")).to_have_count(1)

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "dashboard-primitives.png"), full_page=True)
    locks.release(writer)


def test_revoke_runs_through_its_confirmation_page(
    page: Page, live_server: Any, operator: User
) -> None:
    grant = locks.acquire("report:nightly", holder="worker-stuck", ttl=600)
    log_in(page, live_server.url)

    page.goto(f"{live_server.url}/admin/coordination/lock/")
    row = page.locator("#result_list tbody tr", has_text="report:nightly")
    expect(row.locator("[data-state]")).to_have_attribute("data-state", "held")
    row.locator("input.action-select").check()
    page.select_option("select[name=action]", "revoke_selected")
    page.click("button[name=index]")

    expect(page.locator("h1")).to_have_text("Revoke this lock?")
    expect(page.locator(".coordination-confirm-table")).to_contain_text("worker-stuck")
    assert Lock.objects.held().filter(key="report:nightly").exists()
    page.click("#coordination-confirm")

    expect(page.locator(".messagelist")).to_contain_text("Revoked 1 lock")
    row = page.locator("#result_list tbody tr", has_text="report:nightly")
    expect(row.locator("[data-state]")).to_have_attribute("data-state", "free")
    assert locks.acquire("report:nightly", holder="worker-next", ttl=5).token == grant.token + 1


@pytest.mark.legs(
    "pg", "sqlite",
    reason="runs the whole demo first; the LTS leg draws the timeline in the tests around it",
)
def test_after_coordination_demo_the_dashboard_shows_its_refused_write(
    page: Page, live_server: Any, operator: User, tmp_path: Path
) -> None:
    finished, result = run_demo(tmp_path)
    assert finished.returncode == 0, f"{finished.stdout}\n{finished.stderr}"
    key = f"account:{result['account']}"
    # The row's refusal; the demo's outbox call (and, where configured, its
    # object and Redis key) were refused on their own too, each a Rejection.
    row = f"demo.account:{result['account']}"
    rejection = Rejection.objects.get(lock_key=key, resource=row)
    a_token = rejection.token
    b_token = Grant.objects.filter(lock__key=key).order_by("-token").values_list("token", flat=True)[0]
    log_in(page, live_server.url)

    page.goto(f"{live_server.url}/admin/coordination/lock/dashboard/?key={key}")
    timeline = page.locator(f'svg.coordination-timeline[data-key="{key}"]')
    expect(timeline.locator(f'rect[data-token="{a_token}"]')).to_have_attribute("data-end", "expired")
    expect(timeline.locator(f'rect[data-token="{b_token}"]')).to_have_attribute("data-end", "released")
    others = ":not([data-resource^='outbox:']):not([data-resource^='redis:']):not([data-resource^='s3:'])"
    accepted = f'[data-kind="accepted-write"][data-token="{b_token}"]{others}'
    expect(timeline.locator(accepted)).to_have_count(1)
    refused = timeline.locator(f'[data-kind="refused-write"][data-token="{a_token}"][data-resource="{row}"]')
    expect(refused).to_have_attribute("data-reason", "stale_token")
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "dashboard-after-demo.png"), full_page=True)
