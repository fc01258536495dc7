"""One version, stated in three places that must agree: the package metadata
(``pyproject.toml``), ``coordination.__version__`` (the OpenAPI schema's
``info.version``) and a released section of CHANGELOG.md."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import coordination

REPO = Path(__file__).resolve().parents[2]
# Semantic versions, as docs/versioning.md defines them (a pre-release suffix allowed).
SEMVER = re.compile(r"^\d+\.\d+\.\d+(?:(?:a|b|rc)\d+)?$")


def pyproject_version() -> str:
    with (REPO / "pyproject.toml").open("rb") as handle:
        return str(tomllib.load(handle)["project"]["version"])


def test_the_package_version_and_coordination_version_agree() -> None:
    assert coordination.__version__ == pyproject_version()


def test_the_version_is_a_semantic_version() -> None:
    assert SEMVER.match(coordination.__version__), coordination.__version__


def test_the_changelog_has_an_unreleased_section_and_one_for_this_version() -> None:
    headings = re.findall(r"^## \[([^\]]+)\]", (REPO / "CHANGELOG.md").read_text(), re.MULTILINE)
    assert headings[:1] == ["Unreleased"], headings
    assert coordination.__version__ in headings[1:], (
        f"CHANGELOG.md has no '## [{coordination.__version__}] - date' section for the version "
        "in pyproject.toml"
    )
