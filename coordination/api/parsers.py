"""Strict JSON input: UTF-8 (or UTF-16/32), bounded size, no NaN or Infinity, no
duplicate keys."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import IO, Any

from rest_framework import status
from rest_framework.exceptions import APIException, ParseError
from rest_framework.parsers import JSONParser

from ..charsets import UNSUPPORTED_CHARSET, api_charset, refusal_detail
from ..conf import app_settings


class RequestTooLarge(APIException):
    status_code = status.HTTP_413_REQUEST_ENTITY_TOO_LARGE
    default_detail = "The request body is too large."
    default_code = "request_too_large"


class UnsupportedCharset(APIException):
    status_code = status.HTTP_415_UNSUPPORTED_MEDIA_TYPE
    default_detail = "The request's charset is not one the API decodes; send UTF-8."
    default_code = UNSUPPORTED_CHARSET


def require_api_charset(request: Any) -> str:
    """The codec to decode ``request``'s body with, or 415 ``unsupported_charset``."""
    try:
        return api_charset(request.META.get("CONTENT_TYPE", ""))
    except ValueError as refused:
        raise UnsupportedCharset(refusal_detail(str(refused))) from None


class StrictJSONParser(JSONParser):
    """JSON bodies of at most ``COORDINATION["API_MAX_BODY_BYTES"]`` bytes.

    DRF reads the body straight from the request stream, past Django's
    ``DATA_UPLOAD_MAX_MEMORY_SIZE`` check, so the limit is enforced here, on the
    declared length and on the bytes actually read (a chunked body has none).
    The body is decoded only with one of the API's charsets
    (:data:`coordination.charsets.API_CHARSETS`), checked before a byte is read:
    no codec that decompresses or transforms ever sees it.
    """

    def parse(
        self,
        stream: IO[Any],
        media_type: str | None = None,
        parser_context: Mapping[str, Any] | None = None,
    ) -> Any:
        limit = int(app_settings.API_MAX_BODY_BYTES)
        request = (parser_context or {}).get("request")
        encoding = require_api_charset(request) if request is not None else "utf-8"
        declared = request.META.get("CONTENT_LENGTH") if request is not None else None
        if declared and str(declared).isdigit() and int(declared) > limit:
            raise _too_large(limit)
        raw = stream.read(limit + 1)
        if len(raw) > limit:
            raise _too_large(limit)
        try:
            text = raw.decode(encoding)
            return json.loads(text, parse_constant=_refuse_constant, object_pairs_hook=_unique_keys)
        except UnicodeDecodeError as error:
            raise ParseError(f"The request body is not valid {encoding}: {error}") from None
        except ValueError as error:
            raise ParseError(f"Malformed JSON: {error}") from None
        except RecursionError:
            raise ParseError("Malformed JSON: nested too deeply") from None


def _too_large(limit: int) -> RequestTooLarge:
    return RequestTooLarge(f"The request body is larger than {limit} bytes.")


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise ValueError(f"duplicate key {key!r}")
        result[key] = value
    return result
