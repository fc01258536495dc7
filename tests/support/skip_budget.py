"""The skip budget: a leg fails when a test skips for a reason the leg does not expect.

A skip is silent: a missing server, a renamed binary or a stray
``pytest.skip`` turns a test into a yellow ``s`` and the leg stays green. On
a run that requires every service (``CI=true``, or bin/test's
``COORDINATION_REQUIRE_SERVICES=1``: :func:`tests.support.legs.services_required`)
every skip's reason is read and checked against the leg's list
(:func:`tests.support.legs.expected_skip`); one that is not on it makes the
leg fail (exit status 1, even when every test passed), and the summary names
the tests. Every run prints its skips counted by reason.

tests/conftest.py registers :class:`SkipBudget` for the suite.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import pytest


def skip_reason(report: pytest.TestReport | pytest.CollectReport) -> str | None:
    """The reason a report was skipped for, or None if it was not skipped (an
    expected failure, xfail, is not a skip)."""
    if not report.skipped or hasattr(report, "wasxfail"):
        return None
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


class SkipBudget:
    """Counts the run's skips by reason; with ``enforce``, fails the run when
    one of them is not expected on the leg.

    ``leg`` and ``expected`` are called only when the run ends (the leg is read
    from the configured database, which a plugin registered early must not
    touch); ``expected(leg, reason)`` says whether that skip is the leg's
    design."""

    def __init__(self, leg: Callable[[], str], expected: Callable[[str, str], bool],
                 enforce: bool) -> None:
        self._leg = leg
        self._expected = expected
        self._enforce = enforce
        self.skips: list[tuple[str, str]] = []  # (node id, reason)
        self.unexpected: list[tuple[str, str]] = []
        self.leg = ""

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        reason = skip_reason(report)
        if reason is not None:
            self.skips.append((report.nodeid, reason))

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        # A whole module skipped (pytest.skip(allow_module_level=True), importorskip).
        reason = skip_reason(report)
        if reason is not None:
            self.skips.append((report.nodeid, reason))

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if not self.skips:
            return
        self.leg = self._leg()
        self.unexpected = [(node, reason) for node, reason in self.skips
                           if not self._expected(self.leg, reason)]
        if self._enforce and self.unexpected and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        if not self.skips:
            return
        write = terminalreporter.write_line
        terminalreporter.section(f"skips on the {self.leg} leg, by reason")
        unexpected = {reason for _, reason in self.unexpected}
        counts = Counter(reason for _, reason in self.skips)
        for reason, count in sorted(counts.items(), key=lambda item: (-item[1], item[0])):
            mark = "UNEXPECTED " if reason in unexpected else ""
            write(f"{count:5d}  {mark}{reason}")
        if not self.unexpected:
            return
        if self._enforce:
            write(f"the {self.leg} leg FAILS: {len(self.unexpected)} test(s) skipped for a reason "
                  "this leg does not expect (tests/support/legs.py: expected_skip), and this run "
                  "requires every service (CI=true or COORDINATION_REQUIRE_SERVICES=1):", red=True)
        else:
            write(f"{len(self.unexpected)} test(s) skipped for a reason this leg does not expect "
                  "(CI=true would fail the leg):", yellow=True)
        for node, reason in self.unexpected:
            write(f"  {node}: {reason}")
