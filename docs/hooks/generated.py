"""MkDocs hooks: the reference pages written from the code when the site is built.

A page asks for a generated part with a marker line, ``<!-- generated: NAME -->``:

- ``settings``: every ``COORDINATION`` key, its default and its comment, from the
  docstring of ``coordination/conf.py`` (checked against ``conf.DEFAULTS``);
- ``exceptions``: every ``CoordinationError`` subclass with its code and HTTP status;
- ``commands``: the ``--help`` of every management command, the app's and the site's;
- ``changelog``: CHANGELOG.md from the repository's root;
- ``openapi``: the REST API from the OpenAPI schema, made by ``manage.py spectacular``
  with the API's own schema settings, as ``/api/schema/`` serves it. The schema
  itself is written to the site as ``reference/openapi.json``.

Nothing here is copied by hand, so the pages cannot drift from the code. The
reference parts (settings, exceptions, commands, openapi) are also committed
between their marker and ``<!-- end generated: NAME -->``, so the pages read
whole in the repository and on the package's page; the build writes them
afresh, ``python docs/hooks/generated.py --write`` rewrites the committed copy,
and ``tests/unit/test_reference_pages.py`` fails when it differs from the code.
"""

from __future__ import annotations

import ast
import inspect
import io
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
# A marker, then (for a committed part) its last written text and the end marker.
MARKER = re.compile(
    r"^<!-- generated: (?P<name>[a-z]+) -->$"
    r"(?:\n.*?^<!-- end generated: (?P=name) -->$)?",
    re.MULTILINE | re.DOTALL,
)
COMMITTED = ("settings", "exceptions", "commands", "openapi")
"""The parts kept in the repository's pages too; the changelog is CHANGELOG.md's."""
_schema: dict[str, Any] | None = None


def on_config(config: Any) -> Any:
    # The app and the site are used from the checkout, as bin/run does.
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")
    os.environ.setdefault("DJANGO_SECRET_KEY", "documentation-build-only")
    os.environ.setdefault("COLUMNS", "100")  # argparse's help width
    import django

    django.setup()
    return config


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    return refreshed(markdown, page.file.src_uri)


def refreshed(markdown: str, where: str) -> str:
    """``markdown`` with every generated part written afresh from the code."""
    def generate(match: re.Match[str]) -> str:
        name = match["name"]
        if name not in GENERATORS:
            raise ValueError(f"{where}: no generator {name!r} (known: {', '.join(GENERATORS)})")
        text = GENERATORS[name]().rstrip("\n")
        if name not in COMMITTED:
            return text
        return f"<!-- generated: {name} -->\n{text}\n<!-- end generated: {name} -->"

    return MARKER.sub(generate, markdown)


def committed_pages() -> list[Path]:
    """The pages of docs/ with a committed generated part."""
    return [
        page for page in sorted((REPO / "docs").rglob("*.md"))
        if any(match["name"] in COMMITTED for match in MARKER.finditer(page.read_text()))
    ]


def main(argv: list[str]) -> int:
    """``--write``: rewrite the committed parts; ``--check``: say which pages differ."""
    if argv not in (["--write"], ["--check"]):
        print("usage: python docs/hooks/generated.py --write | --check", file=sys.stderr)
        return 2
    on_config(None)
    os.environ["COLUMNS"] = "100"
    stale = []
    for page in committed_pages():
        text = page.read_text()
        fresh = refreshed(text, str(page.relative_to(REPO)))
        if fresh != text:
            stale.append(page.relative_to(REPO))
            if argv == ["--write"]:
                page.write_text(fresh)
    verb = "rewritten" if argv == ["--write"] else "out of date"
    for page in stale:
        print(f"{page}: {verb}")
    return 1 if stale and argv == ["--check"] else 0


def on_files(files: Any, config: Any) -> Any:
    from mkdocs.structure.files import File

    schema = json.dumps(openapi_schema(), indent=2)
    files.append(File.generated(config, "reference/openapi.json", content=schema))
    return files


# --- the changelog ---------------------------------------------------------------------

def changelog() -> str:
    """CHANGELOG.md, its links to docs/ made relative to the site."""
    text = (REPO / "CHANGELOG.md").read_text()
    return re.sub(r"\]\(docs/", "](", text)


# --- settings ------------------------------------------------------------------------

def settings_table() -> str:
    from coordination import conf

    doc = inspect.getdoc(conf) or ""
    found = re.search(r"^(?P<indent> *)COORDINATION = \{\n(?P<body>.*?)^(?P=indent)\}", doc, re.M | re.S)
    if found is None:
        raise ValueError("coordination/conf.py: no 'COORDINATION = {...}' block in the docstring")
    block = "\n" + found["body"]
    rows: dict[str, list[str]] = {}
    current = ""
    for line in block.splitlines()[1:]:
        entry = re.match(r'^\s*"(?P<key>[A-Z_]+)":\s*(?P<value>.*?),\s*(?:#\s*(?P<comment>.*))?$', line)
        if entry:
            current = entry["key"]
            rows[current] = [entry["value"], entry["comment"] or ""]
        elif current and (comment := re.match(r"^\s*#\s*(?P<comment>.*)$", line)):
            rows[current][1] += " " + comment["comment"]
    if set(rows) != set(conf.DEFAULTS):
        raise ValueError(
            "coordination/conf.py: the docstring and DEFAULTS list different keys: "
            f"{sorted(set(rows) ^ set(conf.DEFAULTS))}"
        )
    lines = ["| key | default | what it does |", "|---|---|---|"]
    for key, (value, comment) in rows.items():
        if ast.literal_eval(value) != conf.DEFAULTS[key]:
            raise ValueError(f"coordination/conf.py: the docstring's default of {key} is not DEFAULTS'")
        lines.append(f"| `{key}` | `{value}` | {_cell(comment)} |")
    return "\n".join(lines)


