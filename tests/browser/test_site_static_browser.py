"""The site as production runs it: ``gunicorn project.wsgi`` with DEBUG off, after
``collectstatic``. The dashboard in a real headless Chromium gets its stylesheets
(served by WhiteNoise), not the bare HTML of a site that serves no static files.

Unlike ``live_server`` (which serves static files itself, whatever the site does),
this is a real server process running the site's own settings and middleware.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth.models import User
from playwright.sync_api import Response, expect, sync_playwright

from tests.browser.test_admin_browser import CHROMIUM_ARGS, PASSWORD
from tests.processes.test_third_party_site import free_port
from tests.support.celery_workers import REPO, worker_environment
from tests.support.legs import missing_service

pytestmark = [
    pytest.mark.legs("pg", reason="one run of the production server; static files are the same on every leg"),
    pytest.mark.django_db(transaction=True),  # the server process sees the operator
]


def site_environment(var_dir: Path) -> dict[str, str]:
    """The site's settings on the test database, DEBUG off, its files under ``var_dir``."""
    env = worker_environment(None, COORDINATION_VAR_DIR=str(var_dir), DJANGO_ALLOWED_HOSTS="127.0.0.1")
    env.pop("DJANGO_DEBUG", None)
    return env


@pytest.fixture
def production_site(tmp_path: Path) -> Iterator[str]:
    """``collectstatic`` into a fresh directory, then ``gunicorn project.wsgi``; its base URL."""
    env = site_environment(tmp_path)
    collected = subprocess.run(
        [sys.executable, "manage.py", "collectstatic", "--noinput"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=180, check=False,
    )
    assert collected.returncode == 0, collected.stderr
    assert (tmp_path / "static" / "coordination" / "admin.css").exists()

    port = free_port()
    log = tmp_path / "gunicorn.log"
    with log.open("wb") as out:
        server = subprocess.Popen(
            # What the docs tell production to run.
            [sys.executable, "-m", "gunicorn", "project.wsgi", "--bind", f"127.0.0.1:{port}", "-w", "1"],
            cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                with urllib.request.urlopen(f"{base_url}/admin/login/", timeout=5):
                    break
            except (urllib.error.URLError, ConnectionError):
                if server.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(f"gunicorn did not answer:\n{log.read_text()[-3000:]}") from None
                time.sleep(0.1)
        yield base_url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(10)


def test_the_dashboard_gets_its_stylesheets_from_the_production_server_with_debug_off(
    production_site: str, django_user_model: type[User], settings: Any
) -> None:
    django_user_model.objects.create_superuser("operator", "op@example.com", PASSWORD)
    executable = os.environ.get("CHROMIUM_PATH", "/usr/bin/chromium")
    if not Path(executable).exists():
        missing_service(f"Chromium at {executable} (bin/test installs it when it can; or set CHROMIUM_PATH)")
    static: list[Response] = []

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS)
            try:
                page = browser.new_page()
                page.set_default_timeout(15_000)
                page.on("response", lambda got: static.append(got) if "/static/" in got.url else None)
                page.goto(f"{production_site}/admin/login/?next=/admin/coordination/lock/dashboard/")
                page.fill("#id_username", "operator")
                page.fill("#id_password", PASSWORD)
                page.click("input[type=submit]")
                expect(page.locator(".coordination-cards")).to_be_visible()
                page.wait_for_load_state("load")
                sheets = page.evaluate(
                    """() => [...document.styleSheets].filter(s => s.href).map(s => {
                        let rules = -1;
                        try { rules = s.cssRules.length; } catch (e) {}
                        return {href: new URL(s.href).pathname, rules};
                    })"""
                )
                # The admin's own stylesheet took effect: its header is not the browser's default.
                header = page.evaluate(
                    "() => getComputedStyle(document.querySelector('#header')).backgroundColor"
                )
            finally:
                browser.close()

    by_path = {sheet["href"]: sheet["rules"] for sheet in sheets}
    assert by_path.get("/static/coordination/admin.css", 0) > 0, sheets
    assert by_path.get("/static/admin/css/base.css", 0) > 0, sheets
    assert static and all(response.status == 200 for response in static), [
        (response.url, response.status) for response in static
    ]
    assert header not in ("", "rgba(0, 0, 0, 0)"), header
