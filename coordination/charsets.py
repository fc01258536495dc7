"""Request charsets: which a request may name, and guards that refuse the rest.

A request's ``Content-Type`` may name any ``charset``, and Django takes every
name Python's codec registry knows as the request's encoding. That registry
also holds codecs that are not text encodings at all (``zlib``, ``bz2``,
``base64``, ``hex``, ``rot13``...). With one of them Django fails with
``LookupError`` as soon as it decodes the query string (while it *builds* the
request, before any middleware runs) or a form body: a 500 before any login.
A parser that decoded a body with :func:`codecs.decode` would even
*decompress* it, far past any body size limit.

- :func:`undecodable_charset` names such a charset: one Django cannot decode
  text with. :func:`guard_wsgi` and :func:`guard_asgi` wrap a site's
  application so that every such request is answered ``415
  unsupported_charset`` before Django sees it (the only place early enough);
  under the coordination API in the API's JSON error shape, elsewhere as plain
  text. The API's own views refuse such a charset too, first of all, for sites
  that do not wrap their application.
- :data:`API_CHARSETS` are the only encodings the API decodes a JSON body
  with (UTF-8, and the UTF-16 and UTF-32 that JSON's first RFC allowed); the
  API refuses any other with the same 415, before it reads the body.
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from django.urls import Resolver404, resolve
from django.utils.http import parse_header_parameters

__all__ = [
    "API_CHARSETS",
    "UNSUPPORTED_CHARSET",
    "api_charset",
    "charset_of",
    "guard_asgi",
    "guard_wsgi",
    "refusal_detail",
    "undecodable_charset",
]

UNSUPPORTED_CHARSET = "unsupported_charset"
"""The stable code of a refused charset, in every answer that refuses one."""

API_CHARSETS = frozenset(
    {"utf-8", "ascii", "utf-16", "utf-16-le", "utf-16-be", "utf-32", "utf-32-le", "utf-32-be"}
)
"""Codec names (as :func:`codecs.lookup` spells them) the API decodes JSON bodies with."""

_TEXT_PLAIN = "text/plain; charset=utf-8"


def charset_of(content_type: str) -> str | None:
    """The ``charset`` parameter of a ``Content-Type`` value, as sent, or None."""
    _, params = parse_header_parameters(content_type)
    charset = params.get("charset")
    return charset.strip() if charset is not None else None


def undecodable_charset(content_type: str) -> str | None:
    """The charset ``content_type`` names if Django cannot decode text with it, else None.

    That is a name the codec registry knows but that is no text encoding
    (``zlib``, ``bz2``, ``hex``...). An unknown name is not one: Django ignores
    it and decodes with ``DEFAULT_CHARSET``.
    """
    charset = charset_of(content_type)
    if charset is None:
        return None
    try:
        codec = codecs.lookup(charset)
    except LookupError:
        return None
    return None if codec._is_text_encoding else charset


def api_charset(content_type: str) -> str:
    """The codec the API decodes a JSON body of ``content_type`` with (UTF-8 when
    it names none); ``ValueError`` naming the charset when it is not one of
    :data:`API_CHARSETS`."""
    charset = charset_of(content_type)
    if charset is None:
        return "utf-8"
    try:
        name = codecs.lookup(charset).name
    except LookupError:
        name = ""
    if name not in API_CHARSETS:
        raise ValueError(charset)
    return name


def refusal_detail(charset: str) -> str:
    """What a refusal of ``charset`` says (the name cut to 40 characters)."""
    return (
        f"The request names charset {charset[:40]!r}, which this site does not decode text "
        "with; send UTF-8 (charset=utf-8, or no charset)."
    )


def _refusal(charset: str, path: str) -> tuple[bytes, str]:
    """The body and content type of the 415 for ``charset`` at ``path``."""
    detail = refusal_detail(charset)
    if _under_api(path):
        body = {"code": UNSUPPORTED_CHARSET, "detail": detail}
        return json.dumps(body, separators=(",", ":")).encode(), "application/json"
    return (detail + "\n").encode(), _TEXT_PLAIN


def _under_api(path: str) -> bool:
    """Whether ``path`` (without the script prefix) is one of the coordination API's."""
    try:
        match = resolve(path)
    except Resolver404:
        return False
    module = getattr(match.func, "__module__", "") or ""
    return "coordination_api" in match.namespaces or module.startswith("coordination.api.")


WSGIApplication = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


def guard_wsgi(application: WSGIApplication) -> WSGIApplication:
    """``application`` behind a refusal of charsets Django cannot decode text with::

        application = guard_wsgi(get_wsgi_application())   # the site's wsgi.py
    """

    def guarded(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        charset = undecodable_charset(environ.get("CONTENT_TYPE", ""))
        if charset is None:
            return application(environ, start_response)
        body, content_type = _refusal(charset, environ.get("PATH_INFO", "/") or "/")
        start_response(
            "415 Unsupported Media Type",
            [("Content-Type", content_type), ("Content-Length", str(len(body)))],
        )
        return [body]

    return guarded


ASGIApplication = Callable[..., Awaitable[None]]


def guard_asgi(application: ASGIApplication) -> ASGIApplication:
    """:func:`guard_wsgi` for an ASGI application (``guard_asgi(get_asgi_application())``)."""

    async def guarded(
        scope: dict[str, Any],
        receive: Callable[[], Awaitable[Any]],
        send: Callable[[dict[str, Any]], Awaitable[None]],
    ) -> None:
        if scope.get("type") != "http":
            await application(scope, receive, send)
            return
        content_type = b""
        for name, value in scope.get("headers", ()):
            if name.lower() == b"content-type":
                content_type = value
        charset = undecodable_charset(content_type.decode("latin-1"))
        if charset is None:
            await application(scope, receive, send)
            return
        root = scope.get("root_path", "")
        path = scope.get("path", "/")
        body, media_type = _refusal(charset, path.removeprefix(root) or "/")
        await send({
            "type": "http.response.start", "status": 415,
            "headers": [
                (b"content-type", media_type.encode()), (b"content-length", str(len(body)).encode())
            ],
        })
        await send({"type": "http.response.body", "body": body})

    return guarded
