"""Unique jobs: at most one execution of a key while queued, running, until it
succeeded, or for some seconds, decided by the database.

A :class:`~coordination.models.UniqueClaim` row per key names the execution
(its task id) that holds the key. A producer claims the key before it sends a
message (:func:`claim_enqueue`); a duplicate gets the holder's task id instead
and sends nothing. A worker claims it again when the execution starts, under
the execution's grant (:func:`claim_start`), so a duplicate that reaches a
worker anyway (a message sent around the check, a redelivery, two beats) is
told the holder's id and does not run its body.

Whether a claim still holds is decided on the database clock, never the
app's: it holds while ``holds_until`` is in the future (a message waiting to
start: at most ``COORDINATION["UNIQUE_QUEUED_FOR"]`` seconds plus its
countdown; or the N seconds of ``unique_for=N``), or while the running
execution's grant is live (not ended, not past its lease). So a worker killed
in the middle of a body never keeps the key: the claim ends with its lease.

A claim is taken in one transaction on the fenced-writes database: the key's
row locked (``SELECT ... FOR UPDATE``) and judged by a later statement, so the
judgement sees every grant committed before the lock was granted (a single
``UPDATE ... WHERE NOT EXISTS (grant)`` could judge by a snapshot older than
the row it waited for); a key without a row gets one by an INSERT that the
key's unique constraint decides between producers racing for it.
"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Callable
from typing import Any, Literal

from django.db import IntegrityError, transaction
from django.db.models import DateTimeField, Exists, ExpressionWrapper, OuterRef, Q

from .conf import app_settings
from .leases import Lease
from .logfields import LogFields
from .models import DatabaseNow, Grant, UniqueClaim, UniqueScope

__all__ = [
    "PENDING", "claim_enqueue", "claim_start", "end_claim", "holder_of", "holding", "name_claim", "prune",
    "release_enqueue", "requeue",
]

logger = logging.getLogger("coordination.tasks")

_Verdict = Literal["take", "keep", "delete", "duplicate"]
#: The beginning of the task id a producer claims with before its backend names
#: the message (``django.tasks`` backends choose the id in ``enqueue()``).
PENDING = "enqueue:"
#: Attempts at a claim when the row comes and goes between the INSERT and the lock.
_ATTEMPTS = 20


def _in(seconds: float) -> Any:
    """The database's clock plus ``seconds``."""
    return ExpressionWrapper(DatabaseNow() + dt.timedelta(seconds=seconds), output_field=DateTimeField())


def holding() -> Q:
    """Claims that hold now, by the database clock: within ``holds_until``, or
    under a live grant (not ended and not past its lease)."""
    live = Grant.objects.filter(
        lock__key=OuterRef("lock_key"), token=OuterRef("token"),
        ended_at__isnull=True, expires_at__gt=DatabaseNow(),
    )
    return Q(holds_until__gt=DatabaseNow()) | Q(Exists(live))


def holder_of(key: str, *, using: str | None = None) -> str | None:
    """The task id of the execution that holds ``key`` now, or None."""
    rows = UniqueClaim.objects.using(using or app_settings.DATABASE)
    return rows.filter(holding(), key=key).values_list("task_id", flat=True).first()


def _claim(
    key: str, alias: str, values: dict[str, Any] | None,
    decide: Callable[[UniqueClaim, bool], _Verdict],
) -> str | None:
    """Judge the row of ``key`` with ``decide(row, holds)`` under its row lock, or
    insert ``values`` if there is none (None: insert nothing); the holder's task
    id for a duplicate. A key's row outlives its claims, so the lock comes first."""
    rows = UniqueClaim.objects.using(alias)
    for _attempt in range(_ATTEMPTS):
        with transaction.atomic(using=alias):
            row = rows.select_for_update().filter(key=key).first()
            if row is not None:
                holds = rows.filter(holding(), pk=row.pk).exists()
                verdict = decide(row, holds)
                if verdict == "duplicate":
                    return row.task_id
                if verdict == "take" and values is not None:
                    rows.filter(pk=row.pk).update(**values)
                elif verdict == "delete":
                    rows.filter(pk=row.pk).delete()
                return None
        if values is None:
            return None
        try:
            with transaction.atomic(using=alias):
                rows.create(key=key, **values)
            return None
        except IntegrityError:
            pass  # another producer made the row meanwhile: judge it
    raise RuntimeError(f"unique key {key!r}: no claim after {_ATTEMPTS} attempts")


def claim_enqueue(
    key: str, *, task: str, task_id: str, scope: str, seconds: float | None = None,
    countdown: float = 0.0, using: str | None = None,
) -> str | None:
    """Claim ``key`` for the message ``task_id`` about to be sent: None if it is
    claimed (send it), else the task id of the execution holding the key (the
    duplicate is not sent).

    ``scope="running"`` claims nothing here (the key is held only by a running
    execution): the holder, if one runs, is returned. A message of the holder's
    own task id (a retry, a deferral) is never its own duplicate.
    """
    alias = using or app_settings.DATABASE
    if scope == UniqueScope.RUNNING:
        holder = holder_of(key, using=alias)
        return holder if holder is not None and holder != task_id else None
    if scope == UniqueScope.SECONDS:
        assert seconds is not None
        hold = seconds
    else:
        hold = float(app_settings.UNIQUE_QUEUED_FOR) + max(0.0, countdown)
    values = {
        "task": task[:255], "task_id": task_id, "scope": scope, "holds_until": _in(hold),
        "lock_key": "", "token": None, "claimed_at": DatabaseNow(),
    }

    def decide(row: UniqueClaim, holds: bool) -> _Verdict:
        if not holds:
            return "take"
        if row.task_id != task_id:
            return "duplicate"
        # Its own message sent again: a "for N seconds" window does not move;
        # a waiting one is held until the copy starts.
        return "keep" if scope == UniqueScope.SECONDS or row.token is not None else "take"

    return _claim(key, alias, values, decide)


