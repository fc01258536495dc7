"""System checks of the fenced stores, ids ``coordination.E10x``.

Not registered on import: the app registers :func:`check_fenced_storages` (a
settings-only check, no ``database`` tag) and, for ``check --deploy``,
:func:`probe_fenced_storages_before_deploy` when it starts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from django.apps import AppConfig
from django.conf import settings
from django.core.checks import CheckMessage, Error
from django.utils.module_loading import import_string

OBJECTS_MODULE = "coordination.stores.objects"


def _is_fenced(backend: Any) -> bool:
    return isinstance(backend, type) and any(
        cls.__module__ == OBJECTS_MODULE for cls in backend.__mro__
    )


def _fenced_storages(messages: list[CheckMessage]) -> list[tuple[str, type, dict[str, Any]]]:
    """The fenced storages of ``STORAGES`` (alias, backend, options); a backend under
    ``coordination.stores`` that does not import is E103, added to ``messages``."""
    found = []
    for alias, config in getattr(settings, "STORAGES", {}).items():
        path = config.get("BACKEND", "")
        if not path.startswith("coordination.stores"):
            continue
        try:
            backend = import_string(path)
        except ImportError as error:
            messages.append(Error(
                f"STORAGES[{alias!r}] names {path}, which does not import: {error}",
                hint="Install the extra it needs: pip install 'django-coordination[s3]'.",
                id="coordination.E103",
            ))
            continue
        if _is_fenced(backend):
            found.append((alias, backend, dict(config.get("OPTIONS", {}))))
    return found


def _probe(alias: str, backend: type, options: dict[str, Any]) -> list[CheckMessage]:
    try:
        problem = backend(**options).probe_conditional_writes()
    except Exception as error:
        problem = f"the storage could not be built: {error}"
    if problem is None:
        return []
    return [Error(
        f"STORAGES[{alias!r}]: the store does not refuse a failed precondition: {problem}.",
        hint="Use a store with conditional writes, or a plain S3Storage (unfenced); "
        "\"probe_at_check\": False skips the probe.",
        id="coordination.E102",
    )]


def check_fenced_storages(
    app_configs: Sequence[AppConfig] | None = None, **kwargs: Any
) -> list[CheckMessage]:
    """E101: a fenced storage of ``STORAGES`` whose store has no conditional writes
    (``conditional_writes: False``): its writes could not be fenced, so the site does
    not start rather than write unfenced. E102: with ``probe_at_check`` True,
    the probe found the store applying a write whose precondition failed (or could
    not run). E103: the backend cannot be imported or built."""
    messages: list[CheckMessage] = []
    for alias, backend, options in _fenced_storages(messages):
        if options.get("conditional_writes", True) is False:
            messages.append(Error(
                f"STORAGES[{alias!r}] is a fenced storage on a store without conditional writes.",
                hint="Fenced writes need If-Match and If-None-Match on PUT (S3 since 2024, "
                "MinIO, R2); use a plain S3Storage for this store, and accept its writes as "
                "unfenced, or move the data to a store that has them.",
                id="coordination.E101",
            ))
        elif options.get("probe_at_check") is True:
            messages += _probe(alias, backend, options)
    return messages


def probe_fenced_storages_before_deploy(
    app_configs: Sequence[AppConfig] | None = None, **kwargs: Any
) -> list[CheckMessage]:
    """E102 under ``manage.py check --deploy``: the probe of every fenced storage
    whose options leave ``probe_at_check`` out (True probes at every check, False
    never), so a store that ignores preconditions is found before a deploy even
    where nobody declared it."""
    messages: list[CheckMessage] = []
    for alias, backend, options in _fenced_storages([]):
        if "probe_at_check" not in options and options.get("conditional_writes", True) is not False:
            messages += _probe(alias, backend, options)
    return messages
