"""The app's modules import strictly downward, and none grows past the size limit.

Every import statement counts, at any depth: one inside a function or under
``if TYPE_CHECKING:`` is a dependency a reader must hold all the same, so a
circle made of lazy imports is still a circle. CONTRIBUTING.md's architecture
section names the layers; ``LAYERS`` below is the same list, and a module may
import only from its own layer or the ones under it.

Also here: every dotted path under ``coordination.`` that the docs name imports,
and every public name of a documented module's ``__all__`` is there.
"""

from __future__ import annotations

import ast
import importlib
import re
from collections.abc import Iterable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
APP = REPO / "coordination"
MAX_LINES = 600

# Bottom up; a module belongs to the first layer with a prefix it starts with.
# Modules of one layer may import each other (without a circle).
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("floor", ("coordination.conf", "coordination.exceptions", "coordination.signals",
               "coordination.logfields", "coordination.charsets", "coordination.holders")),
    ("names", ("coordination.keys", "coordination.leases", "coordination.fenced.unfenced",
               "coordination.fenced.keys")),
    ("rows", ("coordination.models", "coordination.watermarks", "coordination.history")),
    ("backends", ("coordination.backends", "coordination.metrics", "coordination.access")),
    ("waiting", ("coordination.aio", "coordination.waiting", "coordination.renewal",
                 "coordination.keepalive", "coordination.results")),
    ("primitives", ("coordination.locks", "coordination.shared", "coordination.semaphores",
                    "coordination.ratelimits")),
    ("fences", ("coordination.fenced", "coordination.fencing", "coordination.stores")),
    ("operations", ("coordination.election", "coordination.restore", "coordination.pruning",
                    "coordination.testing", "coordination.documents", "coordination.http",
                    "coordination.jobs", "coordination.unique", "coordination.stranded")),
    ("jobs", ("coordination.contrib",)),
    ("surfaces", ("coordination.api", "coordination.dashboard", "coordination.admin",
                  "coordination.checks", "coordination.management", "coordination.migrations",
                  "coordination.apps", "coordination")),
]


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules_of(root: Path) -> dict[str, Path]:
    return {module_name(path, root): path for path in sorted((root / "coordination").rglob("*.py"))}


def imports_of(name: str, path: Path, known: Iterable[str]) -> set[str]:
    """The package's modules that ``name`` imports, lazy and TYPE_CHECKING imports included."""
    known = set(known)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]

    def owner(dotted: str) -> str | None:
        while dotted and dotted not in known:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package
                for _ in range(node.level - 1):
                    anchor = anchor.rpartition(".")[0]
                base = f"{anchor}.{base}" if base else anchor
            # ``from . import locks`` imports the module; ``from .models import Lock`` the package.
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
                       for alias in node.names]
        for target in targets:
            module = owner(target) if target.startswith("coordination") else None
            if module is not None and module != name:
                found.add(module)
    return found


