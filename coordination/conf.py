"""Settings of the app: one ``COORDINATION = {...}`` dict, read lazily.

Defaults (override any key in your settings)::

    COORDINATION = {
        "DATABASE": "default",      # alias holding locks, grants and fences
        "GRANT_POINT": None,        # None or "auto": the database's own grant point
                                    # (PostgreSQL: PL/pgSQL functions, one call per
                                    # acquire and release; MariaDB: stored procedures,
                                    # the same; SQLite: a transaction under
                                    # BEGIN IMMEDIATE). "orm": the portable ORM
                                    # transaction with select_for_update, for a
                                    # PostgreSQL or MariaDB database where the app may
                                    # not create functions or procedures
        "DEFAULT_TTL": 30.0,        # seconds, when acquire() is given no ttl
        "MIN_TTL": 0.05,            # seconds; shorter leases are refused
        "MAX_TTL": 3600.0,          # seconds; longer leases are refused
        "MAX_WAIT": 3600.0,         # seconds acquire(wait=...) may block
        "POLL_INTERVAL": 0.05,      # first back-off step while waiting, seconds
        "MAX_POLL_INTERVAL": 1.0,   # back-off ceiling while waiting, seconds
        "PREPARED_STATEMENTS": True,   # PostgreSQL: prepare the grant point's calls
                                    # on their second use on a connection. None: as
                                    # the connection does (OPTIONS
                                    # "prepare_threshold"); False behind a
                                    # transaction-pooling proxy that cannot keep
                                    # prepared statements (PgBouncer before 1.21)
        "WAKE_UPS": True,           # PostgreSQL: waiters woken by LISTEN/NOTIFY on
                                    # release and revoke (SQLite and MariaDB poll)
        "LOCK_DELAY": 0.0,          # seconds a lock stays ungrantable after a lease
                                    # expired or was revoked (acquire(lock_delay=))
        "TICKET_TTL": 10.0,         # seconds a fair waiter's queue ticket outlives
                                    # its last heartbeat (a crashed waiter's ticket)
        "RECORD_WRITES": False,     # keep an AcceptedWrite row per accepted fenced
                                    # write (the admin timeline shows them)
        "ACCESS_RULES": "auto",     # per-key access rules of API and admin users
                                    # (docs/access-rules.md): "auto" enforces them
                                    # once any AccessRule exists, "enforce" always
                                    # (no rule: no key), "off" never
        "API_MAX_WAIT": 30.0,       # seconds a REST acquire may block a web worker
        "API_THROTTLE_RATE": "1200/minute",  # REST requests per user; None: no limit
        "API_MAX_BODY_BYTES": 1048576,  # larger REST request bodies get 413
        "API_PAGE_SIZE": 100,       # items per page of REST lists (?page_size= up to 1000)
        "API_ANON_THROTTLE_RATE": "60/minute",  # REST requests per client address before
                                    # it authenticates (refused ones included); None: no limit
        "PRUNE_LOCKS_AFTER": 2592000.0,  # seconds (30 days) a lock must be free and unused
                                    # before coordination_prune deletes its row (the token
                                    # floor keeps its tokens increasing); None: never
        "METRICS_PUBLIC": False,    # /metrics for anyone; else staff users or METRICS_TOKEN
        "METRICS_TOKEN": "",        # "Authorization: Bearer <token>" a scraper may send
        "BEAT_ROLE": "celery-beat", # the election role FencedScheduler beats campaign for
        "BEAT_LEASE": 15.0,         # seconds of a beat leader's lease (kept alive every third)
        "BEAT_LOCK_DELAY": None,    # seconds the role stays unwinnable after a leader's lease
                                    # expired; None: LOCK_DELAY
        "ASYNC_THREADS": 8,         # threads (and database connections, at most) that
                                    # run aacquire, arenew, arelease, afenced_update and
                                    # afence for async callers (docs/async.md)
        "FENCE_IDLE_TIMEOUT": None, # PostgreSQL: seconds a fence() transaction may sit idle
                                    # (no statement from its holder) before the server ends
                                    # it, so a paused or hung holder cannot keep the fence's
                                    # row locked; None: the server's own setting
        "JOB_POLICY_REFRESH": 2.0,  # seconds a worker process keeps the job policies it
                                    # read (docs/jobs.md): a change in the admin or over
                                    # REST applies to executions that start later than this
        "UNIQUE_QUEUED_FOR": 3600.0,  # seconds a unique job's key stays claimed by a message
                                    # that waits to start (plus its countdown), so a message
                                    # lost in the broker never keeps the key for ever
    }
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from typing import Any

from django.conf import settings as django_settings
from django.core.exceptions import ImproperlyConfigured
from django.core.signals import setting_changed
from django.dispatch import receiver

DEFAULTS: dict[str, Any] = {
    "DATABASE": "default",
    "GRANT_POINT": None,
    "DEFAULT_TTL": 30.0,
    "MIN_TTL": 0.05,
    "MAX_TTL": 3600.0,
    "MAX_WAIT": 3600.0,
    "POLL_INTERVAL": 0.05,
    "MAX_POLL_INTERVAL": 1.0,
    "PREPARED_STATEMENTS": True,
    "WAKE_UPS": True,
    "LOCK_DELAY": 0.0,
    "TICKET_TTL": 10.0,
    "RECORD_WRITES": False,
    "ACCESS_RULES": "auto",
    "API_MAX_WAIT": 30.0,
    "API_THROTTLE_RATE": "1200/minute",
    "API_MAX_BODY_BYTES": 1048576,
    "API_PAGE_SIZE": 100,
    "API_ANON_THROTTLE_RATE": "60/minute",
    "PRUNE_LOCKS_AFTER": 2592000.0,
    "METRICS_PUBLIC": False,
    "METRICS_TOKEN": "",
    "BEAT_ROLE": "celery-beat",
    "BEAT_LEASE": 15.0,
    "BEAT_LOCK_DELAY": None,
    "ASYNC_THREADS": 8,
    "FENCE_IDLE_TIMEOUT": None,
    "JOB_POLICY_REFRESH": 2.0,
    "UNIQUE_QUEUED_FOR": 3600.0,
}


def user_settings() -> dict[str, Any]:
    """``settings.COORDINATION`` as the site wrote it (empty when unset), unchecked."""
    user = getattr(django_settings, "COORDINATION", {}) or {}
    return dict(user) if isinstance(user, dict) else {}


def unknown_settings(names: Iterable[str]) -> list[str]:
    """The ``names`` that are no COORDINATION setting, sorted."""
    return sorted(set(names) - set(DEFAULTS))


def meant(name: str) -> str | None:
    """The known setting a misspelt ``name`` most likely means, if any is close."""
    close = difflib.get_close_matches(name, DEFAULTS, n=1, cutoff=0.6)
    return close[0] if close else None


def did_you_mean(unknown: list[str]) -> str:
    """"Did you mean 'X'?" for the misspelt settings in ``unknown`` (empty if none is close)."""
    guesses = [(name, guess) for name in unknown if (guess := meant(name)) is not None]
    if len(unknown) == 1 and guesses:
        return f"Did you mean {guesses[0][1]!r}?"
    return " ".join(f"{name}: did you mean {guess!r}?" for name, guess in guesses)


class CoordinationSettings:
    """Attribute access to ``settings.COORDINATION`` with defaults, cached until changed.

    The first read of any setting reads them all and keeps each as an instance
    attribute, so later reads are plain attribute lookups (the grant point reads
    several per call); :meth:`reload` drops them.
    """

    def __init__(self) -> None:
        self._cache: dict[str, Any] | None = None

    def _values(self) -> dict[str, Any]:
        if self._cache is None:
            user = getattr(django_settings, "COORDINATION", {}) or {}
            unknown = unknown_settings(user)
            if unknown:
                guess = did_you_mean(unknown)
                raise ImproperlyConfigured(
                    f"Unknown COORDINATION settings: {', '.join(unknown)}"
                    f"{' (' + guess[0].lower() + guess[1:] + ')' if guess else ''}. "
                    f"Known: {', '.join(sorted(DEFAULTS))}."
                )
            self._cache = {**DEFAULTS, **user}
            # Found by normal attribute lookup from now on: __getattr__ only runs
            # for names not set here (before the first read, and unknown names).
            self.__dict__.update(self._cache)
        return self._cache

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        try:
            return self._values()[name]
        except KeyError:
            raise AttributeError(f"no COORDINATION setting {name!r}") from None

    def reload(self) -> None:
        if self._cache is not None:
            for name in self._cache:
                self.__dict__.pop(name, None)
        self._cache = None


app_settings = CoordinationSettings()


@receiver(setting_changed)
def _reload_on_change(*, setting: str, **kwargs: Any) -> None:
    if setting == "COORDINATION":
        app_settings.reload()
