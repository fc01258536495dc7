"""Log fields: a value is one field, whatever it contains."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest

from coordination.logfields import LogFields, format_fields, quote


@pytest.mark.parametrize(
    "value",
    ["worker-3", "account:7", "2026-11-29T12:00:05+00:00", "42", "a/b@c.d_e"],
)
def test_plain_values_stay_bare(value: str) -> None:
    assert quote(value) == value


@pytest.mark.parametrize(
    "value",
    ["", "x reason=accepted key=other", 'say "hi"', "back\\slash", "new\nline", "tab\there", "caf\u00e9 x",
     "\u2028line separator", "x=y"],
)
def test_anything_else_is_one_json_string(value: str) -> None:
    quoted = quote(value)
    assert quoted.startswith('"') and quoted.endswith('"')
    assert json.loads(quoted) == value
    assert "\n" not in quoted and "\u2028" not in quoted


def test_none_and_booleans() -> None:
    assert format_fields({"a": None, "b": True, "c": False, "d": 7}) == "a=- b=true c=false d=7"


def test_a_forged_value_cannot_add_a_field() -> None:
    line = format_fields({"key": "job:1", "holder": 'x" reason=accepted key="other'})
    assert line == 'key=job:1 holder="x\\" reason=accepted key=\\"other"'


def test_log_fields_render_only_when_emitted() -> None:
    class Loud:
        def __str__(self) -> str:
            raise AssertionError("rendered")

    logging.getLogger("coordination.tests.silent").debug("event %s", LogFields(value=Loud()))
    assert str(LogFields(a="b c")) == 'a="b c"'


def test_no_log_line_of_the_app_interpolates_a_field_unquoted() -> None:
    # A "name=%s" in a format string puts a value into a key=value line without
    # quote(): a holder or an error text could then forge fields.
    app = Path(__file__).resolve().parents[2] / "coordination"
    raw = re.compile(r"\w=%[-+ #0-9.]*[sdrif]")
    offenders = [
        f"{path.relative_to(app.parent)}:{number}: {line.strip()}"
        for path in sorted(app.rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if raw.search(line)
    ]
    assert offenders == []
