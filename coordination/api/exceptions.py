"""One error shape for every API response: ``{"code": ..., "detail": ..., ...}``.

Coordination errors keep their own ``code`` and extra fields (``holder``,
``expires_at``, ``retry_after``, ``current_token`` ...). DRF's errors get the
stable codes below; validation errors add ``errors``, the messages per field.

An error response is bounded whatever the request: at most
:data:`MAX_FIELD_ERRORS` fields in ``errors`` (then ``errors_omitted`` says
how many more there were), field names and messages cut at
:data:`MAX_TEXT`, nested messages at :data:`MAX_MESSAGES` per list and
:data:`MAX_DEPTH` levels. A body of 60,000 unknown fields is answered in
about two kilobytes, not megabytes.

A body over Django's own limits (``DATA_UPLOAD_MAX_MEMORY_SIZE``,
``DATA_UPLOAD_MAX_NUMBER_FIELDS``, ``DATA_UPLOAD_MAX_NUMBER_FILES``), met when a
form body is read (the CSRF check of a session request reads it), is
``413 request_too_large`` like a JSON body over ``API_MAX_BODY_BYTES``, never
Django's HTML 400 page.

An error that is not a refusal (a bug, a database gone away) is ``500
server_error`` in the same shape, logged with its traceback on
``django.request`` and announced by ``got_request_exception`` as Django does
for its own 500 page (error reporters hook in there); the request's
transaction, if any, is rolled back. With ``DEBUG`` on, Django's debug
answer is kept.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any

from django.conf import settings
from django.core.exceptions import PermissionDenied as DjangoPermissionDenied
from django.core.exceptions import RequestDataTooBig, TooManyFieldsSent, TooManyFilesSent
from django.core.signals import got_request_exception
from django.http import Http404
from rest_framework import exceptions
from rest_framework.response import Response
from rest_framework.settings import api_settings
from rest_framework.views import set_rollback

from ..exceptions import CoordinationError, InvalidInput, LockHeld
from .parsers import RequestTooLarge

__all__ = ["MAX_FIELD_ERRORS", "RequestTooLarge", "error_body", "exception_handler"]

MAX_FIELD_ERRORS = 20
"""Fields an ``invalid`` answer lists in ``errors``; ``errors_omitted`` counts the rest."""
MAX_TEXT = 200
"""Characters of a field name or message shown; longer ones end in an ellipsis."""
MAX_MESSAGES = 5
"""Items of a list of messages shown (a list field's errors per item)."""
MAX_DEPTH = 4
"""Levels of nested messages shown (an object field's errors per key)."""


# Django's own upload limits, raised when a form body is read.
DJANGO_LIMITS = (RequestDataTooBig, TooManyFieldsSent, TooManyFilesSent)

# DRF exception class -> the stable code clients see.
CODES: list[tuple[type[exceptions.APIException], str]] = [
    (exceptions.ValidationError, "invalid"),
    (exceptions.NotAuthenticated, "not_authenticated"),
    (exceptions.AuthenticationFailed, "not_authenticated"),
    (exceptions.PermissionDenied, "permission_denied"),
    (exceptions.NotFound, "not_found"),
    (exceptions.MethodNotAllowed, "method_not_allowed"),
    (exceptions.NotAcceptable, "not_acceptable"),
    (exceptions.UnsupportedMediaType, "unsupported_media_type"),
    (exceptions.Throttled, "throttled"),
    (exceptions.ParseError, "parse_error"),
]


def exception_handler(exc: Exception, context: Mapping[str, Any]) -> Response | None:
    """DRF ``EXCEPTION_HANDLER``: every refusal as ``{"code", "detail", ...}``.

    An exception that is not a refusal is a ``500 server_error`` (see the
    module's docstring); with ``DEBUG`` on it returns None, so Django answers.
    """
    if isinstance(exc, CoordinationError):
        return _coordination_response(exc)
    if isinstance(exc, DJANGO_LIMITS):
        exc = RequestTooLarge(f"The request is over the site's limits: {exc}")
    elif isinstance(exc, Http404):
        exc = exceptions.NotFound()
    elif isinstance(exc, DjangoPermissionDenied):
        exc = exceptions.PermissionDenied()
    if not isinstance(exc, exceptions.APIException):
        return _server_error(exc, context)
    headers: dict[str, str] = {}
    auth_header = getattr(exc, "auth_header", None)
    if auth_header:
        headers["WWW-Authenticate"] = auth_header
    body = error_body(exc)
    wait = getattr(exc, "wait", None)
    if isinstance(exc, exceptions.Throttled) and wait is not None:
        headers["Retry-After"] = str(math.ceil(wait))
        body["retry_after"] = math.ceil(wait)
    return Response(body, status=exc.status_code, headers=headers)


def _server_error(exc: Exception, context: Mapping[str, Any]) -> Response | None:
    if settings.DEBUG:
        return None
    request = context.get("request")
    django_request = getattr(request, "_request", request)
    set_rollback()
    # What Django's handler does before its own 500 page: error reporters listen
    # to the signal, and the log record carries the traceback. The response is
    # marked logged so Django does not log it a second time without one.
    got_request_exception.send(sender=None, request=django_request)
    path = getattr(django_request, "path", "?")
    logging.getLogger("django.request").error(
        "Internal Server Error: %s", path, exc_info=(type(exc), exc, exc.__traceback__),
        extra={"status_code": 500, "request": django_request},
    )
    response = Response(
        {"code": "server_error", "detail": "The server failed to answer; the error is in its logs."},
        status=500,
    )
    response._has_been_logged = True  # type: ignore[attr-defined]
    return response


def error_body(exc: exceptions.APIException) -> dict[str, Any]:
    code = next((code for cls, code in CODES if isinstance(exc, cls)), None)
    if code is None:
        code = str(exc.default_code)
    if isinstance(exc, exceptions.ValidationError):
        errors = _field_errors(exc.detail)
        shown = dict(list(errors.items())[:MAX_FIELD_ERRORS])
        body: dict[str, Any] = {"code": code, "detail": _summary(shown), "errors": shown}
        omitted = len(errors) - len(shown)
        if omitted:
            body["errors_omitted"] = omitted
            body["detail"] += f" ({omitted} more fields not listed)"
        return body
    return {"code": code, "detail": _cut(str(exc.detail), 4 * MAX_TEXT)}


def _coordination_response(exc: CoordinationError) -> Response:
    body = exc.as_dict()
    headers: dict[str, str] = {}
    if isinstance(exc, InvalidInput):
        body.setdefault("errors", {"non_field_errors": [exc.detail]})
    if isinstance(exc, LockHeld):
        headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after)))
    return Response(body, status=exc.status_code, headers=headers)


