"""The record of accepted fenced writes, for the admin timeline.

Refused writes are always recorded (:class:`~coordination.models.Rejection`);
accepted ones only when ``COORDINATION["RECORD_WRITES"]`` is on, because a row
per write costs an INSERT on the hot path. The record is made inside the
writer's transaction, so it commits exactly when the write does.
"""

from __future__ import annotations

from typing import Any

from .conf import app_settings
from .leases import Lease
from .models import AcceptedWrite

__all__ = ["record_accepted_write"]


def record_accepted_write(
    sender: object, *, resource: str, grant: Lease, step: int, **kwargs: Any
) -> None:
    """``write_accepted`` receiver: store the write when RECORD_WRITES is on."""
    if not app_settings.RECORD_WRITES:
        return
    AcceptedWrite.objects.using(app_settings.DATABASE).create(
        resource=resource[: AcceptedWrite._meta.get_field("resource").max_length],
        lock_key=grant.key,
        token=grant.token,
        step=step,
        holder=grant.holder,
    )
