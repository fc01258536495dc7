"""System checks, ids ``coordination.E0xx`` (errors) and ``coordination.W0xx`` (warnings)."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterable, Sequence
from typing import Any

from django.apps import AppConfig, apps
from django.conf import settings
from django.core.checks import CheckMessage, Error, Tags, Warning, register

from .backends import GRANT_POINTS, dialect_for_settings
from .conf import DEFAULTS, app_settings
from .stores.checks import check_fenced_storages

# Checks that read only settings and code are registered without the ``database``
# tag, so plain ``manage.py check``, ``runserver``, ``migrate`` and a fenced Celery
# worker's start run them (Django runs database-tagged checks only when asked to
# with ``check --database``). Only W004, W005 and W006 read the database.

@register(Tags.compatibility)
def check_database(app_configs: Sequence[AppConfig] | None = None, **kwargs: Any) -> list[CheckMessage]:
    """E001: the grant point's database must have a backend of its own (PostgreSQL or
    SQLite: elsewhere no trigger keeps watermarks from going down); E004: SQLite
    needs IMMEDIATE transactions; W002: ATOMIC_REQUESTS on it. What the database
    asks of its settings is its backend's (``Dialect.check_settings``)."""
    messages: list[CheckMessage] = []
    alias = app_settings.DATABASE
    config = settings.DATABASES.get(alias)
    if config is None:
        return [
            Error(
                f"COORDINATION['DATABASE'] names {alias!r}, which is not in DATABASES.",
                hint="Name a DATABASES alias (default: 'default').",
                id="coordination.E001",
            )
        ]
    messages.extend(dialect_for_settings(config).check_settings(alias, config))
    if config.get("ATOMIC_REQUESTS"):
        messages.append(
            Warning(
                f"ATOMIC_REQUESTS is on for {alias!r}: views that acquire locks would run the "
                "grant point inside the request's transaction, which coordination refuses.",
                hint="Turn ATOMIC_REQUESTS off, or decorate such views with "
                "django.db.transaction.non_atomic_requests.",
                id="coordination.W002",
            )
        )
    return messages


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
    from django.urls import URLResolver, get_resolver

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


@register(Tags.models)
def check_fenced_models(
    app_configs: Sequence[AppConfig] | None = None, **kwargs: Any
) -> list[CheckMessage]:
    """E002: every concrete FencedModel declares a usable ``fence_lock`` template."""
    from .fenced.keys import PLACEHOLDER
    from .fencing import FencedModel

    messages: list[CheckMessage] = []
    for model in apps.get_models():
        if not issubclass(model, FencedModel):
            continue
        template = getattr(model, "fence_lock", None)
        if not isinstance(template, str) or not PLACEHOLDER.search(template):
            messages.append(
                Error(
                    f"{model._meta.label} does not declare which lock key guards its rows.",
                    hint=f'Add fence_lock = "{model._meta.model_name}:{{pk}}" to the model.',
                    obj=model,
                    id="coordination.E002",
                )
            )
            continue
        names = {f.name for f in model._meta.get_fields()} | {"pk"}
        for name in PLACEHOLDER.findall(template):
            if name not in names:
                messages.append(
                    Error(
                        f"{model._meta.label}.fence_lock names {name!r}, which is not a field.",
                        obj=model,
                        id="coordination.E002",
                    )
                )
    return messages


