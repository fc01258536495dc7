"""Restore guard: tokens and watermarks never go backwards, even after a restore.

A backup is a moment in the past. Restoring one rolls back exactly the two
things that must never go backwards (rule 8 of docs/rules.md):

- **The lock database** (token counters): the next grants would issue tokens
  that were already issued, and used, after the backup. :func:`bump_tokens`
  raises the token floor by N (:func:`raise_floor`), then every counter by N,
  N being more than any key can have issued since the backup, so every new
  token is above every token ever issued. The floor covers the keys the
  backup never saw: a key first granted after the backup has no row to bump,
  and without the floor it would start again at token 1.
- **A resource store** (watermarks): a token already fenced out would be
  accepted again. :func:`raise_fences` raises every watermark (Fence rows and
  the ``fence`` columns of FencedModel rows) to its lock's last issued token
  (or the token floor, where that is higher),
  with that token closed too (step at its maximum), and ends every current
  lease, so only grants made after the guard can write.

When one database holds both (the default here), do both: bump, then raise.

Everything is planned first; ``apply=False`` reports the plan and changes
nothing. Work goes in batches of short transactions, so a large table never
holds locks for long. Raising is idempotent: a second run finds nothing to do.
Bumping is not, and cannot be: a counter in a restored database cannot tell
whether it was already bumped since the backup was taken. A second bump is safe
(tokens may have gaps) but spends token space.

:func:`raise_floor_to` raises the floor to at least a value in one statement,
beside running grants: the step a failover guard needs (every key's counter
past anything an old primary could have issued, before the first grant on the
new one).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from django.apps import apps
from django.core.exceptions import FieldDoesNotExist
from django.db import connections, models, router, transaction
from django.db.models import F, Q

from . import locks
from .backends import dialect_of
from .conf import app_settings
from .exceptions import CoordinationError, InvalidInput, TokenExhausted
from .fenced.keys import PLACEHOLDER
from .fencing import FencedModel, lock_binding, raise_fence_to_lock
from .models import MAX_TOKEN, DatabaseNow, Fence, Lock, TokenFloor

__all__ = [
    "CLOSED_STEP",
    "RestoreReport",
    "bump_tokens",
    "fenced_models",
    "raise_fences",
    "raise_floor",
    "raise_floor_to",
    "revoke_leases",
]

# The step a raised watermark gets: the last issued token may not write again,
# whatever step its holder is at. Only a grant made after the guard can write.
CLOSED_STEP = MAX_TOKEN

Say = Callable[[str], None]


def _quiet(line: str) -> None:
    pass


@dataclass
class RestoreReport:
    """What the guard changed, or with ``applied`` False, what it would change."""

    applied: bool
    # The token floor before and after raise_floor (None: not asked to raise it).
    floor_before: int | None = None
    floor_after: int | None = None
    locks_bumped: int = 0
    fences_raised: int = 0
    rows_raised: dict[str, int] = field(default_factory=dict)
    leases_revoked: int = 0
    # Rows whose guarding lock key cannot be computed from fence_lock, per model.
    rows_unsupported: dict[str, int] = field(default_factory=dict)
    # Watermarks above their lock's counter: the lock database is behind.
    ahead_of_lock: list[str] = field(default_factory=list)

    @property
    def floor_raised(self) -> bool:
        return (self.floor_after or 0) > (self.floor_before or 0)

    @property
    def changed(self) -> int:
        return (
            int(self.floor_raised) + self.locks_bumped + self.fences_raised
            + sum(self.rows_raised.values()) + self.leases_revoked
        )


# --- the lock database: the token floor and the counters -------------------------


def raise_floor(
    by: int,
    *,
    apply: bool,
    using: str | None = None,
    report: RestoreReport | None = None,
    say: Say = _quiet,
) -> RestoreReport:
    """Raise the token floor by ``by``, in a short transaction of its own.

    After restoring the lock database, no key may be issued a token at or
    below the restored floor plus ``by``: that covers the keys the restored
    database has never seen (first granted after the backup, so without a row
    for :func:`bump_tokens` to raise), whose counters would otherwise start
    again at 1. Their next token is above every token they can have issued
    since the backup, provided ``by`` is more than that. Concurrent raises add
    up (the floor's row lock orders them); the floor never goes down.

    Refuses, changing nothing, if the floor would pass 2**63 - 1
    (``TokenExhausted``). ``InvalidInput`` for ``by`` < 1. Sets the report's
    ``floor_before`` and ``floor_after`` (planned, on a dry run).
    """
    _check_bump(by)
    alias = using or app_settings.DATABASE
    report = report or RestoreReport(applied=apply)
    floors = TokenFloor.objects.using(alias)
    with transaction.atomic(using=alias):
        if apply:
            # The row is locked from here to the commit: raises by others wait, then add.
            _ensure_floor_row(alias)
            before = floors.select_for_update().value()
        else:
            before = floors.value()
        if before > MAX_TOKEN - by:
            raise TokenExhausted(
                f"raising the token floor {before} by {by} would pass the largest 64-bit "
                f"token {MAX_TOKEN}; nothing was changed. Use a smaller bump."
            )
        after = raise_floor_to(before + by, using=alias) if apply else before + by
    say(f"token floor: {before} -> {after} (a key this database has never seen starts above it)")
    report.floor_before, report.floor_after = before, after
    return report


def raise_floor_to(token: int, *, using: str | None = None) -> int:
    """Raise the token floor to at least ``token``; return the floor afterwards.

    One conditional ``UPDATE``, safe beside running grants and other raises:
    every grant that begins after it returns is issued a token above ``token``,
    whatever its key. A ``token`` at or below the floor changes nothing.
    ``InvalidInput`` outside 0..2**63 - 1. For a guard that knows how high
    tokens can have gone (a promotion after a failover); after a restore use
    :func:`raise_floor` (or :func:`bump_tokens`), which raise it by a margin.
    """
    if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token <= MAX_TOKEN:
        raise InvalidInput(f"a token floor is a whole number from 0 to {MAX_TOKEN}")
    alias = using or app_settings.DATABASE
    floors = TokenFloor.objects.using(alias)
    rows = floors.filter(pk=TokenFloor.ROW, token__lt=token)
    if not rows.update(token=token, raised_at=DatabaseNow()):
        # At or above already, or no row yet: make it, then raise it.
        _ensure_floor_row(alias)
        rows.update(token=token, raised_at=DatabaseNow())
    return floors.value()


def _ensure_floor_row(alias: str) -> None:
    """Make the floor's row if it is missing (a flushed test database, a row
    deleted by hand), at 0, as the database's backend makes it (PostgreSQL
    records the current timeline with it, so no grant's promotion guard has
    to lock the row to record one)."""
    dialect_of(connections[alias]).ensure_token_floor_row(alias)


def _check_bump(by: int) -> None:
    if isinstance(by, bool) or not isinstance(by, int) or by < 1:
        raise InvalidInput("the bump must be a whole number of tokens, at least 1")


def bump_tokens(
    by: int,
    *,
    apply: bool,
    batch_size: int = 1000,
    using: str | None = None,
    report: RestoreReport | None = None,
    say: Say = _quiet,
    progress: Say = _quiet,
) -> RestoreReport:
    """Raise the token floor by ``by`` (:func:`raise_floor`), then every lock's
    token counter by ``by``, ending any lease recorded in it.

    Run after restoring the lock database, before anything acquires again. The
    floor goes first, committed before the counters are listed, so a key whose
    first grant comes while the guard runs is covered too. A lease in the
    restored rows belongs to the backup's past, so it is revoked
    (``locks.revoke``) before its lock is bumped: a bumped counter under an
    open lease would leave a grant that can never be closed. Each batch of locks
    is bumped in one short transaction holding their row locks, the grant
    point's own serialisation.

    Refuses the whole bump, changing nothing, if the floor or any counter would
    pass 2**63 - 1 (``TokenExhausted``). ``InvalidInput`` for ``by`` < 1.
    """
    _check_bump(by)
    alias = using or app_settings.DATABASE
    report = report or RestoreReport(applied=apply)
    rows = Lock.objects.using(alias)
    too_high = list(rows.filter(token__gt=MAX_TOKEN - by).values_list("key", "token")[:5])
    if too_high:
        names = ", ".join(f"{key!r} (token {token})" for key, token in too_high)
        raise TokenExhausted(
            f"bumping by {by} would take {names} past the largest 64-bit token "
            f"{MAX_TOKEN}; nothing was changed. Use a smaller bump."
        )
    raise_floor(by, apply=apply, using=alias, report=report, say=say)
    _bump_counters(by, apply=apply, alias=alias, batch_size=batch_size, report=report,
                   say=say, progress=progress)
    return report


def _bump_counters(
    by: int, *, apply: bool, alias: str, batch_size: int, report: RestoreReport, say: Say,
    progress: Say,
) -> None:
    """Raise the counter of every lock row by ``by``: the keys the backup had
    (the keys it did not have are the floor's)."""
    rows = Lock.objects.using(alias)
    total = rows.count()
    seen = 0
    for batch in _batches(rows.values_list("pk", "key", "token", "holder"), batch_size):
        held = []
        for _pk, key, token, holder in batch:
            lease = f" (revoking the lease of {holder})" if holder else ""
            say(f"lock {key!r}: token counter {token} -> {token + by}{lease}")
            if holder:
                held.append(key)
        if apply:
            # Held is decided again under the row locks: a lock acquired since
            # the listing is revoked and bumped like the others.
            held = _bump_free_locks([pk for pk, *_ in batch], by, alias)
            for key in held:
                _revoke_then_bump(key, by, alias, say)
        report.locks_bumped += len(batch)
        report.leases_revoked += len(held)
        seen += len(batch)
        progress(f"locks: {seen}/{total} {'bumped' if apply else 'checked'}")


def _bump_free_locks(pks: list[int], by: int, alias: str) -> list[str]:
    """Bump the locks of ``pks`` that are free; return the keys of those with a lease."""
    with transaction.atomic(using=alias):
        # In the order acquire_many locks keys (codepoint order, as Python sorts
        # them), else the two can deadlock on a pair of rows.
        rows = Lock.objects.using(alias).select_for_update().filter(pk__in=pks).order_by(
            _codepoint_order("key", alias)
        )
        found = list(rows.values_list("pk", "key", "holder"))
        free = [pk for pk, _key, holder in found if not holder]
        Lock.objects.using(alias).filter(pk__in=free, token__lte=MAX_TOKEN - by).update(
            token=F("token") + by
        )
    return [key for _pk, key, holder in found if holder]


def _codepoint_order(field: str, alias: str) -> Any:
    """``field`` ordered by codepoint, as Python sorts strings."""
    return dialect_of(connections[alias]).codepoint_order(field)


def _revoke_then_bump(key: str, by: int, alias: str, say: Say, attempts: int = 5) -> None:
    for _attempt in range(attempts):
        revoked = locks.revoke(key, using=alias)
        with transaction.atomic(using=alias):
            row = Lock.objects.using(alias).select_for_update().get(key=key)
            if not row.holder:
                Lock.objects.using(alias).filter(pk=row.pk, token__lte=MAX_TOKEN - by).update(
                    token=F("token") + by
                )
                return
        # Acquired between the revoke and the bump: that token may repeat one
        # issued after the backup. Nothing can take it back; say so loudly.
        say(
            f"WARNING: lock {key!r} was acquired (token {row.token}) while the guard ran "
            f"(revoked token {revoked.token if revoked else '-'}); stop every client"
        )
    raise CoordinationError(
        f"lock {key!r} keeps being acquired while the guard runs; stop every client of the "
        "lock database and run the guard again (bumping twice is safe)"
    )


# --- resource stores: watermarks ---------------------------------------------------


def raise_fences(
    *,
    apply: bool,
    batch_size: int = 1000,
    using: str | None = None,
    report: RestoreReport | None = None,
    pending_bump: int = 0,
    say: Say = _quiet,
    progress: Say = _quiet,
) -> RestoreReport:
    """Raise every watermark to its lock's last issued token, closed, then end every lease.

    The last issued token is the lock's counter, or the token floor where that is
    higher: no key is issued a token at or below the floor any more, and a key
    first granted after the lock database's backup has no counter to go by.

    Covers the Fence rows (and with them the fenced document store) and each
    concrete :class:`~coordination.fencing.FencedModel` whose ``fence_lock``
    template names concrete fields (``"account:{pk}"``, ``"invoice:{customer}"``):
    the key is computed per row. Rows whose values cannot form their key (a
    value with ``:``) cannot be written by any grant anyway; they are counted in
    ``rows_unsupported``. A watermark already above its lock's last issued token
    is left alone and listed in ``ahead_of_lock``: the lock database is behind
    and needs a bump. Never lowers a watermark; a second run changes nothing.

    ``pending_bump`` is for a dry run after a dry-run bump: it plans against the
    counters as they will be once the bump is applied (and the leases it revokes).
    """
    alias = using or app_settings.DATABASE
    report = report or RestoreReport(applied=apply)
    ahead = 0 if apply else pending_bump
    floor = TokenFloor.objects.using(alias).value() + ahead
    _raise_fence_rows(alias, apply, batch_size, ahead, floor, report, say, progress)
    for model in fenced_models():
        _raise_model_rows(model, alias, apply, batch_size, ahead, floor, report, say, progress)
    if not ahead:
        revoke_leases(apply=apply, using=alias, report=report, say=say)
    return report


def revoke_leases(
    *, apply: bool, using: str | None = None, report: RestoreReport | None = None, say: Say = _quiet
) -> RestoreReport:
    """End the current lease of every lock (held or expired), through ``locks.revoke``."""
    alias = using or app_settings.DATABASE
    report = report or RestoreReport(applied=apply)
    held = Lock.objects.using(alias).exclude(holder="")
    # A list, not a cursor: each revoke is a transaction of its own.
    for key, token, holder in list(held.order_by("pk").values_list("key", "token", "holder")):
        if apply and locks.revoke(key, using=alias) is None:
            continue  # released meanwhile
        say(f"lock {key!r}: revoking the lease of {holder} (token {token})")
        report.leases_revoked += 1
    return report


def fenced_models() -> list[type[models.Model]]:
    """The installed concrete FencedModel subclasses."""
    return [
        model for model in apps.get_models()
        if issubclass(model, FencedModel) and not model._meta.abstract
    ]


def _raise_fence_rows(
    alias: str,
    apply: bool,
    batch_size: int,
    ahead: int,
    floor: int,
    report: RestoreReport,
    say: Say,
    progress: Say,
) -> None:
    rows = Fence.objects.using(alias)
    total = rows.count()
    seen = 0
    for batch in _batches(rows.values_list("pk", "resource", "lock_key", "token", "step"), batch_size):
        issued = _issued_tokens({lock_key for _pk, _res, lock_key, *_ in batch}, alias, ahead)
        for _pk, resource, lock_key, token, step in batch:
            last = max(issued.get(lock_key, 0), floor)
            if token > last:
                report.ahead_of_lock.append(f"fence {resource!r}")
                say(
                    f"WARNING: fence {resource!r} has accepted token {token}, above lock "
                    f"{lock_key!r}'s last issued token {last}: the lock database is behind; "
                    "bump it"
                )
                continue
            if (token, step) >= (last, CLOSED_STEP) or last == 0:
                continue
            if apply and not raise_fence_to_lock(resource, step=CLOSED_STEP, using=alias).raised:
                continue  # raised by a newer write meanwhile
            say(f"fence {resource!r}: watermark {token} -> {last} (closed)")
            report.fences_raised += 1
        seen += len(batch)
        progress(f"fences: {seen}/{total} checked, {report.fences_raised} {_raised(apply)}")


def _raise_model_rows(
    model: type[models.Model],
    lock_alias: str,
    apply: bool,
    batch_size: int,
    ahead: int,
    floor: int,
    report: RestoreReport,
    say: Say,
    progress: Say,
) -> None:
    label = model._meta.label_lower
    template: str = getattr(model, "fence_lock", "")
    names = PLACEHOLDER.findall(template)
    columns = _template_columns(model, names)
    if columns is None:
        report.rows_unsupported[label] = model._base_manager.count()
        say(f"WARNING: {label}: fence_lock {template!r} does not name concrete fields; skipped")
        return
    alias = router.db_for_write(model)
    rows = model._base_manager.using(alias)
    total = rows.count()
    seen = 0
    raised = 0
    for batch in _batches(rows.values_list("pk", "fence", "fence_step", *columns), batch_size):
        keys: dict[Any, str] = {}
        for pk, _fence, _step, *values in batch:
            key = _row_key(model, template, dict(zip(names, values, strict=True)))
            if key is None:
                report.rows_unsupported[label] = report.rows_unsupported.get(label, 0) + 1
            else:
                keys[pk] = key
        issued = _issued_tokens(set(keys.values()), lock_alias, ahead)
        plan: list[tuple[Any, int]] = []
        for pk, fence, step, *_values in batch:
            if pk not in keys:
                continue  # counted in rows_unsupported
            last = max(issued.get(keys[pk], 0), floor)
            if fence > last:
                report.ahead_of_lock.append(f"{label}:{pk}")
                say(
                    f"WARNING: {label}:{pk} has accepted token {fence}, above lock "
                    f"{keys[pk]!r}'s last issued token {last}: the lock database is behind; "
                    "bump it"
                )
            elif last and (fence, step) < (last, CLOSED_STEP):
                plan.append((pk, last))
                say(f"{label}:{pk}: fence {fence} -> {last} (closed)")
        if apply and plan:
            with transaction.atomic(using=alias):
                for pk, last in plan:
                    # The same rule as a fenced write: never below what is there.
                    below = Q(fence__lt=last) | Q(fence=last, fence_step__lt=CLOSED_STEP)
                    raised += rows.filter(below, pk=pk).update(fence=last, fence_step=CLOSED_STEP)
        elif not apply:
            raised += len(plan)
        seen += len(batch)
        progress(f"{label}: {seen}/{total} rows checked, {raised} {_raised(apply)}")
    if raised:
        report.rows_raised[label] = raised


def _raised(apply: bool) -> str:
    return "raised" if apply else "to raise"


def _template_columns(model: type[models.Model], names: list[str]) -> list[str] | None:
    """The columns to read for each placeholder of ``fence_lock``, or None if one is not a column."""
    columns = []
    for name in names:
        if name == "pk":
            columns.append("pk")
            continue
        try:
            found = model._meta.get_field(name)
        except FieldDoesNotExist:
            return None
        if not getattr(found, "concrete", False) or getattr(found, "many_to_many", False):
            return None
        columns.append(found.attname)  # type: ignore[union-attr]
    return columns


def _row_key(model: type[models.Model], template: str, values: dict[str, Any]) -> str | None:
    """The lock key that guards a row, if the row's values can form one.

    Checked against the template's own parser, so the key is exactly the one
    whose grant ``fenced_update`` lets write this row.
    """
    key = PLACEHOLDER.sub(lambda placeholder: str(values[placeholder.group(1)]), template)
    try:
        binding = lock_binding(model, key)
    except (CoordinationError, re.error):
        return None
    if binding != {name: str(value) for name, value in values.items()}:
        return None
    return key


def _issued_tokens(keys: set[str], alias: str, ahead: int = 0) -> dict[str, int]:
    """The last issued token of each key that has a lock row (plus a pending bump)."""
    if not keys:
        return {}
    found = Lock.objects.using(alias).filter(key__in=keys).values_list("key", "token")
    return {key: token + ahead for key, token in found}


def _batches(rows: models.QuerySet[Any, Any], size: int) -> Iterator[list[Any]]:
    """Rows (value tuples, pk first) in pk order, ``size`` at a time, each batch a fresh query.

    Keyset pagination: no transaction or cursor stays open between batches, so
    the service keeps running around the guard.
    """
    if size < 1:
        raise InvalidInput("the batch size must be at least 1")
    last = None
    while True:
        page = rows.order_by("pk")
        if last is not None:
            page = page.filter(pk__gt=last)
        batch = list(page[:size])
        if not batch:
            return
        yield batch
        last = batch[-1][0]
