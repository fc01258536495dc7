"""What the logs say about refused late writes and lost leases: what happened,
once, in words a reader can act on."""

from __future__ import annotations

import logging
from decimal import Decimal

import pytest

from coordination import locks
from coordination.contrib.execution import release_quietly
from coordination.exceptions import (
    RETIRED_STEP,
    DuplicateWrite,
    InTransaction,
    StaleToken,
    UnfencedWrite,
)
from project.demo.models import Account
from tests.support.factories import AccountFactory
from tests.support.waiting import wait_until_database_time_passes

pytestmark = pytest.mark.django_db(transaction=True)


def lines(caplog: pytest.LogCaptureFixture, logger: str) -> list[tuple[str, str]]:
    return [(r.levelname, r.getMessage()) for r in caplog.records if r.name == logger]


def test_an_error_built_with_its_default_detail_has_a_readable_repr() -> None:
    assert "transaction.atomic()" in repr(InTransaction())
    assert repr(InTransaction()).startswith("InTransaction(")
    assert repr(StaleToken("doc:1", 1, 2)) == "StaleToken('doc:1', 1, 2)"  # with args: as before


def test_a_lease_that_expired_and_was_taken_over_says_so_at_release(
    caplog: pytest.LogCaptureFixture,
) -> None:
    account = AccountFactory()
    old = locks.acquire(f"account:{account.pk}", holder="old", ttl=0.2)
    Account.objects.filter(pk=account.pk).fenced_update(old, balance=Decimal("1"))
    wait_until_database_time_passes(old.expires_at)
    newer = locks.acquire(f"account:{account.pk}", holder="new", ttl=30)

    with caplog.at_level(logging.INFO, logger="coordination.tasks"):
        release_quietly(old)
    locks.release(newer)

    [(level, message)] = lines(caplog, "coordination.tasks")
    assert level == "WARNING" and "ran past its lease" in message
    assert f'happened="expired, then taken over by token {newer.token}"' in message
    assert "released or revoked" not in message.split("detail=")[0]


def test_a_revoked_lease_says_revoked(caplog: pytest.LogCaptureFixture) -> None:
    account = AccountFactory()
    grant = locks.acquire(f"account:{account.pk}", holder="me", ttl=30)
    Account.objects.filter(pk=account.pk).fenced_update(grant, balance=Decimal("1"))
    locks.revoke(grant.key)

    with caplog.at_level(logging.INFO, logger="coordination.tasks"):
        release_quietly(grant)

    [(level, message)] = lines(caplog, "coordination.tasks")
    assert level == "WARNING" and "happened=revoked" in message


def test_a_lost_lease_without_a_fenced_write_is_no_warning(caplog: pytest.LogCaptureFixture) -> None:
    old = locks.acquire("job:quiet", holder="old", ttl=0.2)
    wait_until_database_time_passes(old.expires_at)
    newer = locks.acquire("job:quiet", holder="new", ttl=30)

    with caplog.at_level(logging.INFO, logger="coordination.tasks"):
        release_quietly(old)
    locks.release(newer)

    [(level, message)] = lines(caplog, "coordination.tasks")
    assert level == "INFO" and "made no fenced write" in message
    assert "ran past its lease" not in message


def test_a_re_created_rows_watermark_step_is_shown_as_retired(caplog: pytest.LogCaptureFixture) -> None:
    account = AccountFactory()
    grant = locks.acquire(f"account:{account.pk}", holder="old", ttl=30)
    Account.objects.filter(pk=account.pk).fenced_update(grant, balance=Decimal("1"))
    Account.objects.filter(pk=account.pk).delete()
    Account.objects.create(pk=account.pk, owner="again")

    with caplog.at_level(logging.WARNING, logger="coordination.fencing"), pytest.raises(DuplicateWrite):
        Account.objects.filter(pk=account.pk).fenced_update(grant, balance=Decimal("-1"))
    locks.release(grant)

    [(_, refused)] = lines(caplog, "coordination.fencing")
    assert "watermark_step=retired" in refused and str(RETIRED_STEP) not in refused
    assert "step retired" in str(UnfencedWrite("doc:1", 3, RETIRED_STEP))
