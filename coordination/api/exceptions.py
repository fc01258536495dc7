"""One error shape for every API response: ``{"code": ..., "detail": ..., ...}``.

Coordination errors keep their own ``code`` and extra fields (``holder``,
``expires_at``, ``retry_after``, ``current_token`` ...). DRF's errors get the
stable codes below; validation errors add ``errors``, the messages per field.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from django.core.exceptions import PermissionDenied as DjangoPermissionDenied
from django.http import Http404
from rest_framework import exceptions
from rest_framework.response import Response
from rest_framework.settings import api_settings

from ..exceptions import CoordinationError, InvalidInput, LockHeld

__all__ = ["error_body", "exception_handler"]

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

    Returns None (a server error) only for exceptions that are not refusals.
    """
    if isinstance(exc, CoordinationError):
        return _coordination_response(exc)
    if isinstance(exc, Http404):
        exc = exceptions.NotFound()
    elif isinstance(exc, DjangoPermissionDenied):
        exc = exceptions.PermissionDenied()
    if not isinstance(exc, exceptions.APIException):
        return None
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


def error_body(exc: exceptions.APIException) -> dict[str, Any]:
    code = next((code for cls, code in CODES if isinstance(exc, cls)), None)
    if code is None:
        code = str(exc.default_code)
    if isinstance(exc, exceptions.ValidationError):
        errors = _field_errors(exc.detail)
        return {"code": code, "detail": _summary(errors), "errors": errors}
    return {"code": code, "detail": str(exc.detail)}


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
            "non_field_errors" if name == site_key else str(name): _messages(value)
            for name, value in detail.items()
        }
    return {"non_field_errors": _messages(detail)}


def _messages(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(name): _messages(inner) for name, inner in value.items()}
    if isinstance(value, list):
        return [_messages(item) for item in value]
    return str(value)


def _summary(errors: Mapping[str, Any]) -> str:
    parts = []
    for name, messages in errors.items():
        first = messages
        while isinstance(first, list | dict) and first:
            first = first[0] if isinstance(first, list) else next(iter(first.values()))
        parts.append(f"{name}: {first}" if name != "non_field_errors" else str(first))
    return "Invalid input: " + "; ".join(parts) if parts else "Invalid input."
