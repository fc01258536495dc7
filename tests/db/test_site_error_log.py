"""With DEBUG off, every 500 the site answers is logged once, with its traceback,
where the site's LOGGING sends ``django.request`` errors (its console)."""

from __future__ import annotations

import io
import logging
from collections.abc import Iterator
from typing import Any

import pytest
from django.test import Client

from coordination.api import views as api_views
from tests.support.api_support import full_client

pytestmark = pytest.mark.django_db


@pytest.fixture
def error_log(settings: Any) -> Iterator[io.StringIO]:
    """What the site's handlers of ``django.request`` write, with DEBUG off."""
    settings.DEBUG = False
    written = io.StringIO()
    handlers = [
        handler for handler in logging.getLogger("django.request").handlers
        if isinstance(handler, logging.StreamHandler)
    ]
    assert handlers, "the site's LOGGING gives django.request no handler of its own"
    saved = [handler.setStream(written) for handler in handlers]
    try:
        yield written
    finally:
        for handler, stream in zip(handlers, saved, strict=True):
            handler.setStream(stream)


def fail(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("a bug, on purpose")


def test_an_api_500_is_logged_once_with_its_traceback(
    error_log: io.StringIO, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(api_views.LockListView, "get_queryset", fail)
    client = full_client()
    client.raise_request_exception = False

    assert client.get("/api/locks/").status_code == 500

    text = error_log.getvalue()
    assert text.count("Internal Server Error: /api/locks/") == 1, text
    assert "Traceback (most recent call last)" in text and "RuntimeError: a bug, on purpose" in text


def test_a_page_500_is_logged_once_with_its_traceback(
    error_log: io.StringIO, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("django.contrib.admin.sites.AdminSite.login", fail)
    client = Client(raise_request_exception=False)

    assert client.get("/admin/login/").status_code == 500

    text = error_log.getvalue()
    assert text.count("Internal Server Error: /admin/login/") == 1, text
    assert "RuntimeError: a bug, on purpose" in text


def test_refusals_are_not_logged_as_errors(error_log: io.StringIO) -> None:
    assert Client().get("/api/locks/").status_code == 401
    assert Client().get("/no-such-page").status_code == 404
    assert error_log.getvalue() == ""
