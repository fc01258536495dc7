"""Prometheus metrics: counters follow the signals, gauges read the database, /metrics is private."""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Iterator
from decimal import Decimal
from typing import Any
from unittest import mock

import pytest
from django.db import DatabaseError
from django.test import Client, override_settings
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

import coordination.restore as restore
from coordination import locks, signals
from coordination.exceptions import DuplicateWrite, LeaseLost, StaleToken, WrongLock
from coordination.fencing import fence
from coordination.metrics import LockStateCollector
from coordination.models import Grant, Lock
from tests.support.factories import AccountFactory, LockFactory
from tests.support.waiting import wait_until_database_time_passes

pytestmark = pytest.mark.django_db

TOKEN = "scrape-secret-1234"


class Meter:
    """Reads metric samples as differences from when it was made: counters are process-wide."""

    def __init__(self) -> None:
        self.start: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        for family in REGISTRY.collect():
            for sample in family.samples:
                self.start[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value

    def __call__(self, name: str, **labels: str) -> float:
        now = REGISTRY.get_sample_value(name, labels) or 0.0
        return now - self.start.get((name, tuple(sorted(labels.items()))), 0.0)


@pytest.fixture
def meter() -> Iterator[Meter]:
    yield Meter()


def scrape(client: Client, **headers: str) -> dict[str, Any]:
    response = client.get("/metrics", headers=headers)
    assert response.status_code == 200, response.content
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(response.content.decode())
        for sample in family.samples
    }


# --- counters ----------------------------------------------------------------------------


def test_grants_releases_and_lease_durations_are_counted(meter: Meter) -> None:
    for _ in range(2):
        locks.release(locks.acquire("job:1", holder="w", ttl=30))

    assert meter("coordination_grants_total") == 2
    assert meter("coordination_releases_total") == 2
    assert meter("coordination_lease_duration_seconds_count") == 2
    assert meter("coordination_lease_duration_seconds_bucket", le="+Inf") == 2


def test_revocations_and_lost_leases_are_counted(meter: Meter) -> None:
    grant = locks.acquire("job:1", holder="w", ttl=30)
    locks.revoke("job:1")
    with pytest.raises(LeaseLost):
        locks.renew(grant)

    assert meter("coordination_revocations_total") == 1
    assert meter("coordination_releases_total") == 0
    assert meter("coordination_leases_lost_total") == 1


def test_fenced_writes_are_counted_by_outcome(meter: Meter) -> None:
    account = AccountFactory()
    old = locks.acquire(f"account:{account.pk}", holder="A", ttl=0.2)
    wait_until_database_time_passes(old.expires_at)
    new = locks.acquire(f"account:{account.pk}", holder="B", ttl=30)
    rows = type(account).objects.filter(pk=account.pk)

    rows.fenced_update(new, step=1, balance=Decimal("1"))
    with pytest.raises(StaleToken):
        rows.fenced_update(old, balance=Decimal("2"))
    with pytest.raises(DuplicateWrite):
        rows.fenced_update(new, step=1, balance=Decimal("3"))
    with fence("mailbox-1", new):
        pass  # a new fence: created guarded by the account's key
    other = locks.acquire("mailer:1", holder="C", ttl=30)
    with pytest.raises(WrongLock), fence("mailbox-1", other):
        pass
    old.mark_lost()
    with pytest.raises(LeaseLost):
        rows.fenced_update(old, balance=Decimal("4"))

    assert meter("coordination_fenced_writes_total", outcome="accepted") == 2
    assert meter("coordination_fenced_writes_total", outcome="stale_token") == 1
    assert meter("coordination_fenced_writes_total", outcome="duplicate_write") == 1
    assert meter("coordination_fenced_writes_total", outcome="wrong_lock") == 1
    assert meter("coordination_fenced_writes_total", outcome="lease_lost") == 1


