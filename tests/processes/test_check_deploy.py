"""``manage.py check --deploy`` on a new site set up as the tutorial's Installation
section (docs/tutorial.md) says: neither the app's checks nor drf-spectacular's (which generates the
site's whole schema) report an error about the app or its views, and the app warns
of its own deployment need (W021: a cache shared by the web processes).

docs/security.md tells users to run ``check --deploy``; the site's own settings
(DEBUG, HSTS, secure cookies) are theirs to fix and are not asserted here.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.processes.test_third_party_site import README as TUTORIAL
from tests.processes.test_third_party_site import REPO, installation_blocks

pytestmark = pytest.mark.legs(
    "pg", "lts", reason="Django's checks, on each supported Django; the site runs on SQLite"
)

MESSAGE_ID = re.compile(r"\((?P<id>[\w.]+\.[EWIC]\d+)\)")


def readme_site(into: Path) -> Path:
    """``startproject shop`` + ``startapp orders`` with the tutorial's file blocks applied
    (the SQLite variant: the checks need no server). Returns the project directory."""
    run = {"cwd": into, "check": True, "capture_output": True, "timeout": 120}
    subprocess.run([sys.executable, "-m", "django", "startproject", "shop"], **run)  # type: ignore[call-overload]
    shop = into / "shop"
    subprocess.run([sys.executable, "manage.py", "startapp", "orders"], **{**run, "cwd": shop})  # type: ignore[call-overload]
    for block in installation_blocks(TUTORIAL.read_text()):
        if block.kind != "file" or block.database == "PostgreSQL":
            continue
        target = shop / block.path
        if block.action == "new file":
            target.write_text(block.text)
        else:
            with target.open("a") as out:
                out.write("\n\n" + block.text)
    return shop


def check_deploy(shop: Path) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        # The app from this checkout, as the installed wheel would provide it.
        "PYTHONPATH": str(REPO),
        "DJANGO_SETTINGS_MODULE": "shop.settings",
    }
    return subprocess.run(
        [sys.executable, "manage.py", "check", "--deploy"],
        cwd=shop, env=env, capture_output=True, text=True, timeout=180, check=False,
    )


def test_check_deploy_on_the_tutorial_site_reports_nothing_about_the_app_or_its_schema(
    tmp_path: Path,
) -> None:
    shop = readme_site(tmp_path)

    finished = check_deploy(shop)
    output = finished.stdout + finished.stderr
    ids = set(MESSAGE_ID.findall(output))

    assert not {found for found in ids if found.startswith("drf_spectacular.")}, output
    assert not {found for found in ids if found.startswith("coordination.E")}, output
    # What remains is about the new site's own deployment settings (DEBUG, HSTS,
    # cookies, Django 6.1's console mail backend), for its owner to set.
    assert ids, output  # the checks ran, and the deploy ones with them
    # coordination.W021 is one of those: the tutorial's site keeps Django's default
    # local-memory cache, where the API's throttles count per process.
    assert "coordination.W021" in ids, output
    assert {
        found for found in ids if not found.startswith(("security.", "mail."))
    } == {"coordination.W021"}, output
