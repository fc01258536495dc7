"""Counting what a hostile-input suite sent and how the site answered.

:func:`tally_requests` wraps Django's test ``Client.request`` (which DRF's
``APIClient`` goes through too) for the duration of a test module: every
request is counted, with its status, and a request that raised instead of
answering (the test client re-raises a view's exception; a real server would
have answered 500) counts as a 5xx. At the end of the module one summary line
is printed, whatever pytest captures, and the module fails if any 5xx was seen.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from django.test.client import Client


@dataclass
class Tally:
    """Requests sent and answers seen, by status class."""

    name: str
    requests: int = 0
    by_status: Counter[int] = field(default_factory=Counter)
    raised: int = 0

    @property
    def server_errors(self) -> int:
        return self.raised + sum(n for status, n in self.by_status.items() if status >= 500)

    def summary(self) -> str:
        classes = Counter[str]()
        for status, count in self.by_status.items():
            classes[f"{status // 100}xx"] += count
        answered = ", ".join(f"{count} {name}" for name, count in sorted(classes.items()))
        return (
            f"hostile inputs ({self.name}): {self.requests} requests; answers: {answered or 'none'}; "
            f"5xx seen: {self.server_errors}"
        )


@pytest.fixture(scope="module")
def tally_requests(request: pytest.FixtureRequest) -> Iterator[Tally]:
    """Count every test-client request of the module; print the summary, fail on any 5xx."""
    tally = Tally(request.module.__name__.rsplit(".", 1)[-1])
    original = Client.request

    def counted(self: Client, **kwargs: Any) -> Any:
        tally.requests += 1
        try:
            response = original(self, **kwargs)
        except Exception:
            tally.raised += 1
            raise
        tally.by_status[response.status_code] += 1
        return response

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Client, "request", counted)
        yield tally
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    if reporter is not None and capture is not None:
        with capture.global_and_fixture_disabled():  # shown even when output is captured
            reporter.write_line("")
            reporter.write_line(tally.summary())
    assert tally.server_errors == 0, tally.summary()
