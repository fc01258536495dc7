"""Counting what a hostile-input suite sent and how the site answered.

:func:`tally_requests` wraps Django's test ``Client.request`` (which DRF's
``APIClient`` goes through too) for the duration of a test module: every
request is counted, with its status, and a request that raised instead of
answering (the test client re-raises a view's exception; a real server would
have answered 500) counts as a 5xx. At the end of the module one summary line
is printed, whatever pytest captures, and the module fails if any 5xx was seen.
:func:`wsgi_request` sends a request through the site's own WSGI application
instead (what a server runs, before Django builds the request) and counts it too.
"""

from __future__ import annotations

import io
import sys
from collections import Counter
from collections.abc import Iterable, Iterator
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

    def record(self, status: int) -> None:
        """Count one request sent some other way than the test client (a WSGI call)."""
        self.requests += 1
        self.by_status[status] += 1

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


#: Every module's tally of this session, for the run's total (tests/conftest.py).
SESSION: list[Tally] = []


def session_summary() -> str | None:
    """One line: the hostile requests of every suite that ran, and the 5xx among them."""
    if not SESSION:
        return None
    requests = sum(tally.requests for tally in SESSION)
    errors = sum(tally.server_errors for tally in SESSION)
    return f"hostile inputs, all {len(SESSION)} suites: {requests} requests; 5xx seen: {errors}"


@pytest.fixture(scope="module")
def tally_requests(request: pytest.FixtureRequest) -> Iterator[Tally]:
    """Count every test-client request of the module; print the summary, fail on any 5xx."""
    tally = Tally(request.module.__name__.rsplit(".", 1)[-1])
    SESSION.append(tally)
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


@dataclass
class WSGIAnswer:
    status: int
    headers: dict[str, str]
    body: bytes


def wsgi_request(
    tally: Tally | None,
    method: str,
    path: str,
    *,
    query: str = "",
    content_type: str = "",
    body: bytes = b"",
    headers: dict[str, str] | None = None,
) -> WSGIAnswer:
    """One request through ``project.wsgi.application``, as a server would send it."""
    from project.wsgi import application

    environ: dict[str, Any] = {
        "REQUEST_METHOD": method.upper(), "PATH_INFO": path, "QUERY_STRING": query,
        "SCRIPT_NAME": "", "SERVER_NAME": "127.0.0.1", "SERVER_PORT": "80",
        "SERVER_PROTOCOL": "HTTP/1.1", "REMOTE_ADDR": "127.0.0.1", "HTTP_HOST": "127.0.0.1",
        "wsgi.version": (1, 0), "wsgi.url_scheme": "http", "wsgi.input": io.BytesIO(body),
        "wsgi.errors": sys.stderr, "wsgi.multithread": False, "wsgi.multiprocess": False,
        "wsgi.run_once": False,
    }
    if content_type:
        environ["CONTENT_TYPE"] = content_type
    if body:
        environ["CONTENT_LENGTH"] = str(len(body))
    for name, value in (headers or {}).items():
        environ["HTTP_" + name.upper().replace("-", "_")] = value
    started: dict[str, Any] = {}

    def start_response(status: str, response_headers: list[tuple[str, str]], exc_info: Any = None) -> None:
        started["status"] = int(status.split(" ", 1)[0])
        started["headers"] = dict(response_headers)

    try:
        chunks: Iterable[bytes] = application(environ, start_response)
        try:
            content = b"".join(chunks)
        finally:
            close = getattr(chunks, "close", None)
            if close is not None:
                close()
    except Exception:  # a server would have answered 500
        if tally is not None:
            tally.requests += 1
            tally.raised += 1
        raise
    if tally is not None:
        tally.record(started["status"])
    return WSGIAnswer(started["status"], started["headers"], content)
