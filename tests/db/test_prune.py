"""coordination_prune: old history goes, counters, watermarks and current leases stay."""

from __future__ import annotations

import datetime as dt
from io import StringIO
from typing import Any

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from coordination import locks, pruning
from coordination.exceptions import InvalidInput, StaleToken
from coordination.fencing import fence
from coordination.leases import Lease
from coordination.models import (
    AcceptedWrite,
    Fence,
    Grant,
    IdempotencyRecord,
    Lock,
    Rejection,
    RejectionReason,
    Ticket,
    TokenFloor,
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
    assert (
        "Deleted 0 grants, 0 rejections, 0 idempotency records, 0 accepted writes, 0 executions, "
        "0 unique claims, 0 rate starts, 0 locks"
        in out
    )


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


def test_prune_keeps_recently_made_lock_rows_and_every_fence() -> None:
    ended_grants("job:1", 2)
    FenceFactory(resource="mailbox-1", lock_key="job:1", token=2)
    age(Grant.objects.all(), "ended_at")
    age(Fence.objects.all(), "updated_at")

    prune("--older-than", "0s")

    assert Lock.objects.filter(key="job:1", token=2).exists()
    assert Fence.objects.filter(resource="mailbox-1", token=2).exists()


# --- lock rows unused for long ------------------------------------------------------


def unused_since(key: str, by: dt.timedelta = LONG_AGO) -> None:
    """Make ``key``'s lock row and its grants look ``by`` old."""
    age(Lock.objects.filter(key=key), "created_at", by)
    age(Grant.objects.filter(lock__key=key, ended_at__isnull=False), "ended_at", by)
    age(Grant.objects.filter(lock__key=key), "expires_at", by)


def test_an_unused_lock_row_goes_and_its_key_starts_above_its_last_token() -> None:
    old = ended_grants("old:1", 3)[-1]
    FenceFactory(resource="mailbox-1", lock_key="old:1", token=3)
    unused_since("old:1")

    out = prune("--older-than", "30d")

    assert not Lock.objects.filter(key="old:1").exists()
    assert not Grant.objects.filter(token__in=[1, 2, 3]).exists()
    assert "1 locks" in out
    assert TokenFloor.objects.value() >= old.token
    assert Fence.objects.filter(resource="mailbox-1", token=3).exists()
    # Granted again: above every token it ever had, so its fence takes the write.
    again = locks.acquire("old:1", holder="w", ttl=30)
    assert again.token > old.token
    with fence("mailbox-1", again):
        pass
    with pytest.raises(StaleToken), fence("mailbox-1", old):
        pass


def test_a_lease_left_to_expire_long_ago_counts_as_unused() -> None:
    left = locks.acquire("walked-away", holder="w", ttl=30)
    unused_since("walked-away")
    age(Lock.objects.filter(key="walked-away"), "expires_at")

    prune("--older-than", "30d")

    assert not Lock.objects.filter(key="walked-away").exists()
    assert locks.acquire("walked-away", holder="w", ttl=30).token > left.token


def test_locks_in_use_or_used_lately_stay() -> None:
    held = locks.acquire("held", holder="w", ttl=30)
    ended_grants("recent", 1)
    expired_lately = locks.acquire("expired-lately", holder="w", ttl=30)
    in_delay = locks.release(locks.acquire("in-delay", holder="w", ttl=30))
    queued = locks.release(locks.acquire("queued", holder="w", ttl=30))
    for key in ("held", "recent", "expired-lately", "in-delay", "queued"):
        age(Lock.objects.filter(key=key), "created_at")
    unused_since("in-delay")
    unused_since("queued")
    age(Lock.objects.filter(key="expired-lately"), "expires_at", dt.timedelta(days=1))
    age(Grant.objects.filter(lock__key="expired-lately"), "expires_at", dt.timedelta(days=1))
    age(Lock.objects.filter(key="in-delay"), "delay_until", -dt.timedelta(hours=1))
    Ticket.objects.create(
        lock_key="queued", holder="waiter", expires_at=locks.database_now() + dt.timedelta(hours=1)
    )

    prune("--older-than", "30d")

    assert set(Lock.objects.values_list("key", flat=True)) == {
        "held", "recent", "expired-lately", "in-delay", "queued",
    }
    assert (held.token, expired_lately.token, in_delay.token, queued.token) == (1, 1, 1, 1)
    locks.renew(held)


def test_an_expired_lease_in_its_lock_delay_stays() -> None:
    locks.acquire("delayed", holder="w", ttl=30, lock_delay=3600)
    unused_since("delayed")
    # Expired 40 days ago, but with a lock-delay of 50 days it is not over.
    age(Lock.objects.filter(key="delayed"), "expires_at")
    Lock.objects.filter(key="delayed").update(lock_delay=50 * 86400)

    prune("--older-than", "30d")

    assert Lock.objects.filter(key="delayed").exists()


def test_the_grant_history_kept_bounds_lock_pruning(settings: Any) -> None:
    settings.COORDINATION = {**settings.COORDINATION, "PRUNE_LOCKS_AFTER": 0}
    ended_grants("ten-days", 1)
    unused_since("ten-days", dt.timedelta(days=10))

    prune("--older-than", "30d")  # grants younger than 30 days are kept, so is their lock

    assert Lock.objects.filter(key="ten-days").exists()
    prune("--older-than", "5d")
    assert not Lock.objects.filter(key="ten-days").exists()


def test_prune_locks_after_is_the_lock_age(settings: Any) -> None:
    ended_grants("ten-days", 1)
    unused_since("ten-days", dt.timedelta(days=10))
    prune("--older-than", "1d")  # the default: 30 days unused
    assert Lock.objects.filter(key="ten-days").exists()

    settings.COORDINATION = {**settings.COORDINATION, "PRUNE_LOCKS_AFTER": 9 * 86400}
    prune("--older-than", "1d")
    assert not Lock.objects.filter(key="ten-days").exists()


def test_prune_locks_after_none_keeps_every_lock_row(settings: Any) -> None:
    settings.COORDINATION = {**settings.COORDINATION, "PRUNE_LOCKS_AFTER": None}
    ended_grants("old:1", 1)
    unused_since("old:1")

    out = prune("--older-than", "30d")

    assert Lock.objects.filter(key="old:1").exists()
    assert "locks" not in out


def test_lock_pruning_goes_in_batches_and_dry_run_counts() -> None:
    for number in range(5):
        ended_grants(f"old:{number}", 1)
        unused_since(f"old:{number}")
    ended_grants("new", 1)

    assert (
        "Would delete 0 grants, 0 rejections, 0 idempotency records, 0 accepted writes, 0 executions, "
        "0 unique claims, 0 rate starts, 5 locks"
        in prune("--older-than", "30d", "--dry-run")
    )
    assert Lock.objects.count() == 6

    out = prune("--older-than", "30d", "--batch-size", "2")

    assert list(Lock.objects.values_list("key", flat=True)) == ["new"]
    assert [line for line in out.splitlines() if line.startswith("locks:")] == [
        "locks: 2 deleted", "locks: 4 deleted", "locks: 5 deleted",
    ]
    assert locks.acquire("old:3", holder="w", ttl=30).token > 1


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


def test_executions_go_with_their_grants_history_never_while_their_lease_is_live() -> None:
    from coordination import jobs
    from coordination.models import Execution

    ended = locks.acquire("job:done", holder="w", ttl=60)
    jobs.record_execution("app.tasks.done", ended, task_id="1", attempt=1, worker="h:1")
    locks.release(ended)
    live = locks.acquire("job:running", holder="w", ttl=600)
    jobs.record_execution("app.tasks.long", live, task_id="2", attempt=1, worker="h:1")
    Execution.objects.update(started_at=locks.database_now() - dt.timedelta(days=40))

    out = prune("--older-than", "30d")

    assert "1 executions" in out
    assert list(Execution.objects.values_list("task", flat=True)) == ["app.tasks.long"]


def test_ended_unique_claims_go_and_a_holding_claim_stays_whatever_its_age() -> None:
    from coordination.models import UniqueClaim

    now = locks.database_now()
    UniqueClaim.objects.create(key="u:ended", task="t", task_id="1", scope="queued", holds_until=now)
    UniqueClaim.objects.create(
        key="u:waiting", task="t", task_id="2", scope="succeeded", holds_until=now + dt.timedelta(days=1)
    )
    live = locks.acquire("job:u", holder="w", ttl=600)
    UniqueClaim.objects.create(key="u:running", task="t", task_id="3", scope="running",
                               lock_key=live.key, token=live.token)
    age(UniqueClaim.objects.all(), "claimed_at")

    out = prune("--older-than", "30d")

    assert "1 unique claims" in out
    assert set(UniqueClaim.objects.values_list("key", flat=True)) == {"u:waiting", "u:running"}


def test_rate_starts_go_only_once_no_window_of_the_longest_period_counts_them() -> None:
    from coordination.models import RATE_PERIOD_MAX, RateBucket, RateStart

    bucket = RateBucket.objects.create(key="billing|7")
    now = locks.database_now()
    for hours in (2, 25):
        RateStart.objects.create(bucket=bucket, started_at=now - dt.timedelta(hours=hours))
    assert RATE_PERIOD_MAX == 86_400.0  # one day: the start of 2 hours ago may still count

    out = prune("--older-than", "1h")

    assert "1 rate starts" in out
    assert [round((now - start).total_seconds() / 3600) for start in
            RateStart.objects.values_list("started_at", flat=True)] == [2]
