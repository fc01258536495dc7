"""The Celery integration's settings: E023, W003, W010, W011. A check never imports
Celery: it reads Django settings, or a Celery app the project already imported."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Sequence
from typing import Any

from django.apps import AppConfig
from django.conf import settings
from django.core.checks import CheckMessage, Error, Tags, Warning, register

from ..conf import DEFAULTS

# Brokers that hide a delivered task and hand it to another worker when it is
# not acknowledged within ``visibility_timeout``, and their default timeouts.
_VISIBILITY_TIMEOUT_BROKERS = {"redis": 3600, "rediss": 3600, "sentinel": 3600, "sqs": 1800}


@register(Tags.compatibility)
def check_celery_visibility_timeout(
    app_configs: Sequence[AppConfig] | None = None, **kwargs: Any
) -> list[CheckMessage]:
    """W003: a Redis/SQS visibility timeout shorter than MAX_TTL redelivers tasks that hold a lease."""
    broker_url, options = _celery_broker_settings()
    scheme = broker_url.split("://", 1)[0].split("+", 1)[0].lower() if "://" in broker_url else ""
    if scheme not in _VISIBILITY_TIMEOUT_BROKERS:
        return []
    timeout = options.get("visibility_timeout", _VISIBILITY_TIMEOUT_BROKERS[scheme])
    max_ttl = DEFAULTS["MAX_TTL"]
    user = getattr(settings, "COORDINATION", {}) or {}
    if isinstance(user, dict):
        max_ttl = user.get("MAX_TTL", max_ttl)
    try:
        timeout, max_ttl = float(timeout), float(max_ttl)
    except (TypeError, ValueError):
        return []
    if timeout >= max_ttl:
        return []
    return [
        Warning(
            f"The Celery broker ({scheme}) redelivers an unacknowledged task after "
            f"visibility_timeout={timeout:g} s, shorter than COORDINATION['MAX_TTL']={max_ttl:g} s: "
            "a task still holding its lease would run a second time on another worker.",
            hint="Raise CELERY_BROKER_TRANSPORT_OPTIONS['visibility_timeout'] above MAX_TTL, "
            "or lower COORDINATION['MAX_TTL'].",
            id="coordination.W003",
        )
    ]


# Broker schemes whose kombu transport needs a client library Celery does not
# install by itself, and the package that provides it.
_BROKER_CLIENTS = {"redis": "redis", "rediss": "redis", "sentinel": "redis"}


@register(Tags.compatibility)
def check_celery_broker_client(
    app_configs: Sequence[AppConfig] | None = None, **kwargs: Any
) -> list[CheckMessage]:
    """E023: the Celery broker is Redis, and the ``redis`` client is not installed.

    ``pip install celery`` alone does not bring it: a worker then fails at start
    and every ``delay()`` fails with a server error.
    """
    broker_url, _ = _celery_broker_settings()
    scheme = broker_url.split("://", 1)[0].split("+", 1)[0].lower() if "://" in broker_url else ""
    package = _BROKER_CLIENTS.get(scheme)
    if package is None or importlib.util.find_spec(package) is not None:
        return []
    return [
        Error(
            f"The Celery broker is {scheme}://, but the {package!r} package is not installed.",
            hint="pip install 'django-coordination[celery]' (it pulls celery[redis]), "
            "or pip install 'celery[redis]'.",
            id="coordination.E023",
        )
    ]


_GREEN_POOLS = {"gevent", "eventlet"}


@register(Tags.compatibility)
def check_celery_fenced_tasks(
    app_configs: Sequence[AppConfig] | None = None, **kwargs: Any
) -> list[CheckMessage]:
    """W010: eager mode runs fenced tasks in the caller; W011: green pools starve the keep-alive."""
    messages: list[CheckMessage] = []
    eager = _celery_setting("task_always_eager")
    if eager:
        messages.append(
            Warning(
                "CELERY_TASK_ALWAYS_EAGER is on: fenced tasks run in the caller's process, inside "
                "its transaction (where the grant point refuses to run: InTransaction), and "
                "supersede mode never sees a later enqueue.",
                hint="Turn task_always_eager off outside unit tests; run a worker, or call "
                "task.apply() in tests that need a task inline.",
                id="coordination.W010",
            )
        )
    pool = str(_celery_setting("worker_pool") or "").rsplit(":", 1)[-1].lower()
    if pool in _GREEN_POOLS:
        messages.append(
            Warning(
                f"CELERY_WORKER_POOL is {pool!r}: a fenced task's keep-alive runs as a greenlet, and "
                "a task body that does not yield starves it, so leases are lost mid-task "
                "(the task's later fenced writes are then refused).",
                hint="Use the prefork, threads or solo pool for fenced tasks, or a ttl longer "
                "than the longest stretch a task body runs without yielding.",
                id="coordination.W011",
            )
        )
    return messages


def _celery_setting(name: str) -> Any:
    """A Celery setting from Django settings (CELERY_ namespace) or a configured Celery app."""
    value = getattr(settings, f"CELERY_{name.upper()}", None)
    if value is None and "celery" in sys.modules:
        # Only looked at when the project already imported Celery: a check never imports it.
        value = sys.modules["celery"].current_app.conf.get(name)
    return value


def _celery_broker_settings() -> tuple[str, dict[str, Any]]:
    """The broker URL and transport options, from Django settings or a configured Celery app."""
    url = getattr(settings, "CELERY_BROKER_URL", None)
    options = getattr(settings, "CELERY_BROKER_TRANSPORT_OPTIONS", None)
    if url is None and "celery" in sys.modules:
        # A project that configures Celery without the CELERY_ settings namespace.
        # Only looked at when it already imported Celery: a check never imports it.
        conf = sys.modules["celery"].current_app.conf
        url, options = conf.broker_url, options or conf.broker_transport_options
    if isinstance(url, list | tuple):
        url = url[0] if url else ""
    url = str(url or "").split(";", 1)[0].strip()
    return url, dict(options or {})