def import_graph(root: Path) -> dict[str, set[str]]:
    modules = modules_of(root)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(graph[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def describe(circle: list[str], graph: dict[str, set[str]]) -> str:
    members = set(circle)
    return "; ".join(f"{a} -> {b}" for a in circle for b in sorted(graph[a] & members))


def layer_of(module: str) -> int:
    for number, (_name, prefixes) in enumerate(LAYERS):
        if any(module == prefix or module.startswith(prefix + ".") for prefix in prefixes):
            return number
    raise AssertionError(f"{module} is in no layer: add it to LAYERS and CONTRIBUTING.md")


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return sorted(
        f"{module} ({LAYERS[layer_of(module)][0]}) imports {other} ({LAYERS[layer_of(other)][0]})"
        for module, imported in graph.items()
        for other in imported
        if layer_of(other) > layer_of(module)
    )


def long_modules(root: Path) -> list[str]:
    return sorted(
        f"{name}: {lines} lines"
        for name, path in modules_of(root).items()
        if (lines := len(path.read_text(encoding="utf-8").splitlines())) > MAX_LINES
    )


# --- the app itself ----------------------------------------------------------------


def test_the_app_has_no_import_circle() -> None:
    graph = import_graph(REPO)
    assert len(graph) > 50, "expected the app's modules"
    assert [describe(circle, graph) for circle in circles(graph)] == []


def test_every_module_imports_only_from_its_layer_or_below() -> None:
    assert upward_imports(import_graph(REPO)) == []


def test_no_module_is_over_the_size_limit() -> None:
    assert long_modules(REPO) == []


def test_no_module_hands_out_names_through_a_module_getattr() -> None:
    found = [
        name for name, path in modules_of(REPO).items()
        if any(isinstance(node, ast.FunctionDef) and node.name == "__getattr__"
               for node in ast.parse(path.read_text(encoding="utf-8")).body)
    ]
    assert found == []


# --- the checks can fail ------------------------------------------------------------


def write_package(root: Path, files: dict[str, str]) -> None:
    for relative, text in files.items():
        path = root / "coordination" / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")


def test_a_circle_of_lazy_and_type_checking_imports_is_found(tmp_path: Path) -> None:
    write_package(tmp_path, {
        "__init__.py": "",
        "locks.py": "from . import models\n",
        "models.py": "def f():\n    from .keepalive import KeepAlive\n",
        "keepalive.py": (
            "from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n    from coordination.locks import acquire\n"
        ),
        "apart.py": "import coordination.models\n",
    })
    graph = import_graph(tmp_path)
    assert circles(graph) == [["coordination.keepalive", "coordination.locks", "coordination.models"]]
    assert "coordination.models" in graph["coordination.apart"]


def test_an_upward_import_and_a_long_module_are_found(tmp_path: Path) -> None:
    write_package(tmp_path, {
        "__init__.py": "",
        "models/__init__.py": "from ..locks import acquire\n",
        "locks.py": "x = 1\n" * (MAX_LINES + 1),
    })
    graph = import_graph(tmp_path)
    assert upward_imports(graph) == [
        "coordination.models (rows) imports coordination.locks (primitives)"
    ]
    assert long_modules(tmp_path) == [f"coordination.locks: {MAX_LINES + 1} lines"]


# --- the documented names -----------------------------------------------------------

DOTTED = re.compile(r"\bcoordination(?:\.[A-Za-z_]\w*)+")
DOCS = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def documented_paths() -> list[str]:
    """Dotted paths under a module of the app (permissions, check ids and logger
    names such as ``coordination.acquire_lock`` or ``coordination.E003`` name no module)."""
    modules = modules_of(REPO)
    found = set()
    for page in DOCS:
        for dotted in DOTTED.findall(page.read_text(encoding="utf-8")):
            first = ".".join(dotted.split(".")[:2])
            if first in modules or dotted == "coordination.unfenced":
                found.add(dotted)
    return sorted(found)


def resolve(dotted: str) -> object:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found: object = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attribute in parts[cut:]:
            found = getattr(found, attribute)
        return found
    raise ModuleNotFoundError(dotted)


def test_the_docs_name_paths_that_import() -> None:
    paths = documented_paths()
    assert len(paths) > 40, "expected the docs to name the app's modules"
    broken = []
    for dotted in paths:
        try:
            resolve(dotted)
        except (ImportError, AttributeError) as error:
            broken.append(f"{dotted}: {error}")
    assert broken == []


def documented_modules() -> list[str]:
    modules = modules_of(REPO)
    named = {".".join(path.split(".")[:cut]) for path in documented_paths()
             for cut in range(2, path.count(".") + 2)}
    return sorted(name for name in named if name in modules)


@pytest.mark.parametrize("module", documented_modules())
def test_every_public_name_of_a_documented_module_imports(module: str) -> None:
    imported = importlib.import_module(module)
    missing = [name for name in getattr(imported, "__all__", ()) if not hasattr(imported, name)]
    assert missing == []