@register()
def check_settings(app_configs: Sequence[AppConfig] | None = None, **kwargs: Any) -> list[CheckMessage]:
    """E003: unknown or inconsistent COORDINATION settings; E005: an unknown GRANT_POINT."""
    user = getattr(settings, "COORDINATION", {}) or {}
    unknown = sorted(set(user) - set(DEFAULTS))
    if unknown:
        return [
            Error(
                f"Unknown COORDINATION settings: {', '.join(unknown)}.",
                hint=f"Known settings: {', '.join(sorted(DEFAULTS))}.",
                id="coordination.E003",
            )
        ]
    values = {**DEFAULTS, **user}
    if values["GRANT_POINT"] not in GRANT_POINTS:
        return [
            Error(
                f"COORDINATION['GRANT_POINT'] is {values['GRANT_POINT']!r}.",
                hint="Use None or 'auto' (the database's own grant point: PostgreSQL functions, "
                "SQLite IMMEDIATE transactions) or 'orm' (the portable select_for_update "
                "transaction, for a database where the app may not create functions).",
                id="coordination.E005",
            )
        ]
    if not 0 < values["MIN_TTL"] <= values["DEFAULT_TTL"] <= values["MAX_TTL"]:
        return [
            Error(
                "COORDINATION needs 0 < MIN_TTL <= DEFAULT_TTL <= MAX_TTL.",
                id="coordination.E003",
            )
        ]
    threads = values["ASYNC_THREADS"]
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        return [
            Error(
                f"COORDINATION['ASYNC_THREADS'] is {threads!r}; it must be a positive integer.",
                hint="The async API's threads, each with its own database connection (docs/async.md).",
                id="coordination.E003",
            )
        ]
    after = values["PRUNE_LOCKS_AFTER"]
    if after is not None and (
        isinstance(after, bool) or not isinstance(after, int | float) or not 0 <= after < 10**10
    ):
        return [
            Error(
                f"COORDINATION['PRUNE_LOCKS_AFTER'] is {after!r}.",
                hint="Seconds a lock must be free and unused before coordination_prune deletes "
                "its row (a number >= 0), or None to keep every lock row.",
                id="coordination.E003",
            )
        ]
    idle = values["FENCE_IDLE_TIMEOUT"]
    if idle is not None and (
        isinstance(idle, bool) or not isinstance(idle, int | float) or not 0 < idle < 10**6
    ):
        return [
            Error(
                f"COORDINATION['FENCE_IDLE_TIMEOUT'] is {idle!r}.",
                hint="Seconds a fence() transaction may sit idle before PostgreSQL ends it "
                "(a number > 0), or None for the server's own idle_in_transaction_session_timeout.",
                id="coordination.E003",
            )
        ]
    refresh = values["JOB_POLICY_REFRESH"]
    if isinstance(refresh, bool) or not isinstance(refresh, int | float) or not 0 <= refresh <= 3600:
        return [
            Error(
                f"COORDINATION['JOB_POLICY_REFRESH'] is {refresh!r}.",
                hint="Seconds a worker process keeps the job policies it read, from 0 (read "
                "them at every execution) to 3600 (docs/jobs.md).",
                id="coordination.E003",
            )
        ]
    return _beat_settings(values)


def _beat_settings(values: dict[str, Any]) -> list[CheckMessage]:
    """E003 for FencedScheduler settings a beat would only refuse at its first
    campaign: a role that is no valid key, a lease the grant point refuses."""
    from .election import ROLE_PREFIX
    from .exceptions import CoordinationError
    from .models import validate_key

    role = values["BEAT_ROLE"]
    try:
        if not isinstance(role, str) or not role:
            validate_key(None, what="COORDINATION['BEAT_ROLE']")
        validate_key(f"{ROLE_PREFIX}{role}", what="COORDINATION['BEAT_ROLE']")
    except CoordinationError as error:
        return [Error(str(error), id="coordination.E003")]
    lease, delay = values["BEAT_LEASE"], values["BEAT_LOCK_DELAY"]
    if isinstance(lease, bool) or not isinstance(lease, int | float) or not (
        values["MIN_TTL"] <= lease <= values["MAX_TTL"]
    ):
        return [
            Error(
                f"COORDINATION['BEAT_LEASE'] is {lease!r}.",
                hint="Seconds of the beat leader's lease, between MIN_TTL and MAX_TTL "
                "(15 by default; 5 is the shortest the keep-alive holds safely, docs/celery.md).",
                id="coordination.E003",
            )
        ]
    if delay is not None and (
        isinstance(delay, bool) or not isinstance(delay, int | float) or delay < 0
    ):
        return [
            Error(
                f"COORDINATION['BEAT_LOCK_DELAY'] is {delay!r}.",
                hint="Seconds the beat role stays unwinnable after a leader's lease expired "
                "(a number >= 0), or None for LOCK_DELAY.",
                id="coordination.E003",
            )
        ]
    return []


@register()
def check_access_rules(app_configs: Sequence[AppConfig] | None = None, **kwargs: Any) -> list[CheckMessage]:
    """E030: COORDINATION["ACCESS_RULES"] is not "auto", "enforce" or "off"."""
    from .access import MODES

    value = ({**DEFAULTS, **(getattr(settings, "COORDINATION", {}) or {})}).get("ACCESS_RULES")
    if value in MODES:
        return []
    return [
        Error(
            f"COORDINATION['ACCESS_RULES'] is {value!r}.",
            hint='Use "auto" (rules apply once any access rule exists; the default), '
            '"enforce" (always; a user with no rule may use no key) or "off" '
            "(rules are ignored). See docs/access-rules.md.",
            id="coordination.E030",
        )
    ]


# Brokers that hide a delivered task and hand it to another worker when it is
# not acknowledged within ``visibility_timeout``, and their default timeouts.
_VISIBILITY_TIMEOUT_BROKERS = {"redis": 3600, "rediss": 3600, "sentinel": 3600, "sqs": 1800}
TOKEN_WARNING_THRESHOLD = 2**62


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


