"""Fenced Celery tasks run in this process (``task.apply()`` and direct calls): the
parts of the decorator that need no worker. The same behaviour on real workers is
in tests/processes/test_celery_worker_processes.py; the keep-alive on its own is in
tests/concurrency/test_keepalive.py."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import pytest
from django.core.checks import run_checks
from django.test import override_settings

from coordination import locks, signals
from coordination.contrib.celery import fenced_task
from coordination.contrib.execution import release_quietly
from coordination.exceptions import InvalidInput, LockHeld
from coordination.models import Grant, GrantEnd, Lock
from coordination.semaphores import acquire_permit
from project.demo.models import Account
from tests.support.factories import AccountFactory
from tests.support.waiting import wait_until_database_time_passes

pytestmark = pytest.mark.django_db(transaction=True)


@fenced_task(lock="account:{account_id}", ttl=5, bind=True)
def add_twice(self: Any, account_id: int, amount: str = "1.00") -> dict[str, Any]:
    """Two writes under one execution's token: steps 1 and 2."""
    grant = self.grant
    seen = {
        "token": grant.token,
        "is_current": locks.current_grant() is grant,
        # The lease lives in a context variable, not on Celery's request.
        "request_untouched": not [name for name in vars(self.request) if "coordination" in name],
    }
    account = Account.objects.get(pk=account_id)
    Account.objects.filter(pk=account_id).fenced_update(balance=account.balance + Decimal(amount))
    Account.objects.filter(pk=account_id).fenced_update(balance=account.balance + 2 * Decimal(amount))
    return seen


@fenced_task(lock=lambda region, day="today": f"report:{region}:{day}", ttl=5)
def build_report(region: str, day: str = "today") -> str | None:
    grant = locks.current_grant()
    return grant.key if grant else None


@fenced_task(lock="report:{region}:{day}", ttl=5)
def build_report_by_template(region: str, *, day: str = "today", **extra: Any) -> str | None:
    grant = locks.current_grant()
    return grant.key if grant else None


@fenced_task(lock="account:{account_id}", ttl=5, on_busy="skip")
def skip_when_busy(account_id: int) -> str:
    return "ran"


@fenced_task(lock="account:{account_id}", ttl=5, on_busy="raise")
def raise_when_busy(account_id: int) -> str:
    return "ran"


@fenced_task(lock="account:{account_id}", ttl=5, on_busy="retry", max_retries=0)
def retry_when_busy(account_id: int) -> str:
    return "ran"


@fenced_task(lock="account:{account_id}", ttl=5)
def fails(account_id: int) -> None:
    raise ValueError("the body failed")


def test_each_execution_takes_a_new_grant_exposes_it_and_releases_it() -> None:
    account = AccountFactory(balance=Decimal("10.00"))

    first = add_twice.apply(args=(account.pk,)).get()
    second = add_twice.apply(args=(account.pk,)).get()

    assert first == {"token": 1, "is_current": True, "request_untouched": True}
    assert second == {"token": 2, "is_current": True, "request_untouched": True}
    grants = Grant.objects.filter(lock__key=f"account:{account.pk}").order_by("token")
    assert [g.end_reason for g in grants] == [GrantEnd.RELEASED, GrantEnd.RELEASED]
    refreshed = Account.objects.get(pk=account.pk)
    assert (refreshed.balance, refreshed.fence, refreshed.fence_step) == (Decimal("14.00"), 2, 2)


def test_grant_is_reset_after_the_task_so_it_never_leaks() -> None:
    account = AccountFactory()
    add_twice.apply(args=(account.pk,))
    add_twice(account.pk)  # a direct call runs fenced too

    assert locks.current_grant() is None
    assert add_twice.grant is None
    assert Lock.objects.get(key=f"account:{account.pk}").holder == ""


def test_lock_key_comes_from_a_callable_or_a_template_over_the_arguments() -> None:
    assert build_report.apply(args=("eu",)).get() == "report:eu:today"
    assert build_report.apply(args=("eu",), kwargs={"day": "mon"}).get() == "report:eu:mon"
    assert build_report_by_template.apply(args=("us",)).get() == "report:us:today"
    assert build_report_by_template.apply(args=("us",), kwargs={"day": "tue", "x": 1}).get() == (
        "report:us:tue"
    )


def test_a_key_the_arguments_cannot_build_fails_with_invalid_input() -> None:
    result = build_report_by_template.apply(args=("bad key!",))
    assert isinstance(result.result, InvalidInput)


def test_declaring_a_fenced_task_checks_its_options() -> None:
    with pytest.raises(InvalidInput):
        fenced_task(lock="x:{a}", on_busy="wait")
    with pytest.raises((InvalidInput, TypeError)):
        fenced_task(lock=None)  # type: ignore[arg-type]
    for concurrency in (0, -1, 1001, True, 1.5):
        with pytest.raises(InvalidInput):
            fenced_task(lock="x:{a}", concurrency=concurrency)  # type: ignore[arg-type]


