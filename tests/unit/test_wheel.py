"""The wheel holds the app a user installs, and nothing of this repository's site.

The wheel is built as a release would build it (``pip wheel``, offline: the
venv's setuptools, ``--no-build-isolation``) from a clean copy of the
checkout, then read as a file list, and finally installed the simplest way (its
files on ``sys.path``) under a user's own settings module, where ``manage.py
help`` must list only commands that can run there.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path, PurePosixPath

import pytest

REPO = Path(__file__).resolve().parents[2]
DIST_INFO = "django_coordination-0.1.0.dist-info"
# The site's code: none of it may travel in the wheel, under any name.
SITE_WORDS = ("demo", "chaos", "bench", "project", "tests")
SITE_FOLDERS = {"lab", "project", "tests"}
USER_COMMANDS = {"coordination_prune", "coordination_relay", "coordination_restore_guard"}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if importlib.util.find_spec("setuptools") is None:
        pytest.fail("setuptools is missing from this venv: pip install -r requirements/tools.txt")
    work = tmp_path_factory.mktemp("wheel")
    # A copy, not the checkout: setuptools packs whatever an earlier build left in
    # build/lib (modules since moved away included), and writes build/ and
    # *.egg-info next to the sources.
    source = work / "source"
    shutil.copytree(
        REPO, source,
        ignore=shutil.ignore_patterns(
            ".git", ".venv*", "var", "build", "dist", "*.egg-info", "__pycache__",
            ".mypy_cache", ".ruff_cache", ".pytest_cache", ".hypothesis", "node_modules",
        ),
    )
    out = work / "dist"
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
         "--disable-pip-version-check", "-q", "-w", str(out), str(source)],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert built.returncode == 0, f"pip wheel failed:\n{built.stdout}\n{built.stderr}"
    [found] = out.glob("django_coordination-*.whl")
    return found


@pytest.fixture(scope="module")
def names(wheel: Path) -> set[str]:
    with zipfile.ZipFile(wheel) as archive:
        return {info.filename for info in archive.infolist() if not info.is_dir()}


def app_files(names: set[str]) -> set[str]:
    return {name for name in names if name.startswith("coordination/")}


def source_files(folder: str, suffix: str = "") -> set[str]:
    root = REPO / "coordination" / folder
    return {
        path.relative_to(REPO).as_posix()
        for path in root.rglob(f"*{suffix}")
        if path.is_file() and "__pycache__" not in path.parts
    }


def test_the_wheel_holds_only_the_app_and_its_metadata(names: set[str]) -> None:
    strays = sorted(
        name for name in names if not name.startswith(("coordination/", f"{DIST_INFO}/"))
    )
    assert not strays, f"files outside the coordination package: {strays}"
    site = sorted(
        name for name in app_files(names)
        if SITE_FOLDERS & set(PurePosixPath(name).parts)
        or any(word in part for part in PurePosixPath(name).parts[1:] for word in SITE_WORDS)
    )
    assert not site, f"the site's demo, chaos, bench or test code is in the wheel: {site}"


def test_the_wheel_carries_the_mit_licence(wheel: Path, names: set[str]) -> None:
    licence = f"{DIST_INFO}/licenses/LICENSE"
    assert licence in names
    with zipfile.ZipFile(wheel) as archive:
        text = archive.read(licence).decode()
        metadata = archive.read(f"{DIST_INFO}/METADATA").decode()
    assert text == (REPO / "LICENSE").read_text()
    assert text.startswith("MIT License") and "Copyright (c) 2026 the django-coordination authors" in text
    assert "License-Expression: MIT" in metadata.splitlines()
    assert "License-File: LICENSE" in metadata.splitlines()


def test_the_wheels_management_commands_are_restore_guard_prune_and_relay(names: set[str]) -> None:
    commands = {
        PurePosixPath(name).stem
        for name in names
        if name.startswith("coordination/management/commands/") and name.endswith(".py")
    } - {"__init__"}
    assert commands == USER_COMMANDS


def test_the_wheel_keeps_every_module_type_marker_template_static_file_and_migration(
    names: set[str],
) -> None:
    shipped = app_files(names)
    assert "coordination/py.typed" in shipped
    for folder in ("templates", "static", "migrations"):
        expected = source_files(folder, ".py" if folder == "migrations" else "")
        assert expected, f"coordination/{folder} is empty in the checkout"
        assert expected <= shipped, f"missing from the wheel: {sorted(expected - shipped)}"
    modules = {
        path.relative_to(REPO).as_posix()
        for path in (REPO / "coordination").rglob("*.py")
        if "__pycache__" not in path.parts
    }
    assert modules == {name for name in shipped if name.endswith(".py")}


USER_SETTINGS = """
SECRET_KEY = "a user's site"
INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "rest_framework.authtoken",
    "drf_spectacular",
    "django_celery_beat",  # the [beat] extra: FencedDatabaseScheduler's module imports its models
    "coordination",
]
DATABASES = {{"default": {{"ENGINE": "django.db.backends.sqlite3", "NAME": {database!r}}}}}
USE_TZ = True
"""

IMPORT_EVERY_MODULE = """
import importlib, json, pkgutil, sys

