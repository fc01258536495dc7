"""The end of a fenced execution's lease: released, or logged as what became of it."""

from __future__ import annotations

import logging

from .. import locks
from ..conf import app_settings
from ..exceptions import LeaseLost
from ..leases import Lease
from ..logfields import LogFields
from ..models import Grant, GrantEnd, Lock

__all__ = ["release_quietly"]

logger = logging.getLogger("coordination.tasks")


def release_quietly(grant: Lease, *, using: str | None = None) -> None:
    """Release ``grant``'s own lease, never a newer holder's, and never raise.

    A task's outcome is its body's: a lease that ran out or a database that is
    down at release time is logged, and the lease expires on its own. A lease
    found lost says what became of it (expired, taken over, revoked): at
    WARNING when the task made fenced writes under it (those after the loss
    were refused, or checked against the watermark), at INFO when it made none.
    """
    try:
        locks.release(grant, using=using)
    except LeaseLost as lost:
        fields = LogFields(
            key=grant.key, token=grant.token, happened=_fate_of(grant, using), detail=lost.detail
        )
        if grant.steps:
            logger.warning(
                "task ran past its lease, its fenced writes were checked against the watermark %s",
                fields,
            )
        else:
            logger.info("task outlived its lease, it made no fenced write %s", fields)
    except Exception:
        logger.exception(
            "could not release, the lease will expire %s",
            LogFields(key=grant.key, token=grant.token, expires_at=grant.expires_at.isoformat()),
        )


def _fate_of(grant: Lease, using: str | None) -> str:
    """What became of a lease found lost at release, from its Grant row and the lock."""
    alias = using or app_settings.DATABASE
    try:
        ended = (
            Grant.objects.using(alias).filter(lock__key=grant.key, token=grant.token)
            .values_list("end_reason", flat=True).first()
        )
        current = Lock.objects.using(alias).filter(key=grant.key).values_list("token", "holder").first()
    except Exception:  # the database is down: the release's own detail says enough
        logger.debug("could not read what became of the lease", exc_info=True)
        return "unknown"
    end = ended if ended in GrantEnd.values else "ended"  # expired, revoked, released
    if current is not None and current[0] > grant.token:
        taken = f"taken over by token {current[0]}"
        return f"{end}, then {taken}" + ("" if current[1] else ", since ended")
    return end
