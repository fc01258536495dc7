"""The grant point's database: E001, E004, E006, E008, W002, W007 from settings
(the backend's ``Dialect.check_settings``), E007 (time zone support), and
W004-W006, the checks that read the database (``manage.py check --database
default``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from django.apps import AppConfig, apps
from django.conf import settings
from django.core.checks import CheckMessage, Error, Tags, Warning, register
from django.db import DatabaseError, connections, router

from .. import watermarks
from ..backends import dialect_for_settings, dialect_of, triggers
from ..conf import DEFAULTS, user_settings
from ..models import Lock, TokenFloor

TOKEN_WARNING_THRESHOLD = 2**62


def grant_point_alias() -> str:
    """COORDINATION["DATABASE"], read without validating the rest: a misspelt
    key is E003's to report, not a crash of every check that reads the settings."""
    return str(user_settings().get("DATABASE", DEFAULTS["DATABASE"]))


@register(Tags.compatibility)
def check_database(app_configs: Sequence[AppConfig] | None = None, **kwargs: Any) -> list[CheckMessage]:
    """E001: the grant point's database must have a backend of its own (PostgreSQL or
    SQLite: elsewhere no trigger keeps watermarks from going down); E004: SQLite
    needs IMMEDIATE transactions; E008: the database driver the grant point calls;
    W002: ATOMIC_REQUESTS on it. What the database asks of its settings is its
    backend's (``Dialect.check_settings``)."""
    messages: list[CheckMessage] = []
    alias = grant_point_alias()
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


@register(Tags.compatibility)
def check_time_zone_support(
    app_configs: Sequence[AppConfig] | None = None, **kwargs: Any
) -> list[CheckMessage]:
    """E007: USE_TZ off. The grant point reads the database clock as aware datetimes
    and compares them with the rows' expiries, which Django reads naive without it."""
    if settings.USE_TZ:
        return []
    return [
        Error(
            "USE_TZ is False: coordination compares lease expiries with the database clock "
            "as aware datetimes, so renewals (the keep-alive of every fenced task) fail with "
            "\"can't compare offset-naive and offset-aware datetimes\", and on SQLite every "
            "grant fails.",
            hint="Set USE_TZ = True (Django's default since 5.0); Django's time zone "
            "documentation says how to move a project's own naive datetimes.",
            id="coordination.E007",
        )
    ]


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
    alias = grant_point_alias()
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
    alias = grant_point_alias()
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
