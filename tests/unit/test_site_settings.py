"""The site's settings default to production: DEBUG off, a secret key required."""

from __future__ import annotations

import runpy
from pathlib import Path
from typing import Any

import pytest
from django.core.exceptions import ImproperlyConfigured

SETTINGS = Path(__file__).resolve().parents[2] / "project" / "settings.py"


def site_settings(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, **environment: str) -> dict[str, Any]:
    """Read project/settings.py afresh with only these DJANGO_ variables set."""
    for name in ("DJANGO_DEBUG", "DJANGO_SECRET_KEY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("COORDINATION_VAR_DIR", str(tmp_path))
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    return runpy.run_path(str(SETTINGS))


def test_without_environment_the_site_refuses_to_start_naming_the_secret_key(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    with pytest.raises(ImproperlyConfigured, match="DJANGO_SECRET_KEY is not set"):
        site_settings(monkeypatch, tmp_path)


def test_with_a_secret_key_debug_is_off(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    values = site_settings(monkeypatch, tmp_path, DJANGO_SECRET_KEY="k" * 50)
    assert values["DEBUG"] is False
    assert values["SECRET_KEY"] == "k" * 50


@pytest.mark.parametrize("value", ["0", "", "no", "false", "off", "debug"])
def test_only_a_yes_turns_debug_on(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, value: str) -> None:
    values = site_settings(monkeypatch, tmp_path, DJANGO_SECRET_KEY="k" * 50, DJANGO_DEBUG=value)
    assert values["DEBUG"] is False


def test_debug_on_uses_the_development_key(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    values = site_settings(monkeypatch, tmp_path, DJANGO_DEBUG="1")
    assert values["DEBUG"] is True
    assert values["SECRET_KEY"].startswith("insecure-development-key")


def test_bin_run_turns_debug_on_for_the_local_demo() -> None:
    run = (SETTINGS.parents[1] / "bin" / "run").read_text()
    assert "export DJANGO_DEBUG=${DJANGO_DEBUG:-1}" in run