def _field_errors(detail: Any) -> dict[str, Any]:
    if isinstance(detail, Mapping):
        # DRF files errors about the whole body under the site's NON_FIELD_ERRORS_KEY;
        # this API documents them as "non_field_errors" in every site.
        site_key = api_settings.NON_FIELD_ERRORS_KEY
        return {
            "non_field_errors" if name == site_key else _cut(str(name)): _messages(value)
            for name, value in detail.items()
        }
    return {"non_field_errors": _messages(detail)}


def _messages(value: Any, depth: int = 0) -> Any:
    """The messages of one field, bounded in length, count and depth."""
    if depth >= MAX_DEPTH and isinstance(value, Mapping | list):
        return ["(nested errors not shown)"]
    if isinstance(value, Mapping):
        items = list(value.items())
        shown = {_cut(str(name)): _messages(inner, depth + 1) for name, inner in items[:MAX_MESSAGES]}
        if len(items) > MAX_MESSAGES:
            shown["..."] = [f"{len(items) - MAX_MESSAGES} more not shown"]
        return shown
    if isinstance(value, list):
        listed = [_messages(item, depth + 1) for item in value[:MAX_MESSAGES]]
        if len(value) > MAX_MESSAGES:
            listed.append(f"{len(value) - MAX_MESSAGES} more not shown")
        return listed
    return _cut(str(value))


def _cut(text: str, limit: int = MAX_TEXT) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "\u2026"


def _summary(errors: Mapping[str, Any]) -> str:
    parts = []
    for name, messages in errors.items():
        first = messages
        while isinstance(first, list | dict) and first:
            first = first[0] if isinstance(first, list) else next(iter(first.values()))
        parts.append(f"{name}: {first}" if name != "non_field_errors" else str(first))
    return "Invalid input: " + "; ".join(parts) if parts else "Invalid input."
