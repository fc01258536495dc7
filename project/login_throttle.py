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
shared (Redis or Memcached).

The count is exact under concurrency: each login POST takes one attempt from
both counts with an atomic increment *before* its password is checked, and a
POST that would take more than the limit is refused without a check, so at most
``ADMIN_LOGIN_FAILURES`` passwords are checked per address and per name in a
window however many requests arrive at once. An attempt that did not end in a
failed check (a success, a refusal) is given back. That needs a cache whose
``incr`` is atomic: local memory (one process), Redis, Memcached; Django's
database cache reads and writes instead, and lets a burst through. The client address is the one
the REST API's throttles use (``coordination.api.permissions.client_address``):
``REMOTE_ADDR``, or with ``REST_FRAMEWORK["NUM_PROXIES"]`` (the site's
``DJANGO_NUM_PROXIES``) the address the trusted proxies put in
``X-Forwarded-For``. Behind a proxy without that setting every client shares
the proxy's address, so the address count throttles everyone at once.

django-axes does this too, with lockout records in the database, but it counts a
failure after the password check, and lets a burst of parallel requests through
(its issue #592, "known issue, won't fix"), so the site keeps this small view.
"""

from __future__ import annotations

import contextlib
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


def _limit() -> int:
    return int(settings.ADMIN_LOGIN_FAILURES)


def _take(key: str) -> tuple[int, int]:
    """Take one attempt from the count ``key``: (the count now, seconds left in its window).

    The window opens with the count's first attempt and is kept beside it
    (``<key>:until``), since an increment keeps the entry's expiry but does not say
    it. ``add`` then ``incr`` is atomic in caches that increment atomically
    (local memory, Redis, Memcached).
    """
    window = int(settings.ADMIN_LOGIN_WINDOW)
    now = time.time()
    cache.add(f"{key}:until", now + window, timeout=window)
    until = cache.get(f"{key}:until") or now + window
    left = max(1, int(until - now) + 1)
    cache.add(key, 0, timeout=left)
    try:
        return cache.incr(key), left
    except ValueError:  # the window ended between the add and the increment
        cache.add(key, 0, timeout=window)
        return cache.incr(key), window


def _give_back(key: str) -> None:
    """Return an attempt taken from ``key`` that was not a failed password check."""
    with contextlib.suppress(ValueError):  # its window ended meanwhile
        cache.decr(key)


def _reserve(keys: list[str]) -> int | None:
    """Take one attempt from every count of ``keys``, before the password is checked.

    None when each count is within the limit; otherwise every attempt taken is
    given back and the answer is the seconds until the spent count's window ends.
    """
    taken: list[str] = []
    for key in keys:
        count, left = _take(key)
        taken.append(key)
        if count > _limit():
            for spent in taken:
                _give_back(spent)
            return left
    return None


@csrf_protect
@never_cache
def admin_login(request: HttpRequest, extra_context: dict[str, Any] | None = None) -> HttpResponse:
    """``admin.site.login``, refused with 429 after too many failures (see the module)."""
    if request.method != "POST":
        return admin.site.login(request, extra_context)
    keys = failure_keys(request, str(request.POST.get("username", "")))
    wait = _reserve(keys)
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
        # The attempts taken stay taken: they are the failures counted.
        return response
    _give_back(keys[0])
    if request.user.is_authenticated:
        cache.delete_many([keys[1], f"{keys[1]}:until"])
    else:
        _give_back(keys[1])
    return response
