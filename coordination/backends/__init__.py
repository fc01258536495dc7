"""Grant-point backends: one per database alias, chosen once.

:func:`get_backend` returns the :class:`~coordination.backends.base.GrantPoint`
of an alias, picked by its database and ``COORDINATION["GRANT_POINT"]``:

============  =====================================  ====================================
database      ``None`` or ``"auto"`` (default)       ``"orm"``
============  =====================================  ====================================
PostgreSQL    PL/pgSQL functions (``postgresql``)    ORM ``select_for_update`` transaction
                                                     with LISTEN/NOTIFY wake-ups (``orm``)
SQLite        ORM transaction under BEGIN IMMEDIATE  the same
              (``sqlite``)
other         ORM ``select_for_update`` (``orm``)    the same
============  =====================================  ====================================

The choice is kept per alias until ``COORDINATION`` or ``DATABASES`` change
(``setting_changed``, as ``override_settings`` sends).
"""

from __future__ import annotations

from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.core.signals import setting_changed
from django.db import connections
from django.dispatch import receiver

from ..conf import app_settings
from .base import GrantPoint

__all__ = ["GRANT_POINTS", "GrantPoint", "get_backend"]

GRANT_POINTS: tuple[str | None, ...] = (None, "auto", "orm")
"""The values ``COORDINATION["GRANT_POINT"]`` accepts."""

_backends: dict[str, GrantPoint] = {}


def get_backend(alias: str | None = None) -> GrantPoint:
    """The grant point of ``alias`` (default ``COORDINATION["DATABASE"]``).

    Raises ``ImproperlyConfigured`` for a ``GRANT_POINT`` value other than
    None, ``"auto"`` or ``"orm"`` (system check ``coordination.E005``).
    """
    alias = alias or app_settings.DATABASE
    backend = _backends.get(alias)
    if backend is None:
        backend = _backends.setdefault(alias, _select(alias))
    return backend


def _select(alias: str) -> GrantPoint:
    choice = app_settings.GRANT_POINT
    if choice not in GRANT_POINTS:
        raise ImproperlyConfigured(
            f"COORDINATION['GRANT_POINT'] is {choice!r}; use None or 'auto' (the database's "
            "own grant point) or 'orm' (the portable select_for_update transaction)."
        )
    portable = choice == "orm"
    # The only place a database vendor picks code: each backend holds the rest.
    vendor = connections[alias].vendor
    if vendor == "postgresql":
        from .postgresql import PostgreSQLGrantPoint, PostgreSQLOrmGrantPoint

        return (PostgreSQLOrmGrantPoint if portable else PostgreSQLGrantPoint)(alias)
    if vendor == "sqlite":
        from .sqlite import SQLiteGrantPoint

        return SQLiteGrantPoint(alias)
    from .orm import OrmGrantPoint

    return OrmGrantPoint(alias)


@receiver(setting_changed)
def _forget_on_change(*, setting: str, **kwargs: Any) -> None:
    if setting in {"COORDINATION", "DATABASES"}:
        _backends.clear()