def test_renewals_expiries_and_wait_follow_their_signals(meter: Meter) -> None:
    # The receivers' contract; the grant point sends these signals.
    grant = locks.acquire("job:1", holder="w", ttl=30)
    start = grant.acquired_at
    signals.lock_renewed.send(sender=Grant, grant=grant)
    signals.lock_expired.send(
        sender=Grant, key="job:1", token=grant.token, holder="w",
        acquired_at=start, expired_at=start + dt.timedelta(seconds=30),
    )
    signals.lock_acquired.send(sender=Grant, grant=grant, waited=0.25)

    assert meter("coordination_renewals_total") == 1
    assert meter("coordination_expiries_total") == 1
    assert meter("coordination_lease_duration_seconds_bucket", le="30.0") == 1
    # acquire() itself observed its (near zero) wait, then the 0.25 s sent above.
    assert meter("coordination_acquire_wait_seconds_count") == 2
    assert meter("coordination_acquire_wait_seconds_bucket", le="0.5") == 2
    assert meter("coordination_acquire_wait_seconds_bucket", le="0.1") == 1


# --- the scrape ----------------------------------------------------------------------


@override_settings(COORDINATION={"METRICS_PUBLIC": True})
def test_scrape_reports_lock_states_from_the_database(client: Client) -> None:
    locks.acquire("held:1", holder="w", ttl=30)
    expired = locks.acquire("expired:1", holder="w", ttl=0.1)
    LockFactory(key="free:1", token=41)
    restore.raise_floor_to(7)
    wait_until_database_time_passes(expired.expires_at)

    samples = scrape(client)

    assert samples[("coordination_locks", (("state", "held"),))] == 1
    assert samples[("coordination_locks", (("state", "expired"),))] == 1
    assert samples[("coordination_locks", (("state", "free"),))] == 1
    assert samples[("coordination_max_token", ())] == 41
    assert samples[("coordination_token_floor", ())] == 7
    assert samples[("coordination_database_up", ())] == 1
    assert ("coordination_grants_total", ()) in samples
    assert ("coordination_fenced_writes_total", (("outcome", "stale_token"),)) in samples


def test_scrape_survives_an_unreadable_lock_table() -> None:
    with mock.patch.object(Lock.objects, "using", side_effect=DatabaseError("gone")):
        families = {family.name: family for family in LockStateCollector().collect()}

    assert [sample.value for sample in families["coordination_database_up"].samples] == [0]
    assert "coordination_locks" not in families


@override_settings(COORDINATION={"METRICS_PUBLIC": True})
def test_scrape_speaks_openmetrics_when_asked(client: Client) -> None:
    response = client.get("/metrics", headers={"Accept": "application/openmetrics-text"})

    assert response["Content-Type"].startswith("application/openmetrics-text")
    assert response.content.decode().rstrip().endswith("# EOF")


# --- who may scrape ------------------------------------------------------------------


def test_anonymous_scrape_is_refused_by_default(client: Client) -> None:
    response = client.get("/metrics")

    assert response.status_code == 401
    assert response["WWW-Authenticate"] == 'Bearer realm="metrics"'
    # The refusal names the settings that let a scraper in.
    assert 'COORDINATION["METRICS_TOKEN"]' in response.content.decode()
    assert 'COORDINATION["METRICS_PUBLIC"] = True' in response.content.decode()


def test_staff_may_scrape(client: Client, django_user_model: Any) -> None:
    client.force_login(django_user_model.objects.create_user("operator", is_staff=True))

    assert client.get("/metrics").status_code == 200


def test_signed_in_non_staff_is_refused(client: Client, django_user_model: Any) -> None:
    client.force_login(django_user_model.objects.create_user("viewer"))

    assert client.get("/metrics").status_code == 403


@override_settings(COORDINATION={"METRICS_TOKEN": TOKEN})
def test_scraper_with_the_token_may_scrape(client: Client) -> None:
    assert scrape(client, Authorization=f"Bearer {TOKEN}")
    assert client.get("/metrics", headers={"Authorization": "Bearer wrong"}).status_code == 403


