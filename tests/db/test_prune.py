"""coordination_prune: old history goes, counters, watermarks and current leases stay."""

from __future__ import annotations

import datetime as dt
from io import StringIO

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from coordination import locks, pruning
from coordination.exceptions import InvalidInput
from coordination.leases import Lease
from coordination.models import (
    AcceptedWrite,
    Fence,
    Grant,
    IdempotencyRecord,
    Lock,
    Rejection,
    RejectionReason,
)
from tests.support.factories import FenceFactory

pytestmark = pytest.mark.django_db

LONG_AGO = dt.timedelta(days=40)


def prune(*args: str) -> str:
    out = StringIO()
    call_command("coordination_prune", *args, stdout=out)
    return out.getvalue()


def age(rows: object, field: str, by: dt.timedelta = LONG_AGO) -> None:
    """Move rows back in database time, as if they were made ``by`` ago."""
    then = locks.database_now() - by
    rows.update(**{field: then})  # type: ignore[attr-defined]


def ended_grants(key: str, count: int) -> list[Lease]:
    grants = []
    for _ in range(count):
        grant = locks.acquire(key, holder="w", ttl=30)
        grants.append(locks.release(grant))
    return grants


def rejection(resource: str = "r") -> Rejection:
    return Rejection.objects.create(
        resource=resource, lock_key="k", token=1, reason=RejectionReason.STALE
    )


def test_prune_deletes_old_ended_grants_but_keeps_each_locks_latest() -> None:
    ended_grants("job:1", 3)
    age(Grant.objects.all(), "ended_at")

    out = prune("--older-than", "30d")

    assert list(Grant.objects.values_list("token", flat=True)) == [3]
    assert Lock.objects.get(key="job:1").token == 3
    assert "Deleted 2 grants" in out
    assert locks.acquire("job:1", holder="w", ttl=30).token == 4


def test_prune_never_deletes_a_current_lease() -> None:
    ended_grants("job:1", 1)
    held = locks.acquire("job:1", holder="w", ttl=30)
    age(Grant.objects.all(), "acquired_at")
    age(Grant.objects.filter(token=1), "ended_at")

    prune("--older-than", "1s")

    assert list(Grant.objects.values_list("token", flat=True)) == [held.token]
    locks.renew(held)


def test_prune_keeps_recent_history() -> None:
    ended_grants("job:1", 3)
    rejection()
    IdempotencyRecord.objects.create(key="k", result=1, completed=True)

    out = prune("--older-than", "30d")

    assert (Grant.objects.count(), Rejection.objects.count(), IdempotencyRecord.objects.count()) == (
        3, 1, 1,
    )
    assert "Deleted 0 grants, 0 rejections, 0 idempotency records, 0 accepted writes" in out


def test_prune_deletes_old_rejections_idempotency_records_and_accepted_writes() -> None:
    rejection(resource="old")
    rejection(resource="new")
    IdempotencyRecord.objects.create(key="old", result=1, completed=True)
    IdempotencyRecord.objects.create(key="new", result=2, completed=True)
    AcceptedWrite.objects.create(resource="old", lock_key="k", token=1)
    AcceptedWrite.objects.create(resource="new", lock_key="k", token=2)
    for model in (Rejection, AcceptedWrite):
        age(model.objects.filter(resource="old"), "created_at")
    age(IdempotencyRecord.objects.filter(key="old"), "created_at")

    prune("--older-than", "30d")

    assert list(Rejection.objects.values_list("resource", flat=True)) == ["new"]
    assert list(IdempotencyRecord.objects.values_list("key", flat=True)) == ["new"]
    assert list(AcceptedWrite.objects.values_list("resource", flat=True)) == ["new"]


def test_prune_never_deletes_lock_or_fence_rows() -> None:
    ended_grants("job:1", 2)
    FenceFactory(resource="mailbox-1", lock_key="job:1", token=2)
    age(Grant.objects.all(), "ended_at")
    age(Fence.objects.all(), "updated_at")

    prune("--older-than", "0s")

    assert Lock.objects.filter(key="job:1", token=2).exists()
    assert Fence.objects.filter(resource="mailbox-1", token=2).exists()


def test_prune_goes_in_batches_with_progress() -> None:
    for number in range(5):
        rejection(resource=f"r{number}")
    age(Rejection.objects.all(), "created_at")

    out = prune("--older-than", "30d", "--batch-size", "2")

    assert Rejection.objects.count() == 0
    assert [line for line in out.splitlines() if line.startswith("rejections:")] == [
        "rejections: 2 deleted", "rejections: 4 deleted", "rejections: 5 deleted",
    ]


def test_dry_run_counts_and_deletes_nothing() -> None:
    ended_grants("job:1", 3)
    rejection()
    age(Grant.objects.all(), "ended_at")
    age(Rejection.objects.all(), "created_at")

    out = prune("--older-than", "30d", "--dry-run")

    assert (Grant.objects.count(), Rejection.objects.count()) == (3, 1)
    assert "Would delete 2 grants, 1 rejections" in out


def test_age_is_measured_on_the_cutoff_not_rounded() -> None:
    rejection(resource="older")
    rejection(resource="younger")
    age(Rejection.objects.filter(resource="older"), "created_at", dt.timedelta(hours=13))
    age(Rejection.objects.filter(resource="younger"), "created_at", dt.timedelta(hours=11))

    prune("--older-than", "12h")

    assert list(Rejection.objects.values_list("resource", flat=True)) == ["younger"]


@pytest.mark.parametrize(
    ("text", "expected"),
    [("30d", dt.timedelta(days=30)), ("12h", dt.timedelta(hours=12)),
     ("90m", dt.timedelta(minutes=90)), ("45s", dt.timedelta(seconds=45))],
)
def test_ages_accept_s_m_h_d(text: str, expected: dt.timedelta) -> None:
    assert pruning.parse_age(text) == expected


@pytest.mark.parametrize("text", ["30", "30 days", "1w", "-1d", "1.5h", "d", ""])
def test_other_ages_are_a_clear_error(text: str) -> None:
    with pytest.raises(InvalidInput, match="s, m, h or d"):
        pruning.parse_age(text)
    with pytest.raises(CommandError, match="s, m, h or d"):
        prune(f"--older-than={text}")


def test_batch_size_below_one_is_an_error() -> None:
    with pytest.raises(CommandError, match="batch size"):
        prune("--older-than", "1d", "--batch-size", "0")
