"""What ``@fenced_task`` checks when a task is declared, and how it is typed.

A lock template naming an argument the function does not take would fail
every execution in the worker; it is refused at import instead. The refused
late writes a fenced task raises are Celery's expected exceptions (logged at
INFO without a traceback). ``.delay()`` is typed over the function's
parameters, so mypy finds a wrong call.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from coordination.contrib.celery import REFUSALS, fenced_task
from coordination.exceptions import InvalidInput, StaleToken

REPO = Path(__file__).resolve().parents[2]


def test_a_template_naming_a_missing_argument_is_refused_at_declaration() -> None:
    with pytest.raises(InvalidInput) as refused:
        @fenced_task(lock="order:{orderid}", name="tests.declaration.misspelt")
        def settle(order_id: int) -> None: ...
    message = str(refused.value)
    assert "{orderid}" in message and "order_id" in message and "settle" in message


def test_a_task_declared_with_key_instead_of_lock_is_told_to_write_lock() -> None:
    with pytest.raises(InvalidInput) as refused:
        @fenced_task(key="report:{customer_id}", name="tests.declaration.key")  # type: ignore[call-overload]
        def build_report(customer_id: int) -> None: ...
    assert "key= is not one of its options, write lock='report:{customer_id}'" in str(refused.value)

    with pytest.raises(InvalidInput, match=r"fenced_task needs lock=\.\.\."):
        @fenced_task(name="tests.declaration.nolock")  # type: ignore[call-overload]
        def nothing(customer_id: int) -> None: ...


def test_a_bound_task_cannot_name_itself_and_kwargs_or_callables_pass() -> None:
    with pytest.raises(InvalidInput, match=r"names \{self\}"):
        @fenced_task(lock="order:{self}", bind=True, name="tests.declaration.self")
        def bound(self: Any, order_id: int) -> None: ...

    @fenced_task(lock="order:{order_id}", bind=True, name="tests.declaration.bound")
    def fine(self: Any, order_id: int) -> None: ...

    @fenced_task(lock="order:{order_id}", name="tests.declaration.kwargs")
    def by_name(**kwargs: Any) -> None: ...

    @fenced_task(lock=lambda order_id: f"order:{order_id}", name="tests.declaration.callable")
    def by_callable(order_id: int) -> None: ...

    assert fine.lock_key((7,)) == "order:7"
    assert by_name.lock_key((), {"order_id": 8}) == "order:8"


def test_refused_late_writes_are_celerys_expected_exceptions_unless_asked() -> None:
    @fenced_task(lock="order:{order_id}", name="tests.declaration.expected")
    def quiet(order_id: int) -> None: ...

    @fenced_task(lock="order:{order_id}", throws=(), name="tests.declaration.loud")
    def loud(order_id: int) -> None: ...

    assert StaleToken in quiet.throws and quiet.throws == REFUSALS
    assert loud.throws == ()


TYPED = """
from coordination.contrib.celery import fenced_task

@fenced_task(lock="order:{order_id}")
def settle(order_id: int) -> int:
    return order_id

settle.delay(1)
settle.delay("one")
"""


@pytest.mark.legs("pg", reason="mypy and the stubs are the main leg's tools (requirements/test.txt)")
def test_delay_is_typed_over_the_functions_parameters(tmp_path: Path) -> None:
    snippet = tmp_path / "typed_tasks.py"
    snippet.write_text(textwrap.dedent(TYPED), encoding="utf-8")
    checked = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(REPO / "pyproject.toml"),
         "--no-error-summary", str(snippet)],
        cwd=REPO, capture_output=True, text=True, timeout=600, check=False,
    )
    errors = [line for line in checked.stdout.splitlines() if ": error:" in line]
    assert len(errors) == 1, checked.stdout + checked.stderr
    assert "typed_tasks.py:9:" in errors[0] and '"delay"' in errors[0], errors
