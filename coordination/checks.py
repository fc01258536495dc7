"""System checks, ids ``coordination.E0xx`` (errors) and ``coordination.W0xx`` (warnings)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from django.apps import AppConfig, apps
from django.conf import settings
from django.core.checks import CheckMessage, Error, Tags, Warning, register

from .conf import DEFAULTS, app_settings

SUPPORTED_VENDORS = {"postgresql", "sqlite"}


@register(Tags.database, Tags.compatibility)
def check_database(app_configs: Sequence[AppConfig] | None = None, **kwargs: Any) -> list[CheckMessage]:
    """E001: the coordination alias must be PostgreSQL or SQLite; W001: SQLite needs IMMEDIATE."""
    messages: list[CheckMessage] = []
    alias = app_settings.DATABASE
    config = settings.DATABASES.get(alias)
    if config is None:
        return [
            Error(
                f"COORDINATION['DATABASE'] names {alias!r}, which is not in DATABASES.",
                id="coordination.E001",
            )
        ]
    engine = str(config.get("ENGINE", ""))
    vendor = "postgresql" if "postgres" in engine else "sqlite" if "sqlite" in engine else engine
    if vendor not in SUPPORTED_VENDORS:
        messages.append(
            Error(
                f"Database {alias!r} uses {engine}; coordination supports PostgreSQL and SQLite.",
                hint="Point COORDINATION['DATABASE'] at a PostgreSQL database.",
                id="coordination.E001",
            )
        )
    if vendor == "sqlite":
        mode = str(config.get("OPTIONS", {}).get("transaction_mode", "")).upper()
        if mode not in {"IMMEDIATE", "EXCLUSIVE"}:
            messages.append(
                Warning(
                    f"SQLite database {alias!r} does not use IMMEDIATE transactions.",
                    hint='Set DATABASES[...]["OPTIONS"]["transaction_mode"] = "IMMEDIATE" so '
                    "grant-point transactions take the write lock before reading the counter.",
                    id="coordination.W001",
                )
            )
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


@register(Tags.models)
def check_fenced_models(
    app_configs: Sequence[AppConfig] | None = None, **kwargs: Any
) -> list[CheckMessage]:
    """E002: every concrete FencedModel declares a usable ``fence_lock`` template."""
    from .fencing import _PLACEHOLDER, FencedModel

    messages: list[CheckMessage] = []
    for model in apps.get_models():
        if not issubclass(model, FencedModel):
            continue
        template = getattr(model, "fence_lock", None)
        if not isinstance(template, str) or not _PLACEHOLDER.search(template):
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
        for name in _PLACEHOLDER.findall(template):
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
    """E003: unknown or inconsistent COORDINATION settings."""
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
    if not 0 < values["MIN_TTL"] <= values["DEFAULT_TTL"] <= values["MAX_TTL"]:
        return [
            Error(
                "COORDINATION needs 0 < MIN_TTL <= DEFAULT_TTL <= MAX_TTL.",
                id="coordination.E003",
            )
        ]
    return []
