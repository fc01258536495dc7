"""What a deployment of several processes asks of the site (``check --deploy``): W021."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from django.apps import AppConfig
from django.conf import settings
from django.core.checks import CheckMessage, Tags, Warning, register

from ..conf import DEFAULTS, user_settings
from .api import api_is_mounted

# Cache backends that keep no count another process can see: the REST API's
# throttles (DRF's, in the default cache) then hold per process, or not at all.
_LOCAL_CACHES = {
    "django.core.cache.backends.locmem.LocMemCache": "counts in each process alone",
    "django.core.cache.backends.dummy.DummyCache": "counts nothing: no rate is ever enforced",
}


@register(Tags.security, deploy=True)
def check_api_throttle_cache(
    app_configs: Sequence[AppConfig] | None = None, **kwargs: Any
) -> list[CheckMessage]:
    """W021: the REST API is mounted with a throttle rate, and the default cache,
    where the throttles count, is local memory or the dummy cache (docs/api.md)."""
    if not api_is_mounted():
        return []
    values = {**DEFAULTS, **user_settings()}
    rates = [name for name in ("API_THROTTLE_RATE", "API_ANON_THROTTLE_RATE") if values.get(name)]
    backend = str((getattr(settings, "CACHES", {}) or {}).get("default", {}).get("BACKEND", ""))
    effect = _LOCAL_CACHES.get(backend)
    if not rates or effect is None:
        return []
    return [
        Warning(
            f"The default cache is {backend.rsplit('.', 1)[-1]}, which {effect}: the REST API's "
            f"throttles ({', '.join(rates)}) count in it, so under several web processes a "
            "client gets that rate from each of them, and refused token guesses are not "
            "limited across the site.",
            hint="Set CACHES['default'] to a cache shared by every process (Redis, Memcached "
            "or the database cache), or silence coordination.W021 for a single process.",
            id="coordination.W021",
        )
    ]