def release_enqueue(key: str, *, task_id: str, using: str | None = None) -> None:
    """Give up the claim of a message that could not be sent. Never raises."""
    try:
        UniqueClaim.objects.using(using or app_settings.DATABASE).filter(
            key=key, task_id=task_id, token__isnull=True
        ).delete()
    except Exception as error:
        logger.warning("unique claim not released %s", LogFields(key=key, task_id=task_id, error=error))


def name_claim(key: str, *, pending: str, task_id: str, using: str | None = None) -> None:
    """The message claimed as ``pending`` was sent as ``task_id``: name the claim so.
    Never raises (a claim left pending ends at its bound)."""
    try:
        UniqueClaim.objects.using(using or app_settings.DATABASE).filter(
            key=key, task_id=pending, token__isnull=True
        ).update(task_id=task_id)
    except Exception as error:
        logger.warning("unique claim not named %s", LogFields(key=key, task_id=task_id, error=error))


def claim_start(
    key: str, *, task: str, task_id: str, scope: str, grant: Lease,
    seconds: float | None = None, using: str | None = None,
) -> str | None:
    """Claim ``key`` for the execution ``task_id`` starting under ``grant``: None
    if it may run its body, else the task id of the execution holding the key.

    - ``"queued"``: the message's own claim ends (it is running now); a claim
      of another message that still waits makes this one a duplicate.
    - ``"running"`` and ``"succeeded"``: the claim passes to this execution's
      grant and holds while its lease is live; held by another execution (a
      live grant, or a message of another id waiting), this one is a duplicate.
    - seconds: the window of ``seconds`` starts now if no message claimed it.
    """
    alias = using or app_settings.DATABASE
    values: dict[str, Any] | None
    if scope == UniqueScope.QUEUED:
        values = None
    elif scope == UniqueScope.SECONDS:
        assert seconds is not None
        values = {"holds_until": _in(seconds), "lock_key": "", "token": None}
    else:
        values = {"holds_until": None, "lock_key": grant.key, "token": grant.token}
    if values is not None:
        values.update(task=task[:255], task_id=task_id, scope=scope, claimed_at=DatabaseNow())

    def decide(row: UniqueClaim, holds: bool) -> _Verdict:
        # A claim still pending (its producer has not named it yet) is taken
        # as this message's own: the run cannot be told apart from it.
        mine = row.token is None and (row.task_id == task_id or row.task_id.startswith(PENDING))
        ours = row.lock_key == grant.key and row.token == grant.token
        if holds and not (mine or ours):
            return "duplicate"
        if scope == UniqueScope.QUEUED:
            return "delete"
        if scope == UniqueScope.SECONDS and holds:
            return "keep"
        return "take"

    return _claim(key, alias, values, decide)


def requeue(key: str, *, grant: Lease, countdown: float = 0.0, using: str | None = None) -> None:
    """An execution holding ``key`` under ``grant`` sends its retry: the claim
    holds again as a waiting message's, so the key stays taken between the
    attempts. Never raises."""
    try:
        UniqueClaim.objects.using(using or app_settings.DATABASE).filter(
            key=key, lock_key=grant.key, token=grant.token
        ).update(
            holds_until=_in(float(app_settings.UNIQUE_QUEUED_FOR) + max(0.0, countdown)),
            lock_key="", token=None,
        )
    except Exception as error:
        logger.warning("unique claim not kept %s", LogFields(key=key, token=grant.token, error=error))


def end_claim(key: str, *, grant: Lease, using: str | None = None) -> None:
    """End the claim of ``key`` held by the execution under ``grant`` (it
    succeeded, or failed for good). Never raises: the claim ends with the
    lease anyway."""
    try:
        UniqueClaim.objects.using(using or app_settings.DATABASE).filter(
            key=key, lock_key=grant.key, token=grant.token
        ).delete()
    except Exception as error:
        logger.warning("unique claim not ended %s", LogFields(key=key, token=grant.token, error=error))


def prune(*, older_than: float = 86400.0, using: str | None = None) -> int:
    """Delete the claims that no longer hold and were last claimed more than
    ``older_than`` seconds ago (database clock); the number deleted. A key's
    row is made again by its next claim. The age condition is the row's own,
    so a claim taken over while this runs (its ``claimed_at`` moved to now)
    is never deleted."""
    rows = UniqueClaim.objects.using(using or app_settings.DATABASE)

    def ended(queryset: Any) -> Any:
        return queryset.filter(claimed_at__lt=_in(-older_than)).exclude(holding())

    # The keys first (MySQL deletes from no subquery of the same table), judged
    # again by the DELETE itself.
    pks = list(ended(rows).values_list("pk", flat=True)[:10000])
    deleted, _ = ended(rows.filter(pk__in=pks)).delete()
    return int(deleted)