# --- exceptions ----------------------------------------------------------------------

def exceptions_table() -> str:
    from coordination import exceptions

    classes = [
        cls
        for _, cls in inspect.getmembers(exceptions, inspect.isclass)
        if issubclass(cls, exceptions.CoordinationError) and cls.__module__ == exceptions.__name__
    ]
    classes.sort(key=lambda cls: (cls is not exceptions.CoordinationError, cls.__name__))
    lines = ["| exception | `code` | HTTP status | when |", "|---|---|---|---|"]
    for cls in classes:
        summary = (inspect.getdoc(cls) or cls.default_detail).split("\n\n")[0].replace("\n", " ")
        lines.append(f"| `{cls.__name__}` | `{cls.code}` | {cls.status_code} | {_cell(_plain(summary))} |")
    return "\n".join(lines)


# --- management commands -------------------------------------------------------------

def commands_help() -> str:
    from django.core.management import get_commands, load_command_class

    out = []
    for name, app in sorted(get_commands().items()):
        if not name.startswith("coordination_"):
            continue
        command = load_command_class(app, name)
        parser = command.create_parser("manage.py", name)
        where = "the app (installed with it)"
        if app != "coordination":
            where = f"this repository's site (`{app}`)"
        out += [f"## `{name}`", "", f"From {where}.", "", "```text", parser.format_help().rstrip(), "```", ""]
    return "\n".join(out)


# --- the REST API from the OpenAPI schema --------------------------------------------

def openapi_schema() -> dict[str, Any]:
    global _schema
    if _schema is None:
        from django.core.management import call_command

        out = io.StringIO()
        call_command(
            "spectacular",
            custom_settings="coordination.api.schema.SCHEMA_SETTINGS",
            format="openapi-json",
            validate=True,
            fail_on_warn=True,
            stdout=out,
        )
        _schema = json.loads(out.getvalue())
    return _schema


def openapi_reference() -> str:
    schema = openapi_schema()
    info = schema["info"]
    out = [
        f"Schema: {info['title']} {info['version']}, OpenAPI {schema['openapi']} "
        "([download it](openapi.json)).",
        "",
    ]
    for path, operations in schema["paths"].items():
        for method, operation in operations.items():
            if method not in {"get", "put", "post", "patch", "delete"}:
                continue
            title = operation.get("summary") or operation["operationId"].replace("_", " ")
            out += [f"## `{method.upper()} {path}`", "", f"**{_plain(title)}**", ""]
            if description := operation.get("description"):
                out += [_plain(description), ""]
            parameters = operation.get("parameters", [])
            if parameters:
                out += ["| parameter | in | type | required | description |", "|---|---|---|---|---|"]
                for parameter in parameters:
                    out.append(
                        f"| `{parameter['name']}` | {parameter['in']} | {_type(parameter.get('schema', {}))} "
                        f"| {'yes' if parameter.get('required') else 'no'} "
                        f"| {_cell(parameter.get('description', ''))} |"
                    )
                out.append("")
            body = operation.get("requestBody", {}).get("content", {}).get("application/json")
            if body:
                out += [f"Request body: {_type(body['schema'])}", ""]
            out += ["| status | response |", "|---|---|"]
            for status, response in operation.get("responses", {}).items():
                content = response.get("content", {}).get("application/json")
                shape = f" {_type(content['schema'])}" if content else ""
                out.append(f"| {status} | {_cell(response.get('description', ''))}{shape} |")
            out.append("")
    out += ["## Schemas", ""]
    for name, component in schema["components"]["schemas"].items():
        out += [f"### {name}", ""]
        if description := component.get("description"):
            out += [_plain(description), ""]
        if "enum" in component:
            out += ["One of: " + ", ".join(f"`{value}`" for value in component["enum"] if value != ""), ""]
            continue
        properties = component.get("properties", {})
        if properties:
            required = set(component.get("required", []))
            out += ["| field | type | required | description |", "|---|---|---|---|"]
            for field, spec in properties.items():
                flags = " (read-only)" if spec.get("readOnly") else ""
                out.append(
                    f"| `{field}` | {_type(spec)}{flags} | {'yes' if field in required else 'no'} "
                    f"| {_cell(spec.get('description', ''))} |"
                )
            out.append("")
    return "\n".join(out)


def _type(spec: dict[str, Any]) -> str:
    if "$ref" in spec:
        name = spec["$ref"].rsplit("/", 1)[-1]
        return f"[{name}](#{name.lower()})"
    for combinator in ("allOf", "oneOf", "anyOf"):
        if combinator in spec:
            return " or ".join(_type(part) for part in spec[combinator])
    kind = spec.get("type", "object")
    if kind == "array":
        return f"array of {_type(spec.get('items', {}))}"
    if "format" in spec:
        kind = f"{kind} ({spec['format']})"
    if "enum" in spec:
        kind += ": " + ", ".join(f"`{value}`" for value in spec["enum"] if value not in ("", None))
    return kind


def _plain(text: str) -> str:
    """reST roles and literals of docstrings as Markdown code."""
    text = re.sub(r":[a-z]+:`~(?:[\w.]+\.)?(\w+)`", r"`\1`", text)
    text = re.sub(r":[a-z]+:`([^`]+)`", r"`\1`", text)
    return text.replace("``", "`")


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


GENERATORS = {
    "changelog": changelog,
    "settings": settings_table,
    "exceptions": exceptions_table,
    "commands": commands_help,
    "openapi": openapi_reference,
}


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