@register(Tags.database)
def check_token_headroom(
    app_configs: Sequence[AppConfig] | None = None,
    databases: Sequence[str] | None = None,
    **kwargs: Any,
) -> list[CheckMessage]:
    """W004: a lock has issued tokens above 2**62, or the token floor is above it,
    half-way to the 64-bit limit.

    A database check: it runs with ``manage.py check --database default``.
    """
    from django.db import DatabaseError

    from .models import Lock, TokenFloor

    alias = app_settings.DATABASE
    if not databases or alias not in databases:
        return []
    try:
        worn = list(
            Lock.objects.using(alias)
            .filter(token__gt=TOKEN_WARNING_THRESHOLD)
            .order_by("-token")
            .values_list("key", "token")[:5]
        )
        floor = TokenFloor.objects.using(alias).value()
    except DatabaseError:  # not migrated yet: nothing has issued tokens
        return []
    messages: list[CheckMessage] = []
    if worn:
        keys = ", ".join(f"{key!r} ({token})" for key, token in worn)
        messages.append(Warning(
            f"Lock tokens are past 2**62, approaching the 64-bit limit 2**63-1: {keys}.",
            hint="Tokens never wrap: a key that reaches the limit refuses every acquire. "
            "Move the work to new keys, and use smaller restore-guard bumps.",
            id="coordination.W004",
        ))
    if floor > TOKEN_WARNING_THRESHOLD:
        messages.append(Warning(
            f"The token floor is {floor}, past 2**62, approaching the 64-bit limit 2**63-1.",
            hint="Every key is issued tokens above the floor, and it never goes down: at the "
            "limit no key can be granted. Use smaller restore-guard bumps.",
            id="coordination.W004",
        ))
    return messages


@register(Tags.database)
def check_watermark_triggers(
    app_configs: Sequence[AppConfig] | None = None,
    databases: Sequence[str] | None = None,
    **kwargs: Any,
) -> list[CheckMessage]:
    """W005: a FencedModel, Fence, Lock or TokenFloor table lacks its watermark trigger.

    A database check: it runs with ``manage.py check --database default``.
    """
    from django.db import DatabaseError, connections, router

    from . import watermarks
    from .backends import triggers

    messages: list[CheckMessage] = []
    for alias in databases or ():
        connection = connections[alias]
        candidates = [model for model in apps.get_models() if router.allow_migrate_model(alias, model)]
        try:
            absent = triggers.missing(connection, watermarks.watermarks_of(candidates))
        except DatabaseError:  # not reachable or not migrated yet: migrate installs them
            continue
        messages.extend(
            Warning(
                f"Table {watermark.table!r} on database {alias!r} has no watermark trigger "
                f"{'(strict) ' if watermark.strict else ''}as this version of coordination "
                "defines it: an UPDATE could lower its watermark"
                + (
                    ", or a row deleted and inserted again start below it."
                    if watermark.tombstones else "."
                ),
                hint=f"Run manage.py migrate --database {alias}: it installs the triggers.",
                id="coordination.W005",
            )
            for watermark in absent
        )
    return messages


@register(Tags.database)
def check_promotion_guard(
    app_configs: Sequence[AppConfig] | None = None,
    databases: Sequence[str] | None = None,
    **kwargs: Any,
) -> list[CheckMessage]:
    """W006: the grant point's database streams to replicas asynchronously, and no
    promotion guard runs in its grants (the ORM grant point, or migration 0012 not
    applied): after a failover to a replica that missed the last grants, their
    tokens would be issued again (docs/high-availability.md).

    A database check: it runs with ``manage.py check --database default``.
    """
    from django.db import DatabaseError, connections

    from .backends import dialect_of

    alias = app_settings.DATABASE
    if not databases or alias not in databases:
        return []
    try:
        replication = dialect_of(connections[alias]).replication(connections[alias])
    except DatabaseError:  # not reachable: nothing to say about it
        return []
    if replication is None:  # no replicas to speak of, nor a promotion guard
        return []
    replicas, synchronous, guard_installed, guarded = replication
    if not replicas or synchronous or guarded:
        return []
    why = (
        "the ORM grant point (GRANT_POINT = 'orm') has none" if guard_installed
        else "its grant functions have none (migration 0012 is not applied)"
    )
    return [Warning(
        f"Database {alias!r} streams to {replicas} replica(s) asynchronously and {why}: a "
        "failover to a replica that missed the last grants would issue their tokens again.",
        hint="Run manage.py migrate and use the function grant point (the default), or "
        "replicate synchronously (Patroni synchronous_mode_strict); see "
        "docs/high-availability.md.",
        id="coordination.W006",
    )]


# The fenced stores' settings (E101-E103): a storage that cannot fence refuses to start.
register(Tags.compatibility)(check_fenced_storages)
