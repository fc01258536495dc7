"""The app does not depend on this repository's site.

``coordination/`` is what users install; ``project/`` (settings, the demo's
``Account``, the lab's demo, chaos and bench commands) and ``tests/`` are not in
their projects. The wheel test imports every module from the built wheel, but a
lazy import inside a function only fails when it runs, so the source is read
too: every import statement, at any depth, and every string naming a site module
(``celery -A project``, ``apps.is_installed("project.demo")``) or model
(``apps.get_model("demo.Account")``).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

APP = Path(__file__).resolve().parents[2] / "coordination"
SITE_PACKAGES = {"project", "tests"}
SITE_NAME = re.compile(r"(project|tests)(\.\w+)*|(demo|lab)\.[A-Z]\w*")


def site_references(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules = [node.module]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if SITE_NAME.fullmatch(node.value):
                found.append(f"line {node.lineno}: names {node.value!r}")
            continue
        else:
            continue
        found.extend(
            f"line {node.lineno}: imports {module}"
            for module in modules
            if module.partition(".")[0] in SITE_PACKAGES
        )
    return found


def test_nothing_in_the_app_imports_or_names_the_site() -> None:
    modules = sorted(APP.rglob("*.py"))
    assert len(modules) > 20, f"expected the app's modules under {APP}"
    found = {
        path.relative_to(APP.parent).as_posix(): references
        for path in modules
        if (references := site_references(path))
    }
    assert found == {}


def test_the_check_sees_a_lazy_import_and_a_celery_app_name(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text(
        "def handle():\n"
        "    from project.demo.models import Account\n"
        "    return ['celery', '-A', 'project', 'worker']\n"
    )
    assert site_references(sample) == ["line 2: imports project.demo.models", "line 3: names 'project'"]
