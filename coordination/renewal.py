"""Renewing a lease, and the clock it is measured by.

The two grant-point calls a keep-alive makes (:mod:`coordination.keepalive`),
below :mod:`coordination.locks`, which names them for users beside acquire and
release: ``database_now()`` and ``renew()``.
"""

from __future__ import annotations

import datetime as dt
import logging

from . import signals
from .backends import get_backend
from .conf import app_settings
from .exceptions import LeaseLost
from .leases import Lease
from .logfields import LogFields
from .models import Grant
from .waiting import grant_point_call, validate_ttl

__all__ = ["database_now", "renew"]

logger = logging.getLogger("coordination.locks")


def database_now(using: str | None = None) -> dt.datetime:
    """The database server's current time (aware, UTC): the only clock leases use."""
    return get_backend(using).now()


def renew(grant: Lease, *, ttl: float | None = None, using: str | None = None) -> Lease:
    """Extend the lease ``grant`` to ``ttl`` seconds from now (database time).

    Only the current holder can renew: the lease must not have expired, been
    released, revoked or taken over, and ``grant.lease_id`` must match. Otherwise
    raises ``LeaseLost`` and marks the lease lost. A shared (reader) lease is
    renewed in its Grant row (``coordination.shared``). Returns the same lease with
    ``expires_at`` moved (its Grant row's too).
    """
    seconds = validate_ttl(app_settings.DEFAULT_TTL if ttl is None else ttl)
    backend = get_backend(using)
    try:
        with grant_point_call("renew", grant.key, using):
            expires_at = backend.renew(grant, seconds)
    except LeaseLost as lost:
        grant.mark_lost()
        logger.warning("lease lost %s", LogFields(key=grant.key, token=grant.token, detail=lost.detail))
        signals.lock_lost.send(sender=Grant, grant=grant, error=lost)
        raise
    grant.expires_at = expires_at
    signals.lock_renewed.send(sender=Grant, grant=grant)
    return grant
