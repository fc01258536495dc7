"""The fenced conditional update of a :class:`~coordination.fenced.models.FencedModel`'s rows."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

from django.core.exceptions import FieldDoesNotExist, FieldError, ValidationError
from django.db import IntegrityError, connections, models, transaction
from django.db.models.expressions import Col
from django.db.models.lookups import Exact
from django.db.models.sql.where import AND

from .. import aio, signals
from ..exceptions import CoordinationError, LeaseLost, WrongLock
from ..leases import Lease
from ..models import Fence, RejectionReason
from .conditions import admitted_rows
from .grants import resolve_grant, resolve_step
from .keys import lock_binding
from .rejections import explain_refusal, refusal_of, refuse
from .statement import fenced_sql, write_alias

_Model = TypeVar("_Model", bound=models.Model)


def _narrowed_to(query: Any, model: Any, binding: Mapping[str, str]) -> bool:
    """Whether ``query``'s own conditions already pin each field the lock key binds
    to the key's value (``filter(pk=8)`` under ``order:8``): then every row it
    holds is guarded, with no query to ask."""
    where = query.where
    if where.connector != AND or where.negated or query.combinator:
        return False
    pinned: dict[Any, Any] = {}
    for child in where.children:
        if isinstance(child, Exact) and isinstance(child.lhs, Col):
            pinned[child.lhs.target] = child.rhs
    for name, value in binding.items():
        try:
            field = model._meta.pk if name == "pk" else model._meta.get_field(name)
            wanted = field.to_python(value)
        except (FieldDoesNotExist, ValidationError, ValueError, TypeError):
            return False
        if field not in pinned or pinned[field] != wanted:
            return False
    return True


class FencedQuerySet(models.QuerySet[_Model]):
    """QuerySet of a :class:`FencedModel`, with the fenced conditional update."""

    def update(self, **kwargs: Any) -> int:
        """``QuerySet.update()``, with the watermark triggers' refusals named for the row.

        An UPDATE that would lower a row's watermark raises ``StaleToken`` (a lower
        token) or ``DuplicateWrite`` (a lower step of the same token); one that
        leaves the watermark of a ``fence_strict`` row where it is raises
        ``UnfencedWrite``. ``bulk_update()`` goes through here too. The rows are
        left as they were: the database undoes the whole statement.
        """
        try:
            return super().update(**kwargs)
        except IntegrityError as error:
            refused = explain_refusal(error, self, kwargs)
            if refused is None:
                raise
            raise refused from error

    def fenced_update(
        self, grant: Lease | None = None, /, *, step: int | None = None, **values: Any
    ) -> int:
        """Apply ``values`` to the row guarded by ``grant``'s lock key, if its fence admits it.

        One conditional UPDATE: the check and the write cannot be separated by a
        pause. ``grant`` defaults to the current one (``locks.hold``,
        ``locks.use_grant`` or a fenced task); ``step`` defaults to the grant's
        next write number. Returns the number of rows written (at least 1).

        Raises ``StaleToken`` (a newer token wrote; ``current_token`` says which),
        ``DuplicateWrite`` (this token already wrote this step or a later one),
        ``WrongLock`` (the grant's key does not guard all the rows asked for: all or
        nothing, a queryset holding any row of another key writes none, and the
        message names those rows), ``LeaseLost`` (the grant was marked lost), or the model's
        ``DoesNotExist``. Each refusal is recorded as a Rejection.
        """
        model: Any = self.model
        grant = resolve_grant(grant)
        label = model._meta.label_lower
        binding = lock_binding(model, grant.key)
        if binding is None:
            refuse(
                WrongLock(
                    f"lock {grant.key!r} does not guard {label} rows "
                    f"(they are guarded by {model.fence_lock!r})"
                ),
                resource=label, grant=grant, step=step or 0, reason=RejectionReason.WRONG_LOCK,
                using=self.db,
            )
        write_step = resolve_step(grant, step)
        if grant.lost:
            refuse(
                LeaseLost(f"the lease of {grant.key!r} token {grant.token} was lost; not writing"),
                resource=label, grant=grant, step=write_step, reason=RejectionReason.LEASE_LOST,
                using=self.db,
            )
        self._refuse_unguarded(grant, binding, write_step, label)
        token = grant.token
        alias = write_alias(self)
        admitted: models.QuerySet[Any] | None = None
        fits = True
        # A refused write changes nothing, and the watermark only rises, so a
        # refusal found by the reads below still holds; the loop is for a row
        # deleted and re-created in between.
        for _attempt in range(3):
            # The common shapes' statement, compiled once (.statement); the same
            # SQL as the update() below, which takes every other shape.
            written = self._compiled_write(alias, token, write_step, binding, values)
            if written is None:
                if admitted is None:
                    admitted, fits = admitted_rows(self, token, write_step, binding)
                written = admitted.update(fence=token, fence_step=write_step, **values)
            self._result_cache = None  # as update() leaves the queryset it ran on
            if written:
                # send() returns at once when nobody listens; has_listeners() first
                # would resolve the receivers twice (the app's own always listen).
                signals.write_accepted.send(
                    sender=Fence, resource=label, grant=grant, step=write_step
                )
                return written
            # Only a refusal needs the guarded rows on their own, to explain it.
            guarded = self.filter(**binding) if fits else self.none()
            rows = list(guarded.values_list("pk", "fence", "fence_step")[:1])
            if not rows:
                if self.exists():
                    refuse(
                        WrongLock(f"lock {grant.key!r} does not guard the {label} rows asked for"),
                        resource=label, grant=grant, step=write_step,
                        reason=RejectionReason.WRONG_LOCK, using=self.db,
                    )
                raise model.DoesNotExist(
                    f"no {label} row guarded by lock {grant.key!r} matches the query"
                )
            pk, current, current_step = rows[0]
            resource = f"{label}:{pk}"
            refusal = refusal_of(resource, token, write_step, current, current_step)
            if refusal is not None:
                reason, error = refusal
                refuse(
                    error, resource=resource, grant=grant, step=write_step, reason=reason,
                    watermark=(current, current_step), using=self.db,
                )
        raise CoordinationError(f"fenced_update of {label} did not settle; retry")  # pragma: no cover

    def _refuse_unguarded(
        self, grant: Lease, binding: Mapping[str, str], step: int, label: str
    ) -> None:
        """All or nothing: refuse the whole write (``WrongLock``, recorded) if the
        queryset holds rows the grant's key does not guard. A filter already
        narrowed to the key's values (``filter(pk=X)`` under ``"order:{pk}"``)
        needs no query; any other shape costs one SELECT of the unguarded rows."""
        if _narrowed_to(self.query, self.model, binding):
            return
        try:
            unguarded = self.exclude(**binding)
        except (ValueError, ValidationError, FieldError):
            unguarded = self  # the key's values fit no row: none is guarded
        shown = 10
        pks = list(unguarded.order_by().values_list("pk", flat=True)[: shown + 1])
        if not pks:
            return
        named = ", ".join(str(pk) for pk in pks[:shown]) + (", ..." if len(pks) > shown else "")
        refuse(
            WrongLock(
                f"lock {grant.key!r} does not guard {label} rows {named} of the rows "
                f"asked for; nothing written (a fenced_update writes only the rows "
                f"of its grant's key)"
            ),
            resource=label, grant=grant, step=step, reason=RejectionReason.WRONG_LOCK,
            using=self.db,
        )

    def _compiled_write(
        self, alias: str, token: int, step: int, binding: Mapping[str, str],
        values: Mapping[str, Any],
    ) -> int | None:
        """The fenced UPDATE of a shape :mod:`.statement` covers, compiled and sent
        as ``update()`` does its own: an error marks the caller's atomic block for
        rollback, and a watermark trigger's refusal is raised as :meth:`update`
        names it. None (nothing sent) for a shape it does not cover."""
        with transaction.mark_for_rollback_on_error(using=alias):
            compiled = fenced_sql(self, alias, token, step, binding, values)
            if compiled is None:
                return None
            sql, params = compiled
            try:
                with connections[alias].cursor() as cursor:
                    cursor.execute(sql, params)
                    written: int = cursor.rowcount
            except IntegrityError as error:
                admitted, _fits = admitted_rows(self, token, step, binding)
                refused = explain_refusal(
                    error, admitted, {"fence": token, "fence_step": step, **values}
                )
                if refused is None:
                    raise
                raise refused from error
        return written

    async def afenced_update(
        self, grant: Lease | None = None, /, *, step: int | None = None, **values: Any
    ) -> int:
        """``fenced_update()`` for async code: the same conditional UPDATE, guarantees
        and refusals, run on the app's thread pool (:mod:`coordination.aio`).

        ``grant`` defaults to the current one (``locks.ahold``, ``use_grant`` or a
        fenced task) and ``step`` to its next write number, both taken in the
        caller's context. Cancelled before a thread took it, the write never
        runs; once it runs, it completes (one statement) and its outcome is dropped.
        """
        grant = resolve_grant(grant)
        write_step = resolve_step(grant, step)
        return await aio.run_sync(self.fenced_update, grant, step=write_step, **values)