@fenced_task(lock="export:{name}", ttl=5, concurrency=2, on_busy="skip")
def capped(name: str) -> str | None:
    grant = locks.current_grant()
    return grant.key if grant else None


def test_concurrency_runs_under_a_permit_and_skips_when_all_permits_are_held() -> None:
    ran = capped.apply(args=("nightly",)).get()
    held = [
        acquire_permit("export:nightly", limit=2, holder=f"holder {n}", ttl=30) for n in (1, 2)
    ]
    try:
        refused = capped.apply(args=("nightly",)).get()
    finally:
        for permit in held:
            locks.release(permit)

    assert ran in {"export:nightly@1", "export:nightly@2"}
    first = Grant.objects.filter(lock__key=ran).order_by("token").first()
    assert first is not None and first.end_reason == GrantEnd.RELEASED
    assert refused["coordination"] == "skipped"
    assert (refused["reason"], refused["key"]) == ("lock_held", "export:nightly")
    assert "all 2 permits" in refused["detail"]


def test_busy_lock_with_skip_returns_a_skipped_result_and_signals_it() -> None:
    account = AccountFactory()
    received: list[dict[str, Any]] = []

    def on_skipped(sender: Any, **kwargs: Any) -> None:
        received.append(kwargs)

    signals.task_skipped.connect(on_skipped)
    holder = locks.acquire(f"account:{account.pk}", holder="someone", ttl=30)
    try:
        result = skip_when_busy.apply(args=(account.pk,)).get()
    finally:
        signals.task_skipped.disconnect(on_skipped)
        locks.release(holder)

    assert result["coordination"] == "skipped"
    assert result["reason"] == "lock_held"
    assert result["key"] == f"account:{account.pk}"
    assert [r["reason"] for r in received] == ["lock_held"]
    assert Grant.objects.filter(lock__key=f"account:{account.pk}").count() == 1  # only the holder's


def test_busy_lock_with_raise_fails_with_lock_held_and_retry_gives_up_after_max_retries() -> None:
    account = AccountFactory()
    holder = locks.acquire(f"account:{account.pk}", holder="someone", ttl=30)
    try:
        raised = raise_when_busy.apply(args=(account.pk,))
        retried = retry_when_busy.apply(args=(account.pk,))
    finally:
        locks.release(holder)

    assert isinstance(raised.result, LockHeld)
    assert raised.result.holder == "someone"
    assert isinstance(retried.result, LockHeld)


def test_a_failing_body_still_releases_its_lease() -> None:
    account = AccountFactory()
    result = fails.apply(args=(account.pk,))

    assert isinstance(result.result, ValueError)
    grant = Grant.objects.get(lock__key=f"account:{account.pk}")
    assert grant.end_reason == GrantEnd.RELEASED


def test_release_at_the_end_never_releases_a_newer_holders_lease() -> None:
    old = locks.acquire("job:handover", holder="old", ttl=0.2)
    wait_until_database_time_passes(old.expires_at)
    newer = locks.acquire("job:handover", holder="new", ttl=30)

    release_quietly(old)  # logs, does not raise, does not touch the newer lease

    lock = Lock.objects.get(key="job:handover")
    assert (lock.holder, lock.token) == ("new", newer.token)
    locks.release(newer)


def test_checks_warn_about_eager_mode_and_green_pools() -> None:
    with override_settings(CELERY_TASK_ALWAYS_EAGER=True, CELERY_WORKER_POOL="gevent"):
        ids = {message.id for message in run_checks()}
    assert {"coordination.W010", "coordination.W011"} <= ids
    with override_settings(CELERY_TASK_ALWAYS_EAGER=False, CELERY_WORKER_POOL="prefork"):
        ids = {message.id for message in run_checks()}
    assert not {"coordination.W010", "coordination.W011"} & ids


# The checks only read DATABASES; no connection is opened under the override.
@pytest.mark.filterwarnings("ignore:Overriding setting DATABASES:UserWarning")
def test_a_worker_does_not_start_on_a_coordination_error_and_names_it() -> None:
    from coordination.contrib.celery import check_at_worker_start

    sqlite = {"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": "x.sqlite3"}}
    with override_settings(DATABASES=sqlite), pytest.raises(SystemExit) as stopped:
        check_at_worker_start()
    assert "coordination.E004" in str(stopped.value)
    assert '"transaction_mode": "IMMEDIATE"' in str(stopped.value)


def test_a_worker_starts_on_warnings_and_logs_them(caplog: pytest.LogCaptureFixture) -> None:
    from coordination.contrib.celery import check_at_worker_start

    with override_settings(CELERY_TASK_ALWAYS_EAGER=True):
        check_at_worker_start()
    assert "coordination.W010" in caplog.text
