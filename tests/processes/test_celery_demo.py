"""``manage.py coordination_demo`` as a user runs it: a process of its own that starts
two real ``celery worker`` processes, against this run's test database.

On PostgreSQL the broker is the real Redis of ``COORDINATION_TEST_REDIS_URL``; on
SQLite it is the embedded default (Celery's filesystem transport under
``COORDINATION_VAR_DIR``), the setup a new user gets from ``bin/run``.
"""

from __future__ import annotations

from decimal import Decimal
from pathlib import Path

import pytest

from coordination.models import Grant, GrantEnd, Rejection, RejectionReason
from project.demo.models import Account
from tests.support.demo import run_demo

pytestmark = pytest.mark.django_db(transaction=True)


def test_demo_rejects_the_paused_workers_late_write_and_keeps_the_newer_balance(tmp_path: Path) -> None:
    finished, result = run_demo(tmp_path)

    assert finished.returncode == 0, f"{finished.stdout}\n{finished.stderr}"
    assert [step["step"] for step in result["timeline"]] == ["t0", "t1", "t2", "t3", "t4"]
    for step in ("t0", "t1", "t2", "t3", "t4"):
        assert f"\n{step}  +" in "\n" + finished.stdout
    token_a, token_b = result["tokens"]["A"], result["tokens"]["B"]
    assert token_b == token_a + 1
    offsets = [step["offset"] for step in result["timeline"]]
    assert offsets == sorted(offsets)
    assert offsets[3] >= result["lease_seconds"]  # B wrote after A's lease ended (database clock)
    assert result["timeline"][4]["outcome"] == "rejected"
    assert result["safe"] is True

    account = Account.objects.get(pk=result["account"])
    assert account.balance == Decimal("120.00")  # B's 100 + 20; A's 100 + 50 was refused
    assert account.fence == token_b
    key = f"account:{account.pk}"
    rejection = Rejection.objects.get(lock_key=key, token=token_a)
    assert (rejection.reason, rejection.watermark_token) == (RejectionReason.STALE, token_b)
    grants = {g.token: g for g in Grant.objects.filter(lock__key=key)}
    assert grants[token_a].end_reason == GrantEnd.EXPIRED
    assert grants[token_b].end_reason == GrantEnd.RELEASED
    assert grants[token_b].acquired_at >= grants[token_a].expires_at


@pytest.mark.legs("pg", reason="the negative control; the fenced demo above runs on every leg")
def test_demo_without_fencing_shows_the_late_write_clobbering_the_newer_one(tmp_path: Path) -> None:
    finished, result = run_demo(tmp_path, "--no-fencing")

    assert finished.returncode == 1, f"{finished.stdout}\n{finished.stderr}"
    assert "LOST UPDATE" in finished.stdout
    assert result["safe"] is False
    assert result["timeline"][4]["outcome"] == "accepted"
    account = Account.objects.get(pk=result["account"])
    assert account.balance == Decimal("150.00")  # A's stale 100 + 50 overwrote B's 120
    assert not Rejection.objects.filter(lock_key=f"account:{account.pk}").exists()
