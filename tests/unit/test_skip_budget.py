"""The skip budget fails a leg on a skip it does not expect, and only where every
service is required; every run prints its skips by reason.

Each case runs pytest (in this process) on a small test file, with the
suite's plugin (tests/support/skip_budget.py) and the legs' real list of
expected reasons (tests/support/legs.py).
"""

from __future__ import annotations

import pytest

pytest_plugins = ["pytester"]
pytestmark = pytest.mark.legs("pg", reason="the plugin reads pytest's reports, the same on every leg")

CONFTEST = """
from tests.support.legs import expected_skip
from tests.support.skip_budget import SkipBudget

def pytest_configure(config):
    config.pluginmanager.register(SkipBudget(lambda: {leg!r}, expected_skip, enforce={enforce}))
"""

TESTS = """
import pytest

def test_runs():
    pass

@pytest.mark.skip(reason="runs on the pg leg only: once is enough")
def test_for_another_leg():
    pass

@pytest.mark.xfail(reason="a known bug", strict=True)
def test_known_bug():
    assert False
"""

REDIS_MISSING = """

def test_needs_redis():
    pytest.skip("Redis is missing")
"""


def run(pytester: pytest.Pytester, leg: str, enforce: bool, tests: str) -> pytest.RunResult:
    pytester.makeconftest(CONFTEST.format(leg=leg, enforce=enforce))
    pytester.makepyfile(test_leg=tests)
    return pytester.runpytest_inprocess("-p", "no:django", "-p", "no:cacheprovider")


def test_an_unexpected_skip_fails_the_leg_where_services_are_required(pytester: pytest.Pytester) -> None:
    result = run(pytester, "sqlite", enforce=True, tests=TESTS + REDIS_MISSING)

    result.assert_outcomes(passed=1, skipped=2, xfailed=1)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines([
        "*skips on the sqlite leg, by reason*",
        "    1  UNEXPECTED Redis is missing",
        "    1  runs on the pg leg only: once is enough",
        "the sqlite leg FAILS: 1 test(s) skipped for a reason this leg does not expect*",
        "  test_leg.py::test_needs_redis: Redis is missing",
    ])


def test_skips_the_leg_expects_pass(pytester: pytest.Pytester) -> None:
    result = run(pytester, "sqlite", enforce=True, tests=TESTS + """

@pytest.mark.skip(reason="PostgreSQL-only behaviour; this leg is not PostgreSQL")
def test_row_locks():
    pass
""")

    result.assert_outcomes(passed=1, skipped=2, xfailed=1)
    assert result.ret == pytest.ExitCode.OK
    result.stdout.fnmatch_lines(["*skips on the sqlite leg, by reason*"])
    result.stdout.no_fnmatch_line("*UNEXPECTED*")


def test_a_test_skipped_on_a_leg_it_names_is_unexpected(pytester: pytest.Pytester) -> None:
    result = run(pytester, "pg", enforce=True, tests=TESTS)

    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["*UNEXPECTED runs on the pg leg only: once is enough"])


def test_without_required_services_an_unexpected_skip_is_reported_not_failed(
    pytester: pytest.Pytester,
) -> None:
    result = run(pytester, "sqlite", enforce=False, tests=TESTS + REDIS_MISSING)

    assert result.ret == pytest.ExitCode.OK
    result.stdout.fnmatch_lines([
        "    1  UNEXPECTED Redis is missing",
        "1 test(s) skipped for a reason this leg does not expect (CI=true would fail the leg):",
    ])
