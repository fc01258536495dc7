"""The site's admin login, throttled after repeated failures.

Throttling the admin login is the site's concern (the app's REST API throttles
its own clients): after ``settings.ADMIN_LOGIN_FAILURES`` failed logins from one
client address, or for one user name, within ``settings.ADMIN_LOGIN_WINDOW``
seconds, a login POST answers ``429 Too Many Requests`` with ``Retry-After``,
without checking the password, until the window of the first failure ends. A
successful login clears its user name's count. The GET of the login page is
never refused.

The counts live in Django's default cache, keyed by the client address and by
a hash of the user name as the login form authenticates it (NFKC-normalized,
case-folded): several server processes count together only if that cache is
shared (Redis, Memcached, the database cache). The client address is the one
the REST API's throttles use (``coordination.api.permissions.client_address``):
``REMOTE_ADDR``, or with ``REST_FRAMEWORK["NUM_PROXIES"]`` (the site's
``DJANGO_NUM_PROXIES``) the address the trusted proxies put in
``X-Forwarded-For``. Behind a proxy without that setting every client shares
the proxy's address, so the address count throttles everyone at once.

django-axes does this too, with lockout records in the database; it does not
declare support for Django 6.1 yet, so the site keeps this small view instead.
"""

from __future__ import annotations

import hashlib
import time
from typing import Any

from django.conf import settings
from django.contrib import admin
from django.contrib.auth import get_user_model
from django.core.cache import cache
from django.http import HttpRequest, HttpResponse
from django.views.decorators.cache import never_cache
from django.views.decorators.csrf import csrf_protect

from coordination.api.permissions import client_address

__all__ = ["admin_login", "failure_keys", "login_name"]

_PREFIX = "project.admin-login-failures"


def failure_keys(request: HttpRequest, username: str) -> list[str]:
    """The cache keys counting failures of this client address and this user name."""
    address = client_address(request)
    name = hashlib.sha256(login_name(username).encode()).hexdigest()
    return [f"{_PREFIX}:address:{address}", f"{_PREFIX}:name:{name}"]


def login_name(username: str) -> str:
    """The user name as the login form authenticates it, case-folded: one count per user.

    The form strips the name and NFKC-normalizes it (``normalize_username``), so
    the fullwidth letters of ``ops2`` log in as ``ops2``; counting the raw text
    would give each compatibility form of a name a fresh count of failures.
    """
    return get_user_model().normalize_username(username.strip()).strip().casefold()


def _retry_after(keys: list[str]) -> int | None:
    """Seconds until the login may be tried again, or None if it may be now."""
    limit = int(settings.ADMIN_LOGIN_FAILURES)
    now = time.time()
    waits = [
        int(entry[1] - now) + 1
        for entry in cache.get_many(keys).values()
        if isinstance(entry, tuple) and entry[0] >= limit and entry[1] > now
    ]
    return max(waits) if waits else None


def _count_failure(keys: list[str]) -> None:
    window = int(settings.ADMIN_LOGIN_WINDOW)
    now = time.time()
    for key in keys:
        # (failures, end of the window opened by the first of them)
        count, until = cache.get(key) or (0, now + window)
        cache.set(key, (count + 1, until), timeout=max(1, int(until - now) + 1))


@csrf_protect
@never_cache
def admin_login(request: HttpRequest, extra_context: dict[str, Any] | None = None) -> HttpResponse:
    """``admin.site.login``, refused with 429 after too many failures (see the module)."""
    if request.method != "POST":
        return admin.site.login(request, extra_context)
    keys = failure_keys(request, str(request.POST.get("username", "")))
    wait = _retry_after(keys)
    if wait is not None:
        response = HttpResponse(
            f"Too many failed logins. Try again in {wait} seconds.\n",
            status=429, content_type="text/plain; charset=utf-8",
        )
        response["Retry-After"] = str(wait)
        return response
    response = admin.site.login(request, extra_context)
    if response.status_code == 200:
        # The form again: wrong credentials, or a user who may not use the admin.
        _count_failure(keys)
    elif request.user.is_authenticated:
        cache.delete(keys[1])
    return response
