"""A fenced task that retries ends its own lease before the retry message goes out,
so the retry (``countdown=0`` on another worker process, say) never finds the lock
held by the execution that sent it. Retrying under real workers is in
tests/processes/test_celery_worker_processes.py; here, what ``retry()`` does in the process.
"""

from __future__ import annotations

from typing import Any

import pytest

from coordination import locks
from coordination.contrib.celery import fenced_task
from coordination.models import Grant, GrantEnd, Lock

pytestmark = pytest.mark.django_db(transaction=True)


@fenced_task(lock="retry:{name}", ttl=30, bind=True, on_busy="raise", max_retries=1)
def retries_once(self: Any, name: str) -> list[int]:
    tokens = [self.grant.token]
    if self.request.retries == 0:
        raise self.retry(countdown=0)
    return tokens


@fenced_task(
    lock="retry:{name}", ttl=30, bind=True, on_busy="raise", autoretry_for=(ValueError,),
    max_retries=1, default_retry_delay=0, retry_backoff=False, retry_jitter=False,
)
def autoretries_once(self: Any, name: str) -> int:
    if self.request.retries == 0:
        raise ValueError("first attempt fails")
    return int(self.grant.token)


@fenced_task(lock="retry:{name}", ttl=30, bind=True, max_retries=1)
def looks_at_its_lease_after_retry(self: Any, name: str) -> dict[str, Any]:
    self.retry(countdown=60, throw=False)  # returns once the retry is sent
    grant = Grant.objects.get(lock__key=f"retry:{name}", token=self.grant.token)
    return {"holder": Lock.objects.get(key=f"retry:{name}").holder, "end_reason": grant.end_reason}


def test_retry_has_ended_the_lease_by_the_time_it_returns() -> None:
    result = looks_at_its_lease_after_retry.apply(("weekly",))

    assert result.get() == {"holder": "", "end_reason": GrantEnd.RELEASED}
    # The end of the execution does not release a second time (nor warn about it).
    assert Grant.objects.get(lock__key="retry:weekly").end_reason == GrantEnd.RELEASED


@pytest.mark.parametrize("task", [retries_once, autoretries_once], ids=["self.retry", "autoretry_for"])
def test_each_retry_runs_under_a_new_token_after_the_previous_lease_ended(task: Any) -> None:
    result = task.apply(("nightly",))

    assert result.successful(), result.traceback
    grants = list(Grant.objects.filter(lock__key="retry:nightly").order_by("token"))
    assert [g.token for g in grants] == [1, 2]
    assert [g.end_reason for g in grants] == [GrantEnd.RELEASED, GrantEnd.RELEASED]
    assert grants[0].ended_at <= grants[1].acquired_at
    assert locks.current_grant() is None
