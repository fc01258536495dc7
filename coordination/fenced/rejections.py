"""Refused writes: why a (token, step) is refused, and the record of it that
survives the refused transaction (:class:`~coordination.models.Rejection`)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, NoReturn

from django.db import DatabaseError, IntegrityError, connections, models
from django.db.models import F, Value

from .. import signals, watermarks
from ..backends import dialect_of, get_backend
from ..conf import app_settings
from ..exceptions import CoordinationError, DuplicateWrite, StaleToken, UnfencedWrite, shown_step
from ..leases import Lease
from ..logfields import LogFields
from ..models import Rejection, RejectionReason

# The resource side's documented logger, whichever of its modules logs.
logger = logging.getLogger("coordination.fencing")


def record_rejection(
    *,
    resource: str,
    grant: Lease,
    step: int,
    reason: RejectionReason,
    watermark: tuple[int, int] | None = None,
    using: str | None = None,
) -> Rejection:
    """Record a refused write so that it survives the refused transaction.

    Outside a transaction it commits at once. Inside the caller's transaction
    (the same check as the grant point's) it is written through a second
    connection, so the caller's rollback cannot erase it; SQLite allows one
    writer, and the caller's transaction is it: there the record commits with
    the caller's transaction (the backend decides, see
    :meth:`~coordination.backends.base.GrantPoint.save_surviving_rollback`).
    """
    alias = using or app_settings.DATABASE
    rejection = Rejection(
        resource=resource[: Rejection._meta.get_field("resource").max_length],
        lock_key=grant.key,
        token=grant.token,
        step=step,
        watermark_token=watermark[0] if watermark else None,
        watermark_step=watermark[1] if watermark else None,
        reason=reason,
        holder=grant.holder,
    )
    get_backend(alias).save_surviving_rollback(rejection)
    # key=value for log search; the same fields under record.coordination for
    # JSON formatters (one attribute, so no clash with LogRecord's own names).
    logger.warning(
        "write refused %s",
        LogFields(
            reason=reason, resource=resource, key=grant.key, token=grant.token, step=step,
            holder=grant.holder, watermark_token=rejection.watermark_token,
            watermark_step=shown_step(rejection.watermark_step),
        ),
        extra={
            "coordination": {
                "event": "write_refused", "reason": str(reason), "resource": resource,
                "key": grant.key, "token": grant.token, "step": step, "holder": grant.holder,
                "watermark_token": rejection.watermark_token,
                "watermark_step": rejection.watermark_step,
            }
        },
    )
    signals.write_rejected.send(sender=Rejection, rejection=rejection)
    return rejection


def explain_refusal(
    error: IntegrityError, rows: models.QuerySet[Any, Any], values: Mapping[str, Any]
) -> CoordinationError | None:
    """The error to raise for an UPDATE of ``rows`` setting ``values`` that a watermark
    trigger refused, or None if ``error`` is not such a refusal.

    PostgreSQL's refusal names the row and both watermarks. SQLite's names only
    the table, so the rows are read again with the values the UPDATE would have
    set, to find the one refused.
    """
    model: Any = rows.model
    refusal = dialect_of(connections[rows.db]).watermark_refusal(error)
    # The watermark's table: a multi-table child keeps it in its parent's.
    if refusal is None or refusal.table != model._meta.get_field("fence").model._meta.db_table:
        return None
    label = model._meta.label_lower
    old: tuple[int, ...]
    new: tuple[int, ...]
    if refusal.old is None:
        found = _refused_row(rows, values, refusal.strict)
        if found is None:
            return None
        pk, old, new = found
    else:
        pk, old, new = refusal.pk, refusal.old, refusal.new or refusal.old
    if len(old) != 2 or len(new) != 2:
        return None
    resource = f"{label}:{pk}"
    if refusal.strict:
        return UnfencedWrite(resource, old[0], old[1])
    # Classified as a fenced write's refusal is: a lower token is stale, a
    # lower step of the same token a duplicate.
    explained = refusal_of(resource, new[0], new[1], old[0], old[1])
    return None if explained is None else explained[1]


def _refused_row(
    rows: models.QuerySet[Any, Any], values: Mapping[str, Any], strict: bool
) -> tuple[Any, tuple[int, int], tuple[int, int]] | None:
    """(pk, watermark, the watermark the UPDATE would have set) of the first row the
    trigger refuses: one it would lower, or with ``strict`` one it would leave as is."""
    new: dict[str, Any] = {}
    for name in ("fence", "fence_step"):
        value = values.get(name, F(name))
        if not hasattr(value, "resolve_expression"):
            value = Value(value, output_field=models.BigIntegerField())
        new[f"_coordination_new_{name}"] = value
    with watermarks.readable_after_refusal(rows.db):
        try:
            found = list(
                rows.annotate(**new).values_list("pk", "fence", "fence_step", *new)
            )
        except DatabaseError:  # pragma: no cover  (the explanation is best effort)
            return None
    for pk, fence, step, new_fence, new_step in found:
        if (new_fence, new_step) < (fence, step) or (strict and (new_fence, new_step) == (fence, step)):
            return pk, (fence, step), (new_fence, new_step)
    return None


def refusal_of(
    resource: str, token: int, step: int, current: int, current_step: int
) -> tuple[RejectionReason, CoordinationError] | None:
    """Why (token, step) is not above the watermark (current, current_step), if it is not."""
    if token < current:
        return RejectionReason.STALE, StaleToken(resource, token, current, current_step)
    if token == current and step <= current_step:
        return RejectionReason.DUPLICATE, DuplicateWrite(resource, token, step, current_step)
    return None


def refuse(
    error: CoordinationError,
    *,
    resource: str,
    grant: Lease,
    step: int,
    reason: RejectionReason,
    watermark: tuple[int, int] | None = None,
    using: str,
) -> NoReturn:
    record_rejection(
        resource=resource, grant=grant, step=step, reason=reason, watermark=watermark, using=using
    )
    raise error
