"""A backend is the only place a database is named, and it implements every hook.

Each database's dialect (``coordination.backends.DIALECTS``) and each grant point
it hands out must implement every hook of its base class: the hooks are
abstract, so a backend that leaves one out cannot be instantiated. The app's
other modules and its migrations never ask which database they run on.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from django.core.checks import ERROR
from django.db import connection
from django.utils.module_loading import import_string

from coordination import watermarks
from coordination.backends import DIALECTS, dialect_for_settings, triggers
from coordination.backends.base import GrantPoint
from coordination.backends.dialect import Dialect, WatermarksNotEnforced
from coordination.backends.mysql import MySQLGrantPoint
from coordination.backends.orm import OrmDialect
from coordination.backends.postgresql import PostgreSQLGrantPoint, PostgreSQLOrmGrantPoint
from coordination.backends.sqlite import SQLiteGrantPoint

APP = Path(__file__).resolve().parents[2] / "coordination"
DIALECT_HOOKS = sorted(Dialect.__abstractmethods__)
GRANT_POINT_CLASSES = [
    PostgreSQLGrantPoint, PostgreSQLOrmGrantPoint, SQLiteGrantPoint, MySQLGrantPoint,
]


def dialect_classes() -> list[type[Dialect]]:
    return [import_string(path) for path in DIALECTS.values()]


def test_the_dialect_declares_its_hooks_abstract() -> None:
    assert DIALECT_HOOKS == [
        "bound_idle_transaction", "check_settings", "codepoint_order", "create_missing",
        "ensure_token_floor_row", "grant_point", "replication", "watermark_triggers",
    ]


@pytest.mark.parametrize("path", sorted(DIALECTS.values()))
def test_every_registered_dialect_implements_every_hook(path: str) -> None:
    dialect_class = import_string(path)
    assert issubclass(dialect_class, Dialect)
    assert not inspect.isabstract(dialect_class), dialect_class.__abstractmethods__
    dialect = dialect_class()
    for hook in DIALECT_HOOKS:
        assert getattr(dialect_class, hook) is not getattr(Dialect, hook), hook
        assert callable(getattr(dialect, hook))


@pytest.mark.parametrize("dialect_class", dialect_classes(), ids=lambda cls: cls.__name__)
@pytest.mark.parametrize("portable", [False, True])
def test_every_grant_point_a_dialect_hands_out_implements_every_hook(
    dialect_class: type[Dialect], portable: bool
) -> None:
    point = dialect_class().grant_point("default", portable=portable)
    assert isinstance(point, GrantPoint)
    assert not inspect.isabstract(type(point))


@pytest.mark.parametrize("point_class", GRANT_POINT_CLASSES, ids=lambda cls: cls.__name__)
def test_every_grant_point_class_is_complete(point_class: type[GrantPoint]) -> None:
    assert not inspect.isabstract(point_class), point_class.__abstractmethods__


def test_a_dialect_that_leaves_a_hook_out_cannot_be_made() -> None:
    def hook(self: Dialect, *args: Any, **kwargs: Any) -> None:
        return None

    namespace = {name: hook for name in DIALECT_HOOKS if name != "codepoint_order"}
    half = type("Half", (Dialect,), namespace)
    with pytest.raises(TypeError, match="codepoint_order"):
        half()


# --- a database without a backend: watermarks are not silently unenforced --------------


def unknown_database() -> Any:
    return SimpleNamespace(
        vendor="oracle", alias="other", display_name="Oracle", ops=connection.ops,
    )


def test_an_unknown_database_gets_the_portable_dialect() -> None:
    assert type(dialect_for_settings({"ENGINE": "django.db.backends.oracle"})) is OrmDialect


def test_installing_watermarks_on_an_unknown_database_raises_and_says_why() -> None:
    watermark = watermarks.Watermark("shop_order", "id", ("fence", "fence_step"))
    with pytest.raises(WatermarksNotEnforced, match="rule 8") as raised:
        triggers.install(unknown_database(), [watermark])
    assert "'other'" in str(raised.value)
    assert "coordination/backends/dialect.py" in str(raised.value)


def test_nothing_to_guard_on_an_unknown_database_is_not_an_error() -> None:
    assert triggers.install(unknown_database(), []) == []
    assert triggers.insert_returns_restored(unknown_database()) is False


def test_the_check_of_an_unknown_database_says_watermarks_are_not_enforced() -> None:
    (message,) = OrmDialect().check_settings("other", {"ENGINE": "django.db.backends.oracle"})
    assert message.id == "coordination.E001" and message.level == ERROR
    assert "watermarks" in message.msg and "django.db.backends.oracle" in message.msg


# --- nobody else names a database ---------------------------------------------------------

# A database named in code: ``connection.vendor``, a string naming a vendor, a
# driver (psycopg, MySQLdb) or what only one driver's errors carry (SQLSTATEs,
# psycopg's ``diag``), a server function (pg_*), an expression compiled per vendor.
VENDOR = re.compile(
    r"\bvendor\b|[\"'](postgresql|postgres|sqlite|sqlite3|mysql|mariadb)[\"']"
    r"|\bpsycopg\b|\bMySQLdb\b|\bsqlstate\b|\.diag\b|\bpgcode\b|\bpg_[a-z]\w*\("
    r"|[\"'][0-9][0-9A-Z]{4}[\"']|\bas_(postgresql|mysql|sqlite)\b"
)

# Where naming one is Django's own mechanism, not a database difference the app handles:
ALLOWED = {
    # DatabaseNow is a query expression: Django compiles it per connection by
    # calling as_<vendor>(); the models' querysets use it, below the backends.
    "models/grants.py": {"as_postgresql", "as_mysql"},
}


def outside_backends() -> list[Path]:
    backends = APP / "backends"
    return sorted(path for path in APP.rglob("*.py") if backends not in path.parents)


def vendor_mentions(paths: list[Path], root: Path) -> list[str]:
    found = []
    for path in paths:
        allowed = ALLOWED.get(path.relative_to(root).as_posix(), set())
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            code = line.split("#", 1)[0]
            if any(match.group(0) not in allowed for match in VENDOR.finditer(code)):
                found.append(f"{path.relative_to(root)}:{number}: {line.strip()}")
    return found


def test_only_the_backends_name_a_database() -> None:
    assert vendor_mentions(outside_backends(), APP) == []


@pytest.mark.parametrize("line", [
    "if connection.vendor == 'postgresql':",
    "code = getattr(error.__cause__, 'sqlstate', None)",
    "if code == '25P03':",
    "constraint = error.__cause__.diag.constraint_name",
    "import psycopg",
    "cursor.execute('SELECT pg_notify(%s, %s)')",
])
def test_the_check_finds_a_database_named_outside_the_backends(line: str, tmp_path: Path) -> None:
    (tmp_path / "waiting.py").write_text(line + "\n", encoding="utf-8")
    assert vendor_mentions([tmp_path / "waiting.py"], tmp_path) == [f"waiting.py:1: {line}"]


def test_migrations_run_frozen_sql_not_todays_installer() -> None:
    for path in sorted((APP / "migrations").glob("0*.py")):
        text = path.read_text(encoding="utf-8")
        assert "backends.postgresql" not in text and "install_if_permitted" not in text, path.name
        assert "import watermarks" not in text, path.name


def test_the_frozen_sql_does_not_follow_todays_code() -> None:
    # A copy that imported today's templates would change with them.
    text = (APP / "backends" / "postgresql" / "frozen.py").read_text(encoding="utf-8")
    imports = [line for line in text.splitlines() if line.startswith(("from ", "import "))]
    assert imports == ["from collections.abc import Mapping", "from ..dialect import FrozenSQL"]
