"""The dashboard's reads: recent keys, counts, the contended keys, election roles,
and the writes marked on a timeline, each limited to what the viewer may see."""

from __future__ import annotations

import datetime as dt
from typing import Any, cast

from django.db.models import Count, QuerySet
from django.db.models.functions import TruncMinute

from ..access import UNRESTRICTED, Access
from ..conf import app_settings
from ..models import AcceptedWrite, Grant, Lock, LockQuerySet, Rejection
from .data import ContendedKey, Counts, RoleRow, Shown

HOUR = dt.timedelta(hours=1)
DAY = dt.timedelta(days=1)
TIMELINE_MARKS = 300
CONTENDED_KEYS = 10


def recent_keys(
    limit: int, *, using: str | None = None, access: Access = UNRESTRICTED
) -> list[str]:
    """The keys of the locks granted most recently, newest first (of those ``access`` reads)."""
    alias = using or app_settings.DATABASE
    keys: list[str] = []
    # The acquired_at index makes this a short scan, however long the history.
    granted = access.filter(Grant.objects.using(alias), "read", "lock__key")
    recent = granted.order_by("-acquired_at").values_list("lock__key", flat=True)
    for key in recent[: limit * 50]:
        if key not in keys:
            keys.append(key)
            if len(keys) == limit:
                break
    return keys


def _marks_and_axis(
    alias: str, keys: list[str], spans: list[tuple[Grant, dt.datetime, dt.datetime, str]],
    now: dt.datetime, shown: Shown,
) -> tuple[dt.datetime, dt.datetime, list[Rejection], list[AcceptedWrite]]:
    """The writes to mark (refused, and accepted when recorded; the newest
    :data:`TIMELINE_MARKS` of each that ``shown`` lets the viewer see) of the
    grants in ``spans`` on ``keys``, and the time axis that holds their bars
    and marks, with a little room on both sides so marks at the edges stay
    visible."""
    start = min((begin for _, begin, _, _ in spans), default=now - dt.timedelta(minutes=1))
    tokens = {grant.token for grant, _, _, _ in spans}
    refused = list(
        Rejection.objects.using(alias)
        .filter(lock_key__in=keys, token__in=tokens, created_at__gte=start)
        .order_by("-created_at")[:TIMELINE_MARKS]
    ) if shown.rejections else []
    accepted = list(
        AcceptedWrite.objects.using(alias)
        .filter(lock_key__in=keys, token__in=tokens, created_at__gte=start)
        .order_by("-created_at")[:TIMELINE_MARKS]
    ) if shown.accepted_writes else []
    end = max(
        [finish for _, _, finish, _ in spans]
        + [row.created_at for row in refused]
        + [row.created_at for row in accepted]
        + [start + dt.timedelta(seconds=1)]
    )
    pad = (end - start) * 0.03
    return start - pad, end + pad, refused, accepted


def _span(grant: Grant, now: dt.datetime) -> tuple[dt.datetime, dt.datetime, str]:
    """Where a grant's bar starts and ends, and why it ends there."""
    if grant.ended_at is not None:
        return grant.acquired_at, max(grant.ended_at, grant.acquired_at), grant.end_reason
    if grant.expires_at <= now:
        # Ran out, and nobody has released or taken the lock since.
        return grant.acquired_at, grant.expires_at, "expired-not-released"
    return grant.acquired_at, now, "live"


def _counts(now: dt.datetime, alias: str, shown: Shown) -> Counts:
    locks = cast(LockQuerySet, shown.keys(Lock.objects.using(alias), "key"))
    grants = shown.keys(Grant.objects.using(alias), "lock__key")
    rejections = shown.keys(Rejection.objects.using(alias), "lock_key")
    accepted = shown.keys(AcceptedWrite.objects.using(alias), "lock_key")
    recording = bool(app_settings.RECORD_WRITES)
    return Counts(
        held=locks.held().count(),
        expired=locks.expired().count(),
        free=locks.free().count(),
        grants_hour=grants.filter(acquired_at__gt=now - HOUR).count() if shown.grants else None,
        grants_day=grants.filter(acquired_at__gt=now - DAY).count() if shown.grants else None,
        refused_hour=(
            rejections.filter(created_at__gt=now - HOUR).count() if shown.rejections else None
        ),
        refused_day=(
            rejections.filter(created_at__gt=now - DAY).count() if shown.rejections else None
        ),
        accepted_hour=(
            accepted.filter(created_at__gt=now - HOUR).count()
            if recording and shown.accepted_writes
            else None
        ),
    )


def _per_minute(rows: QuerySet[Any], moment: str, since: dt.datetime) -> dict[dt.datetime, int]:
    """How many of ``rows`` have their ``moment`` in each minute from ``since`` (UTC)."""
    counted = (
        rows.filter(**{f"{moment}__gte": since})
        .annotate(minute=TruncMinute(moment, tzinfo=dt.UTC))
        .order_by()
        .values_list("minute")
        .annotate(n=Count("id"))
        .values_list("minute", "n")
    )
    return {
        minute.astimezone(dt.UTC).replace(second=0, microsecond=0): n for minute, n in counted
    }


def _contended(now: dt.datetime, alias: str, shown: Shown) -> list[ContendedKey]:
    """Keys with the most grants in the last hour, with their holders and refused writes."""
    since = now - HOUR
    rows = list(
        shown.keys(Grant.objects.using(alias), "lock__key")
        .filter(acquired_at__gt=since)
        .order_by()
        .values_list("lock__key", "lock_id")
        .annotate(grants=Count("id"), holders=Count("holder", distinct=True))
        .order_by("-grants", "lock__key")[:CONTENDED_KEYS]
    )
    refused = dict(
        Rejection.objects.using(alias)
        .filter(created_at__gt=since, lock_key__in=[key for key, *_ in rows])
        .order_by()
        .values_list("lock_key")
        .annotate(n=Count("id"))
        .values_list("lock_key", "n")
    ) if shown.rejections else {}
    return [
        ContendedKey(
            key, lock_id, grants, holders, refused.get(key, 0) if shown.rejections else None
        )
        for key, lock_id, grants, holders in rows
    ]


def _roles(now: dt.datetime, alias: str, shown: Shown, limit: int = 10) -> list[RoleRow]:
    """Election roles (locks ``election:<role>``) the viewer may read, most
    recently granted first."""
    rows = (
        shown.keys(Lock.objects.using(alias), "key").filter(key__startswith="election:")
        .annotate(terms=Count("grants")).order_by("-acquired_at")[:limit]
    )
    found = []
    for lock in rows:
        leading = bool(lock.holder) and lock.expires_at is not None and lock.expires_at > now
        found.append(RoleRow(
            role=lock.key.removeprefix("election:"), key=lock.key,
            leader=lock.holder if leading else "", term=lock.token,
            since=lock.acquired_at if leading else None, terms=getattr(lock, "terms", 0),
        ))
    return found


