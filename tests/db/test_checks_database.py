"""System checks that read the database: W004 (``check --database``), and the
whole registry on the test site (Django's model checks open a connection on SQLite)."""

from __future__ import annotations

from io import StringIO

import pytest
from django.core.management import call_command
from django.core.management.base import SystemCheckError
from django.db import connection

from coordination import checks, restore
from coordination.models import MAX_TOKEN
from tests.support.factories import LockFactory


def ids(messages: list[object]) -> list[str]:
    return [message.id for message in messages]  # type: ignore[attr-defined]


# --- W004: tokens approaching 2**63 (a database check) ---------------------------


@pytest.mark.django_db
def test_tokens_past_2_pow_62_are_w004() -> None:
    LockFactory(key="busy", token=2**62 + 1)
    LockFactory(key="calm", token=2**62)

    messages = checks.check_token_headroom(databases=["default"])

    assert ids(messages) == ["coordination.W004"]
    assert "'busy'" in messages[0].msg
    assert "'calm'" not in messages[0].msg


@pytest.mark.django_db
def test_a_token_floor_past_2_pow_62_is_w004() -> None:
    restore.raise_floor_to(2**62)
    assert checks.check_token_headroom(databases=["default"]) == []

    restore.raise_floor_to(2**62 + 1)

    messages = checks.check_token_headroom(databases=["default"])
    assert ids(messages) == ["coordination.W004"]
    assert "token floor" in messages[0].msg


@pytest.mark.django_db
def test_token_headroom_runs_only_for_the_databases_asked_for() -> None:
    LockFactory(key="busy", token=MAX_TOKEN - 1)

    assert checks.check_token_headroom(databases=None) == []
    assert checks.check_token_headroom(databases=["other"]) == []


@pytest.mark.django_db
def test_check_with_database_flag_runs_the_token_check() -> None:
    LockFactory(key="busy", token=2**62 + 5)
    out = StringIO()

    call_command("check", "--database", "default", stdout=StringIO(), stderr=out)
    assert "coordination.W004" in out.getvalue()

    plain = StringIO()
    call_command("check", stdout=StringIO(), stderr=plain)
    assert "coordination.W004" not in plain.getvalue()


# Django's own model checks ask SQLite whether it supports JSON: a connection.
@pytest.mark.django_db
def test_registered_checks_pass_on_the_test_site() -> None:
    # The site's own settings must not trip any coordination check.
    try:
        call_command("check", stdout=StringIO(), stderr=StringIO(), fail_level="WARNING")
    except SystemCheckError as error:  # pragma: no cover
        pytest.fail(str(error))
    assert connection.vendor in {"postgresql", "sqlite", "mysql"}