import django

django.setup()
import coordination
from django.core.management import get_commands

for module in pkgutil.walk_packages(coordination.__path__, "coordination."):
    importlib.import_module(module.name)
print(json.dumps({
    "package": coordination.__file__,
    "commands": sorted(name for name, app in get_commands().items() if app == "coordination"),
    "site_modules": sorted(name for name in sys.modules if name.split(".")[0] in ("project", "tests")),
}))
"""


def test_a_users_site_with_the_wheel_imports_no_site_code_and_lists_only_runnable_commands(
    wheel: Path, tmp_path: Path,
) -> None:
    installed = tmp_path / "site-packages"
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(installed)
    site = tmp_path / "shop"
    site.mkdir()
    (site / "shop_settings.py").write_text(
        textwrap.dedent(USER_SETTINGS).format(database=str(tmp_path / "shop.sqlite3"))
    )
    # Not the checkout: the user's directory and the installed wheel only.
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "shop_settings",
        "PYTHONPATH": os.pathsep.join([str(site), str(installed)]),
    }

    imported = subprocess.run(
        [sys.executable, "-c", IMPORT_EVERY_MODULE],
        cwd=site, env=env, capture_output=True, text=True, timeout=120, check=False,
    )
    assert imported.returncode == 0, imported.stderr[-3000:]
    report = json.loads(imported.stdout.splitlines()[-1])
    assert Path(report["package"]).is_relative_to(installed), report["package"]
    assert report["site_modules"] == []
    assert set(report["commands"]) == USER_COMMANDS

    helped = subprocess.run(
        [sys.executable, "-m", "django", "help", "--commands"],
        cwd=site, env=env, capture_output=True, text=True, timeout=120, check=False,
    )
    assert helped.returncode == 0, helped.stderr[-3000:]
    listed = {line.strip() for line in helped.stdout.splitlines()}
    assert {name for name in listed if name.startswith("coordination")} == USER_COMMANDS


WITHOUT_EXTRAS = """
import importlib.machinery, json, sys

# The packages the extras bring (and the test tools), as if never installed.
EXTRAS = {"redis", "boto3", "botocore", "storages", "moto", "celery", "kombu", "psycopg",
          "MySQLdb", "prometheus_client", "django_celery_beat", "drf_spectacular_sidecar"}
find_spec = importlib.machinery.PathFinder.find_spec
importlib.machinery.PathFinder.find_spec = staticmethod(
    lambda name, path=None, target=None: None if name.split(".")[0] in EXTRAS
    else find_spec(name, path, target)
)

import django

django.setup()
from django.core.checks import run_checks
from django.core.management import call_command

from coordination import locks
from coordination.stores.outbox import record_call

call_command("migrate", verbosity=0)
grant = locks.acquire("payouts:1", holder="a task", ttl=5)
print(json.dumps({
    "checks": [message.id for message in run_checks() if message.id.startswith("coordination")],
    "call": record_call("https://example.invalid/", {"n": 1}, grant=grant).state,
    "extras": sorted({name.split(".")[0] for name in sys.modules} & EXTRAS),
}))
"""


def test_the_app_starts_and_records_an_outbox_call_without_any_extra(wheel: Path, tmp_path: Path) -> None:
    """The base install (Django, DRF, drf-spectacular): the app's checks pass, its
    tables migrate, the outbox records a call, and no extra's package is imported."""
    installed = tmp_path / "site-packages"
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(installed)
    site = tmp_path / "shop"
    site.mkdir()
    settings = textwrap.dedent(USER_SETTINGS).replace('    "django_celery_beat",', "#").format(
        database=str(tmp_path / "shop.sqlite3")
    )
    (site / "shop_settings.py").write_text(
        settings + 'DATABASES["default"]["OPTIONS"] = {"transaction_mode": "IMMEDIATE"}\n'
    )
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "shop_settings",
        "PYTHONPATH": os.pathsep.join([str(site), str(installed)]),
    }
    ran = subprocess.run(
        [sys.executable, "-c", WITHOUT_EXTRAS], cwd=site, env=env, capture_output=True, text=True,
        timeout=120, check=False,
    )
    assert ran.returncode == 0, ran.stderr[-3000:]
    report = json.loads(ran.stdout.splitlines()[-1])
    assert report == {"checks": [], "call": "pending", "extras": []}
