"""The COORDINATION settings: E003, E005, E030."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from django.apps import AppConfig
from django.conf import settings
from django.core.checks import CheckMessage, Error, register

from ..access import MODES
from ..backends import GRANT_POINTS
from ..conf import DEFAULTS, did_you_mean, unknown_settings
from ..election import ROLE_PREFIX
from ..exceptions import CoordinationError
from ..models import validate_key


@register()
def check_settings(app_configs: Sequence[AppConfig] | None = None, **kwargs: Any) -> list[CheckMessage]:
    """E003: unknown or inconsistent COORDINATION settings; E005: an unknown GRANT_POINT."""
    user = getattr(settings, "COORDINATION", {}) or {}
    unknown = unknown_settings(user)
    if unknown:
        guess = did_you_mean(unknown)
        return [
            Error(
                f"Unknown COORDINATION settings: {', '.join(unknown)}.",
                hint=f"{guess + ' ' if guess else ''}Known settings: {', '.join(sorted(DEFAULTS))}.",
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

