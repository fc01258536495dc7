"""Who may do what: Django permissions per action, so admins grant them to users and groups.

- ``coordination.acquire_lock``: acquire, renew and release locks;
- ``coordination.view_lock`` / ``view_grant`` / ``view_fence`` / ``view_document`` /
  ``view_rejection``: the reads;
- ``coordination.write_document``: fenced writes to the document store.

Renew, release and document writes also need the grant's ``lease_id``; that
proof is checked by :mod:`coordination.locks`, not here.
"""

from __future__ import annotations

from typing import Any

from rest_framework.exceptions import AuthenticationFailed, NotAuthenticated
from rest_framework.permissions import BasePermission
from rest_framework.request import Request
from rest_framework.settings import api_settings
from rest_framework.throttling import AnonRateThrottle, UserRateThrottle
from rest_framework.views import APIView

from ..charsets import refusal_detail, undecodable_charset
from ..conf import app_settings
from .parsers import UnsupportedCharset


class ActionPermission(BasePermission):
    """The Django permission the view names for the request's method.

    Views declare ``required_permissions = {"GET": "coordination.view_lock", ...}``;
    HEAD and OPTIONS need what GET needs. An anonymous request fails here, and DRF
    answers it with 401 (the first authenticator sets ``WWW-Authenticate``).
    """

    message = "You do not have the permission this action needs."

    def has_permission(self, request: Request, view: Any) -> bool:
        user = request.user
        if user is None or not user.is_authenticated:
            return False
        required: dict[str, str] = getattr(view, "required_permissions", {})
        method = "GET" if request.method in {"HEAD", "OPTIONS"} else str(request.method)
        permission = required.get(method)
        if permission is None:
            # A method the view does not serve: let DRF answer 405.
            return True
        if not user.has_perm(permission):
            self.message = f"This action needs the permission {permission!r}."
            return False
        return True


def client_address(request: Any) -> str:
    """The client's address, as the throttles count it: one rule for the API and the site.

    ``REMOTE_ADDR``, unless ``REST_FRAMEWORK["NUM_PROXIES"]`` says how many
    trusted reverse proxies stand in front of the site: then the address that
    many places from the right of ``X-Forwarded-For`` (the one the outermost
    trusted proxy saw), or ``REMOTE_ADDR`` when the header is missing. Without
    the setting (or with 0) the header is ignored: a client writes it as it
    likes, and DRF's own default (the whole header as the identity) let each
    new header value start a fresh count. Accepts a Django ``HttpRequest`` or a
    DRF ``Request``.
    """
    meta = request.META
    remote = str(meta.get("REMOTE_ADDR") or "")
    proxies = api_settings.NUM_PROXIES
    forwarded = meta.get("HTTP_X_FORWARDED_FOR")
    if not proxies or not forwarded:
        return remote
    addresses = [address.strip() for address in str(forwarded).split(",")]
    return addresses[-min(int(proxies), len(addresses))] or remote


class UserThrottle(UserRateThrottle):
    """Requests per user at ``COORDINATION["API_THROTTLE_RATE"]`` (None: unlimited)."""

    scope = "coordination"

    def get_ident(self, request: Request) -> str:
        return client_address(request)

    def get_rate(self) -> str | None:
        rate = app_settings.API_THROTTLE_RATE
        return str(rate) if rate else None


class AnonymousThrottle(AnonRateThrottle):
    """Requests per client address that did not authenticate, at
    ``COORDINATION["API_ANON_THROTTLE_RATE"]`` (None: unlimited).

    DRF checks throttles after authentication and permissions, so a request
    that fails them (no credentials, a wrong token) would never be counted:
    :class:`ThrottledRefusals` (every API view and the schema) counts those
    refusals here, and answers 429 ``throttled`` instead of 401 once the rate
    is spent, so tokens cannot be guessed at the speed of the server. The
    address is :func:`client_address`'s; the counts live in Django's default
    cache, shared between processes only if that cache is.
    """

    scope = "coordination_anonymous"

    def get_ident(self, request: Request) -> str:
        return client_address(request)

    def get_rate(self) -> str | None:
        rate = app_settings.API_ANON_THROTTLE_RATE
        return str(rate) if rate else None


class CharsetChecked(APIView):
    """An API view that refuses, first of all, a charset Django cannot decode text with.

    Content negotiation reads ``request.GET``, which Django decodes with the
    request's charset: ``zlib`` or ``hex`` there would raise before any answer.
    Such a request is ``415 unsupported_charset`` here, before authentication,
    whether or not the site wraps its application in
    :func:`~coordination.charsets.guard_wsgi`.
    """

    def initial(self, request: Request, *args: Any, **kwargs: Any) -> None:
        charset = undecodable_charset(request.META.get("CONTENT_TYPE", ""))
        if charset is not None:
            raise UnsupportedCharset(refusal_detail(charset))
        super().initial(request, *args, **kwargs)


class ThrottledRefusals(CharsetChecked):
    """An API view whose refused authentications spend the :class:`AnonymousThrottle`.

    DRF runs ``initial()``: content negotiation, authentication, permissions,
    then throttles. A request refused before the throttles (401) is counted here
    instead, and answered 429 once its address has spent the rate.
    """

    def initial(self, request: Request, *args: Any, **kwargs: Any) -> None:
        try:
            super().initial(request, *args, **kwargs)
        except (NotAuthenticated, AuthenticationFailed):
            throttle = AnonymousThrottle()
            if not throttle.allow_request(request, self):
                self.throttled(request, throttle.wait() or 1.0)
            raise
