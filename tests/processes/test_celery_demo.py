"""``manage.py coordination_demo`` as a user runs it: a process of its own that starts
two real ``celery worker`` processes, against this run's test database.

On PostgreSQL the broker is the real Redis of ``COORDINATION_TEST_REDIS_URL``; on
SQLite it is the embedded default (Celery's filesystem transport under
``COORDINATION_VAR_DIR``), the setup a new user gets from ``bin/run``.

The task writes, with the same grant as the row, an outbox call (everywhere), a
Redis key (when the broker is Redis) and an S3 object (when the demo is given an
endpoint: moto's server here); each store refuses the paused worker on its own.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path

import pytest

from coordination.models import Grant, GrantEnd, OutboxCall, Rejection, RejectionReason
from project.demo.downstreams import Downstreams
from project.demo.models import Account
from tests.support.demo import run_demo

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def s3_endpoint(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A moto S3 server answering one request at a time (its conditional writes are
    then atomic), with the credentials the demo's workers take from the environment."""
    if not all(importlib.util.find_spec(name) for name in ("moto", "boto3", "storages", "redis")):
        pytest.skip("the [s3] and [redis] extras and moto")
    if not os.environ.get("COORDINATION_TEST_REDIS_URL"):
        pytest.skip("a Redis server: COORDINATION_TEST_REDIS_URL is not set")
    from tests.support.s3_server import s3_server

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
    with s3_server(serial=True) as endpoint:
        yield endpoint


def downstreams_of(result: dict[str, object], endpoint: str) -> Downstreams:
    stores = {"redis_url": os.environ["COORDINATION_TEST_REDIS_URL"],
              "s3": {"endpoint": endpoint, "bucket": "coordination-demo"},
              "run": str(result["downstreams_run"])}
    return Downstreams(stores, int(str(result["account"])))


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
    rejection = Rejection.objects.get(lock_key=key, token=token_a, resource=f"demo.account:{account.pk}")
    assert (rejection.reason, rejection.watermark_token) == (RejectionReason.STALE, token_b)
    grants = {g.token: g for g in Grant.objects.filter(lock__key=key)}
    assert grants[token_a].end_reason == GrantEnd.EXPIRED
    assert grants[token_b].end_reason == GrantEnd.RELEASED
    assert grants[token_b].acquired_at >= grants[token_a].expires_at
    # The outbox needs only the database: on every leg A's call is refused, B's recorded.
    outbox = result["downstreams"]["outbox"]
    assert outbox["safe"] and outbox["A"] == {"outcome": "rejected", "code": "stale_token"}, outbox
    assert [call.token for call in OutboxCall.objects.filter(lock_key=key)] == [token_b]
    if "redis" in result["downstreams"]:  # the Redis broker's: the key outlives the test database
        assert result["downstreams"]["redis"]["safe"], result["downstreams"]
        redis_url = os.environ["COORDINATION_TEST_REDIS_URL"]
        Downstreams({"redis_url": redis_url, "run": result["downstreams_run"]}, account.pk).cleanup()


@pytest.mark.legs("pg", reason="needs Redis and moto's S3 server; the outbox part runs on every leg above")
def test_demo_fences_the_row_object_redis_key_and_outbox_call_with_one_token(
    tmp_path: Path, s3_endpoint: str
) -> None:
    finished, result = run_demo(tmp_path, "--s3-endpoint", s3_endpoint)

    assert finished.returncode == 0, f"{finished.stdout}\n{finished.stderr}"
    assert result["safe"] is True
    token_a, token_b = result["tokens"]["A"], result["tokens"]["B"]
    assert set(result["downstreams"]) == {"object", "redis", "outbox"}, result["downstreams"]
    for store, said in result["downstreams"].items():
        assert said["B"] == {"outcome": "written"}, (store, said)
        assert said["A"] == {"outcome": "rejected", "code": "stale_token"}, (store, said)
        assert said["safe"], (store, said)
    assert "A's object refused: stale_token, redis refused: stale_token, outbox refused" in finished.stdout

    # Each store refused on its own: one Rejection per resource, each at B's token.
    pk = result["account"]
    stores = downstreams_of(result, s3_endpoint)
    refused = {r.resource: r for r in Rejection.objects.filter(lock_key=f"account:{pk}", token=token_a)}
    assert set(refused) == {
        f"demo.account:{pk}", stores.storage().resource(stores.object_name),
        f"redis:{stores.redis_key}", stores.outbox_resource,
    }
    assert {(r.reason, r.watermark_token) for r in refused.values()} == {(RejectionReason.STALE, token_b)}
    # And what each holds is B's balance, read here from the stores themselves.
    try:
        held = stores.final()
        assert held["object"] == held["redis"] == "120.00"
        assert held["outbox"] == [{"token": token_b, "balance": "120.00"}]
        assert stores.storage().watermark(stores.object_name).token == token_b
    finally:
        stores.cleanup()


@pytest.mark.legs("pg", reason="the negative control; the fenced demo above runs on every leg")
def test_demo_without_fencing_shows_the_late_write_clobbering_the_newer_one(
    tmp_path: Path, s3_endpoint: str
) -> None:
    finished, result = run_demo(tmp_path, "--no-fencing", "--s3-endpoint", s3_endpoint)

    assert finished.returncode == 1, f"{finished.stdout}\n{finished.stderr}"
    assert "LOST UPDATE" in finished.stdout
    assert result["safe"] is False
    assert result["timeline"][4]["outcome"] == "accepted"
    account = Account.objects.get(pk=result["account"])
    assert account.balance == Decimal("150.00")  # A's stale 100 + 50 overwrote B's 120
    assert not Rejection.objects.filter(lock_key=f"account:{account.pk}").exists()
    # The plain PUT and SET took A's stale balance too, and the relay has two calls to send.
    downstreams = result["downstreams"]
    assert downstreams["object"]["held"] == downstreams["redis"]["held"] == "150.00", downstreams
    assert len(downstreams["outbox"]["held"]) == 2
    assert not any(said["safe"] for said in downstreams.values())
    downstreams_of(result, s3_endpoint).cleanup()