def test_a_bearer_token_is_refused_when_none_is_configured(client: Client) -> None:
    assert client.get("/metrics", headers={"Authorization": "Bearer "}).status_code == 403
    response = client.get("/metrics", headers={"Authorization": "Bearer x"})

    assert response.status_code == 403
    # Not "wrong token": the site has none, and the answer names the setting it lacks.
    assert "accepts no bearer token" in response.content.decode()
    assert 'set COORDINATION["METRICS_TOKEN"]' in response.content.decode()


@override_settings(COORDINATION={"METRICS_PUBLIC": True})
def test_metrics_accept_only_get(client: Client) -> None:
    assert client.post("/metrics").status_code == 405


# --- log lines -----------------------------------------------------------------------


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def fencing_log() -> Iterator[Records]:
    handler, logger = Records(), logging.getLogger("coordination.fencing")
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)


def test_a_refused_write_is_logged_as_key_value_and_structured_fields(fencing_log: Records) -> None:
    old = locks.acquire("mailer:1", holder="A", ttl=0.1)
    wait_until_database_time_passes(old.expires_at)
    new = locks.acquire("mailer:1", holder="B", ttl=30)
    with fence("mailbox-1", new):
        pass
    with pytest.raises(StaleToken), fence("mailbox-1", old):
        pass

    (record,) = [r for r in fencing_log.records if r.getMessage().startswith("write refused")]
    assert record.getMessage() == (
        f"write refused reason=stale_token resource=mailbox-1 key=mailer:1 token={old.token} "
        f"step=1 holder=A watermark_token={new.token} watermark_step=1"
    )
    assert record.coordination == {  # type: ignore[attr-defined]
        "event": "write_refused", "reason": "stale_token", "resource": "mailbox-1",
        "key": "mailer:1", "token": old.token, "step": 1, "holder": "A",
        "watermark_token": new.token, "watermark_step": 1,
    }


def test_grant_point_sends_the_signals_metrics_count() -> None:
    received: list[tuple[str, dict[str, object]]] = []

    def keep(name: str):  # type: ignore[no-untyped-def]
        def receiver(sender: object, **kwargs: object) -> None:
            received.append((name, kwargs))
        return receiver

    receivers = {
        "acquired": keep("acquired"), "renewed": keep("renewed"), "expired": keep("expired"),
    }
    signals.lock_acquired.connect(receivers["acquired"])
    signals.lock_renewed.connect(receivers["renewed"])
    signals.lock_expired.connect(receivers["expired"])
    try:
        first = locks.acquire("signals:1", holder="A", ttl=30)
        locks.renew(first, ttl=0.2)  # a renewal that shortens the lease, so it expires soon
        wait_until_database_time_passes(first.expires_at)
        second = locks.acquire("signals:1", holder="B", ttl=0.2)  # takes the expired lease over
        wait_until_database_time_passes(second.expires_at)
        with pytest.raises(LeaseLost):
            locks.release(second)  # too late: recorded as expired
    finally:
        for name, signal in (
            ("acquired", signals.lock_acquired), ("renewed", signals.lock_renewed),
            ("expired", signals.lock_expired),
        ):
            signal.disconnect(receivers[name])

    names = [name for name, _ in received]
    assert names == ["acquired", "renewed", "expired", "acquired", "expired"]
    assert all(isinstance(kw["waited"], float) for name, kw in received if name == "acquired")
    takeover, late_release = (kw for name, kw in received if name == "expired")
    assert (takeover["key"], takeover["token"]) == ("signals:1", first.token)
    assert (takeover["holder"], takeover["acquired_at"]) == ("A", first.acquired_at)
    assert takeover["expired_at"] == first.expires_at  # as renewed
    assert (late_release["token"], late_release["holder"]) == (second.token, "B")
    assert late_release["expired_at"] == second.expires_at
