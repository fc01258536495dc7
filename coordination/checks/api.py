"""The REST API's apps, when the site's URLs include it: E020-E023, W020."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable, Sequence
from typing import Any

from django.apps import AppConfig, apps
from django.core.checks import CheckMessage, Error, Tags, Warning, register
from django.urls import URLResolver, get_resolver

API_URLCONF = "coordination.api.urls"
# The apps the REST API needs when the site's URLs include it, with the check id
# and what fails without each.
API_APPS = [
    ("rest_framework", "coordination.E020", "Django REST framework, which the API is built on"),
    (
        "rest_framework.authtoken",
        "coordination.E021",
        "the Token model behind 'Authorization: Token ...' (without it every token request is a "
        "server error)",
    ),
    ("drf_spectacular", "coordination.E022", "the OpenAPI schema and the templates of the docs pages"),
]


@register(Tags.compatibility)
def check_api_apps(app_configs: Sequence[AppConfig] | None = None, **kwargs: Any) -> list[CheckMessage]:
    """E020-E022: apps the REST API needs; W020: the docs pages' assets app.

    Only when the site's ROOT_URLCONF includes ``coordination.api.urls``: a site
    that uses the Python API and Celery alone needs none of them.
    """
    if not api_is_mounted():
        return []
    messages: list[CheckMessage] = []
    for app, check_id, what in API_APPS:
        if not apps.is_installed(app):
            messages.append(
                Error(
                    f"The site's URLs include {API_URLCONF}, but {app!r} is not in INSTALLED_APPS: "
                    f"it provides {what}.",
                    hint=f'Add "{app}" to INSTALLED_APPS (the REST API needs "rest_framework", '
                    '"rest_framework.authtoken" and "drf_spectacular"), then run migrate.',
                    id=check_id,
                )
            )
    if not apps.is_installed("drf_spectacular_sidecar"):
        missing = "is not installed" if importlib.util.find_spec("drf_spectacular_sidecar") is None else (
            "is installed but not in INSTALLED_APPS"
        )
        messages.append(
            Warning(
                f"drf_spectacular_sidecar {missing}: the API docs pages (docs/ and docs/redoc/ under "
                "the API) answer 404, because they load their JavaScript and CSS only from it, "
                "never from a CDN. The API and its schema work without it.",
                hint="pip install 'django-coordination[api-docs]' and add \"drf_spectacular_sidecar\" "
                "to INSTALLED_APPS (or silence coordination.W020 if you do not want the docs pages).",
                id="coordination.W020",
            )
        )
    return messages


def api_is_mounted() -> bool:
    """Whether the site's ROOT_URLCONF includes the REST API's URLs (at any depth)."""
    def includes(patterns: Iterable[Any]) -> bool:
        for pattern in patterns:
            if isinstance(pattern, URLResolver):
                module = getattr(pattern.urlconf_module, "__name__", pattern.urlconf_name)
                if module == API_URLCONF or includes(pattern.url_patterns):
                    return True
        return False

    try:
        return includes(get_resolver().url_patterns)
    except Exception:
        # A URLconf that does not import is Django's own check (urls.E0xx) to
        # report; this check has nothing to add to it.
        return False

