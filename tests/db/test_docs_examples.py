"""The documentation's examples that can run, run.

A fenced ``python`` block of README.md or of a page under docs/ is run when
the line just before it is an HTML comment starting with ``runnable``::

    <!-- runnable: what the reader should know -->
    ```python
    ...
    ```

Invisible on GitHub and on the documentation site. Each block runs on its own,
top to bottom, in a fresh namespace, on the test database, outside any
transaction (the grant point refuses to run inside one), as a reader would run
it in ``manage.py shell``. A model class the block defines (``class
Account(FencedModel)``), or imports from a reader's app (``from
accounts.models import Account``), is taken from the demo site's app, which has
a model of that name and shape with its table migrated; a class with no twin
there fails the test, saying so. The tutorial's blocks are a whole site's files
and shell commands: tests/processes/test_third_party_site.py applies them word
for word.
"""

from __future__ import annotations

import ast
import contextlib
import io
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

import project.demo.models as demo_models

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
RUNNABLE = re.compile(
    r"^<!-- runnable\b.*?-->\n```python\n(?P<code>.*?)^```$", re.MULTILINE | re.DOTALL
)


@dataclass(frozen=True)
class Example:
    page: Path
    line: int
    code: str

    def __str__(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"


def runnable_examples() -> list[Example]:
    examples = []
    for page in PAGES:
        text = page.read_text()
        for match in RUNNABLE.finditer(text):
            line = text.count("\n", 0, match.start("code")) + 1
            examples.append(Example(page, line, match["code"]))
    return examples


EXAMPLES = runnable_examples()


def test_the_readme_has_runnable_examples() -> None:
    assert any(example.page.name == "README.md" for example in EXAMPLES)


def is_readers_models(node: ast.ImportFrom) -> bool:
    """``from accounts.models import ...``: a reader's own app, not a package's."""
    module = node.module or ""
    return (
        node.level == 0
        and module.endswith(".models")
        and module.split(".")[0] not in {"coordination", "django", "project"}
    )


def demo_twin(example: Example, name: str) -> object:
    twin = getattr(demo_models, name, None)
    if twin is None:
        pytest.fail(
            f"{example} uses model {name}, which project/demo/models.py does not "
            "have: give the example a model the demo site has, or drop the runnable mark"
        )
    return twin


def with_demo_models(example: Example) -> tuple[ast.Module, dict[str, object]]:
    """The block without its model classes, and a namespace holding the demo's twins."""
    tree = ast.parse(example.code, filename=str(example))
    namespace: dict[str, object] = {"__name__": "docs_example"}
    body = []
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and is_readers_models(node):
            for alias in node.names:
                namespace[alias.asname or alias.name] = demo_twin(example, alias.name)
        elif isinstance(node, ast.ClassDef):
            namespace[node.name] = demo_twin(example, node.name)
        else:
            body.append(node)
    tree.body = body
    return tree, namespace


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("example", EXAMPLES, ids=str)
def test_the_example_runs(example: Example) -> None:
    tree, namespace = with_demo_models(example)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(tree, str(example), "exec"), namespace)
    # An example that prints says what it prints in a comment on that line.
    for expected in re.findall(r"print\(.*\)\s+# (.+)$", example.code, re.MULTILINE):
        assert expected.strip() in printed.getvalue(), (str(example), printed.getvalue())
