"""The reference pages in the repository say what the code does.

docs/reference/ keeps the settings table, the exceptions, the commands' help and
the REST reference written out (between ``<!-- generated: NAME -->`` and its end
marker), so a reader of the repository or of the package page finds them without
building the site. The site's build writes them afresh; this test writes them in
memory and fails when the committed copy differs.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]

# The schema's integer formats follow the database's field ranges: the pages are
# written as the site's build writes them, on the embedded SQLite default.
pytestmark = pytest.mark.legs(
    "sqlite", reason="the pages are written on the main Django and the embedded SQLite default"
)


def generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("docs_generated", REPO / "docs" / "hooks" / "generated.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_committed_reference_parts_match_the_code(monkeypatch: pytest.MonkeyPatch) -> None:
    generated = generator()
    monkeypatch.setenv("COLUMNS", "100")  # argparse's help width, as the build sets it
    pages = generated.committed_pages()
    assert {page.name for page in pages} >= {"settings.md", "exceptions.md", "commands.md", "rest.md"}
    stale = [
        str(page.relative_to(REPO)) for page in pages
        if generated.refreshed(page.read_text(), page.name) != page.read_text()
    ]
    assert stale == [], (
        f"{', '.join(stale)} differ from the code: run "
        "`.venv/bin/python docs/hooks/generated.py --write` and commit the pages"
    )


def test_no_committed_part_is_left_a_bare_marker() -> None:
    generated = generator()
    for page in generated.committed_pages():
        for match in generated.MARKER.finditer(page.read_text()):
            if match["name"] in generated.COMMITTED:
                assert "<!-- end generated:" in match.group(0), f"{page.name}: {match['name']} is empty"
    assert os.environ.get("DJANGO_SETTINGS_MODULE")
