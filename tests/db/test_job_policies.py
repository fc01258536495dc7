"""Job policies read by each fenced execution, in this process: pause, cap, overrides,
the cache's bound, the record of changes. The same on real workers (deferral
through the broker, overlap under a cap) is in tests/processes/test_job_policies.py."""

from __future__ import annotations

import threading
import time
from decimal import Decimal
from typing import Any

import pytest
from django.db import connections

from coordination import jobs, locks, signals
from coordination.contrib.celery import fenced_task
from coordination.contrib.execution import FencedExecution, Skipped, current_execution
from coordination.exceptions import InvalidInput, LeaseLost, LockHeld, StaleToken
from coordination.fencing import fence
from coordination.models import (
    Fence,
    Grant,
    GrantEnd,
    JobPolicy,
    JobPolicyChange,
    JobTally,
    Lock,
    validate_task_pattern,
)
from coordination.semaphores import acquire_permit
from project.demo.models import Account
from tests.support.factories import AccountFactory
from tests.support.waiting import wait_for

pytestmark = pytest.mark.django_db(transaction=True)

ran: list[str] = []


@pytest.fixture(autouse=True)
def fresh_policies(uncached_policies: None) -> None:
    ran.clear()
    if HAS_DJANGO_TASKS:
        leases.clear()


@fenced_task(lock="report:{name}", ttl=5, on_busy="raise")
def report(name: str) -> str:
    ran.append(name)
    grant = locks.current_grant()
    assert grant is not None
    return f"{grant.key}#{grant.token}"


def in_thread(target: Any) -> threading.Thread:
    """Run ``target`` in a thread of its own that closes its database connection."""

    def run() -> None:
        try:
            target()
        finally:
            connections.close_all()

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def policy(task: str = report.name, **fields: Any) -> JobPolicy:
    row = JobPolicy(task=task, **fields)
    row.save(changed_by="tester", via="test")
    return row


def test_without_a_policy_the_decorator_decides() -> None:
    assert report("a") == "report:a#1"
    assert ran == ["a"]


def test_a_paused_task_set_to_skip_runs_no_body_and_says_why() -> None:
    policy(paused=True, when_paused="skip")
    heard: list[str] = []

    def listen(sender: Any, reason: str, **kwargs: Any) -> None:
        heard.append(reason)

    signals.task_skipped.connect(listen)
    try:
        result = report("a")
    finally:
        signals.task_skipped.disconnect(listen)

    assert isinstance(result, Skipped) and result["reason"] == "paused"
    assert ran == [] and heard == ["paused"]
    assert not Grant.objects.exists()  # not even a grant: the lock was never asked for
    assert JobTally.objects.get(task=report.name, outcome="skipped").count == 1


def test_a_paused_task_called_in_process_waits_until_resumed_then_runs() -> None:
    """No message to send again (a direct call): the caller waits, the body runs after."""
    policy(paused=True, defer_seconds=0.1)
    done: list[Any] = []
    caller = in_thread(lambda: done.append(report("b")))
    deadline = time.monotonic() + 10
    while not JobTally.objects.filter(task=report.name, outcome="deferred").exists():
        assert time.monotonic() < deadline, "the paused call was never counted as deferred"
        time.sleep(0.02)
    time.sleep(0.3)
    assert ran == [] and caller.is_alive()  # still paused: no body

    jobs.resume(report.name, by="tester")
    caller.join(10)
    assert ran == ["b"] and done == ["report:b#1"]


def test_an_exact_policy_wins_over_a_pattern_and_a_longer_pattern_over_a_shorter() -> None:
    policy(task="tests.*", paused=True, when_paused="skip")
    assert isinstance(report("a"), Skipped)
    policy(task="tests.db.*", paused=False)
    assert report("a") == "report:a#1"
    policy(task=report.name, paused=True, when_paused="skip")
    assert isinstance(report("a"), Skipped)
    assert jobs.policy_for("tests.other") is not None and jobs.policy_for("other.x") is None


def test_max_running_takes_a_permit_beside_the_lock_and_busy_permits_follow_on_busy() -> None:
    policy(max_running=1, on_busy="skip")
    elsewhere = acquire_permit(jobs.permit_name(report.name), limit=1, holder="another run", ttl=30)

    result = report("c")

    assert isinstance(result, Skipped) and result["reason"] == "lock_held"
    assert ran == []
    # The key's own lock was given back when no permit was left.
    assert Lock.objects.get(key="report:c").holder == ""
    locks.release(elsewhere)
    assert report("c").startswith("report:c#")
    permit_grants = Grant.objects.filter(lock__key__startswith=f"task:{report.name}@")
    assert permit_grants.count() == 2
    assert {grant.end_reason for grant in permit_grants} == {GrantEnd.RELEASED}


def test_ttl_and_on_busy_overrides_replace_the_decorators() -> None:
    policy(ttl=17, on_busy="skip")
    seen: list[float] = []

    @fenced_task(lock="report:{name}", ttl=5, on_busy="raise", name=report.name + "_twin")
    def twin(name: str) -> None:
        grant = locks.current_grant()
        assert grant is not None
        seen.append((grant.expires_at - grant.acquired_at).total_seconds())

    policy(task=twin.name, ttl=17, on_busy="skip")
    twin("d")
    assert seen == [pytest.approx(17, abs=0.5)]

    held = locks.acquire("report:d", holder="someone", ttl=30)
    # The decorator says raise; the policy says skip.
    assert isinstance(twin("d"), Skipped)
    JobPolicy.objects.get(task=twin.name).delete()
    with pytest.raises(LockHeld):
        twin("d")
    locks.release(held)


def test_a_change_applies_once_the_cache_is_older_than_the_refresh(settings: Any) -> None:
    settings.COORDINATION = {**settings.COORDINATION, "JOB_POLICY_REFRESH": 0.5}
    row = policy(paused=False)
    assert report("e").startswith("report:e#")  # read and cached
    row.paused, row.when_paused = True, "skip"
    row.save()
    assert not isinstance(report("e"), Skipped)  # within the refresh: the old policy
    time.sleep(0.6)
    assert isinstance(report("e"), Skipped)  # after it: the change applies


def test_every_change_is_recorded_with_who_before_and_after() -> None:
    row = policy(max_running=2)
    row.max_running = 3
    row.save(changed_by="operator", via="admin")
    row.save(changed_by="operator", via="admin")  # no change, no record
    row.delete(changed_by="cleaner", via="api")

    changes = list(JobPolicyChange.objects.filter(task=report.name).order_by("id"))
    assert [(c.changed_by, c.via, c.summary) for c in changes] == [
        ("tester", "test", "created"),
        ("operator", "admin", "max_running: 2 -> 3"),
        ("cleaner", "api", "deleted"),
    ]
    assert changes[1].before["max_running"] == 2 and changes[1].after["max_running"] == 3


def test_pause_and_revoke_ends_the_leases_of_running_executions() -> None:
    policy(max_running=2)
    entered, leave = threading.Event(), threading.Event()
    outcome: list[Any] = []

    @fenced_task(lock="report:{name}", ttl=5, name=report.name + "_long")
    def long(name: str) -> None:
        entered.set()
        leave.wait(20)
        grant = locks.current_grant()
        assert grant is not None
        outcome.append(grant)

    policy(task=long.name, max_running=2)
    runner = in_thread(lambda: long("f"))
    assert entered.wait(10)
    [running] = jobs.running(long.name)
    assert running.key == "report:f" and running.permit.startswith(f"task:{long.name}@")

    paused, revoked = jobs.pause(long.name, by="operator", revoke_running=True)

    assert paused.paused
    assert {grant.lock.key for grant in revoked} == {"report:f", running.permit}
    leave.set()
    runner.join(10)
    ends = Grant.objects.filter(holder=running.holder).values_list("end_reason", flat=True)
    assert set(ends) == {GrantEnd.REVOKED}
    assert jobs.running(long.name) == []


def test_pause_and_revoke_frees_the_cap_per_key_permit_at_once_and_refuses_its_late_write() -> None:
    """An execution holding its customer's only cap permit is paused and revoked: the
    slot is granted again at once (its 30 s lease is far from over), the next holder
    writes through it, and the paused copy's later write under the slot is refused."""
    entered, leave = threading.Event(), threading.Event()
    outcome: list[str] = []

    @fenced_task(lock="export:{customer}", ttl=30, name=report.name + "_capped")
    def capped(customer: str) -> None:
        execution = current_execution()
        assert execution is not None and execution.cap_permit is not None
        slot = execution.cap_permit
        with fence(f"exports:{customer}", slot):  # a resource its cap slot guards
            pass
        entered.set()
        leave.wait(20)
        try:
            with fence(f"exports:{customer}", slot):
                outcome.append("written")
        except (StaleToken, LeaseLost) as refused:
            outcome.append(refused.code)

    policy(task=capped.name, key_cap=1, cap_key="{customer}")
    runner = in_thread(lambda: capped("7"))
    assert entered.wait(10)
    [running] = jobs.running(capped.name)
    assert running.cap_permit == f"{jobs.cap_name(capped.name, '7')}@1"

    _, revoked = jobs.pause(capped.name, by="operator", revoke_running=True)

    assert {grant.lock.key for grant in revoked} == {"export:7", running.cap_permit}
    after = acquire_permit(jobs.cap_name(capped.name, "7"), limit=1, holder="the next copy", ttl=30)
    with fence("exports:7", after):
        pass
    leave.set()
    runner.join(20)
    assert outcome in (["stale_token"], ["lease_lost"])
    assert Fence.objects.get(resource="exports:7").token == after.token
    assert jobs.running(capped.name) == []


def test_pause_and_revoke_of_a_pattern_ends_the_executions_it_steers_only() -> None:
    """``billing.*`` paused and revoked: the running execution of a task the pattern
    steers is revoked; one whose own exact policy is in force keeps running."""
    entered, leave = threading.Event(), threading.Event()

    def holding(suffix: str) -> Any:
        @fenced_task(lock=f"{suffix}:{{n}}", ttl=30, name=f"{report.name}_p{suffix}")
        def body(n: int) -> None:
            entered.set()
            leave.wait(20)

        return body

    steered, own = holding("a"), holding("b")
    policy(task=f"{report.name}_p*", max_running=5)
    policy(task=own.name)
    runners = [in_thread(lambda: steered(1)), in_thread(lambda: own(1))]
    wait_for(lambda: len(jobs.running(steered.name) + jobs.running(own.name)) == 2, timeout=10,
             what="both executions running")

    _, revoked = jobs.pause(f"{report.name}_p*", by="operator", revoke_running=True)

    assert {grant.lock.key.partition("@")[0] for grant in revoked} == {"a:1", f"task:{steered.name}"}
    assert [run.key for run in jobs.running(own.name)] == ["b:1"]
    leave.set()
    for runner in runners:
        runner.join(20)


def test_a_lost_permit_marks_the_executions_grant_lost_so_its_writes_are_refused() -> None:
    """Another execution took the permit over (here: it was revoked, as the end of
    a paused holder's lease would let happen): the permit's keep-alive marks the
    key's grant lost too, and the body's next fenced write is refused."""
    account = AccountFactory()

    @fenced_task(lock="account:{account_id}", ttl=5, name=report.name + "_writer")
    def writer(account_id: int) -> str:
        execution = current_execution()
        assert execution is not None and execution.permit is not None
        locks.revoke(execution.permit.key)
        grant = locks.current_grant()
        assert grant is not None
        wait_for(lambda: grant.lost, timeout=15, what="the grant marked lost with its permit")
        try:
            Account.objects.filter(pk=account_id).fenced_update(balance=Decimal("99.00"))
        except LeaseLost:
            return "refused"
        return "written"

    policy(task=writer.name, max_running=1)
    assert writer(account.pk) == "refused"
    assert Account.objects.get(pk=account.pk).balance != Decimal("99.00")


def test_a_wait_for_a_permit_longer_than_the_lease_keeps_the_keys_lease_alive() -> None:
    """The key's lock is taken first; while the execution then waits for a permit
    (longer than its 5 s lease here), the key's lease is kept alive, so the body
    runs with a live grant, not one another execution could have taken."""
    seen: list[tuple[bool, float]] = []

    @fenced_task(lock="report:{name}", ttl=5, wait=30, name=report.name + "_patient")
    def patient(name: str) -> None:
        grant = locks.current_grant()
        assert grant is not None
        row = Grant.objects.get(lock__key=grant.key, token=grant.token)
        seen.append((grant.lost, (row.expires_at - locks.database_now()).total_seconds()))

    policy(task=patient.name, max_running=1)
    elsewhere = acquire_permit(jobs.permit_name(patient.name), limit=1, holder="another run", ttl=30)
    caller = in_thread(lambda: patient("j"))
    wait_for(lambda: Lock.objects.filter(key="report:j", holder__startswith=patient.name).exists(),
             timeout=10, what="the key's lock taken")
    time.sleep(5.5)  # the permit stays held for longer than the key's 5 s lease
    locks.release(elsewhere)
    caller.join(20)

    [(lost, lease_left)] = seen
    assert not lost and lease_left > 0


def test_task_names_follow_the_key_rule() -> None:
    for bad in ("", "has space", "a*b", "*", "x" * 200):
        with pytest.raises(InvalidInput):
            validate_task_pattern(bad)
    assert validate_task_pattern("billing.*") == "billing.*"


def test_an_execution_without_a_name_reads_no_policy() -> None:
    policy(task="report:*", paused=True, when_paused="skip")
    execution = FencedExecution("report:g", holder="direct", ttl=5)
    assert execution.run(lambda: "ran") == "ran"


# --- the django.tasks twin: the same mechanism -------------------------------------

try:
    from django.tasks import TaskResultStatus, task_backends
except ImportError:  # Django 5.2: no django.tasks
    HAS_DJANGO_TASKS = False
else:
    HAS_DJANGO_TASKS = True

needs_django_tasks = pytest.mark.skipif(not HAS_DJANGO_TASKS, reason="django.tasks is Django 6.0+")

if HAS_DJANGO_TASKS:
    from coordination.contrib import tasks as contrib_tasks

    @contrib_tasks.fenced_task(lock="report:{name}", ttl=5, on_busy="raise")
    def twin_report(name: str) -> str:
        ran.append(name)
        return name

    TWIN = f"{twin_report.func.__module__}.{twin_report.func.__qualname__}"


@needs_django_tasks
def test_the_django_tasks_twin_skips_a_paused_task_and_caps_it_like_celery() -> None:
    policy(task=TWIN, paused=True, when_paused="skip")
    result = twin_report.enqueue("h")
    assert result.status == TaskResultStatus.SUCCESSFUL
    assert result.return_value["reason"] == "paused" and ran == []

    JobPolicy.objects.get(task=TWIN).delete()
    policy(task=TWIN, max_running=1, on_busy="skip")
    elsewhere = acquire_permit(jobs.permit_name(TWIN), limit=1, holder="another run", ttl=30)
    assert twin_report.enqueue("h").return_value["reason"] == "lock_held"
    locks.release(elsewhere)
    assert twin_report.enqueue("h").return_value == "h" and ran == ["h"]


@needs_django_tasks
def test_the_django_tasks_twin_takes_a_cap_per_key_permit_like_celery() -> None:
    policy(task=TWIN, key_cap=1, cap_key="{name}", on_busy="skip")
    elsewhere = acquire_permit(jobs.cap_name(TWIN, "h"), limit=1, holder="another run", ttl=30)
    assert twin_report.enqueue("h").return_value["reason"] == "lock_held"
    assert twin_report.enqueue("i").return_value == "i"  # another key: a cap of its own
    locks.release(elsewhere)
    assert twin_report.enqueue("h").return_value == "h" and ran == ["i", "h"]


@needs_django_tasks
def test_the_django_tasks_twin_defers_a_paused_run_by_enqueueing_it_again(settings: Any) -> None:
    """On a backend that can run a task later, a paused run is enqueued again with
    ``run_after`` ``defer_seconds`` ahead, and says so in its result."""
    settings.TASKS = {"default": {"BACKEND": "django.tasks.backends.dummy.DummyBackend"}}
    policy(task=TWIN, paused=True, defer_seconds=30)

    outcome = twin_report.call("i")  # what the backend's worker does with the message

    assert outcome["coordination"] == "deferred" and ran == []
    [again] = task_backends["default"].results
    assert again.task.run_after is not None and again.args == ["i"]
    assert JobTally.objects.get(task=TWIN, outcome="deferred").count == 1


# --- async bodies: the same policy on the event loop ----------------------------------

if HAS_DJANGO_TASKS:

    @contrib_tasks.fenced_task(lock="report:{name}", ttl=5, on_busy="skip")
    async def async_report(name: str) -> str:
        ran.append(name)
        grant = locks.current_grant()
        assert grant is not None
        return f"{grant.key}#{grant.token}"

    ASYNC = f"{async_report.func.__module__}.{async_report.func.__qualname__}"

    leases: list[float] = []

    @contrib_tasks.fenced_task(lock="report:{name}", ttl=5)
    async def measured_lease(name: str) -> None:
        grant = locks.current_grant()
        assert grant is not None
        leases.append((grant.expires_at - grant.acquired_at).total_seconds())

    MEASURED = f"{measured_lease.func.__module__}.{measured_lease.func.__qualname__}"


@needs_django_tasks
def test_an_async_task_paused_to_skip_runs_no_body_and_is_tallied() -> None:
    policy(task=ASYNC, paused=True, when_paused="skip")

    outcome = async_report.call("a")

    assert outcome["reason"] == "paused" and ran == []
    assert JobTally.objects.get(task=ASYNC, outcome="skipped").count == 1


@needs_django_tasks
def test_an_async_task_deferred_by_its_policy_is_enqueued_again(settings: Any) -> None:
    """As the sync twin; the enqueue runs on the app's thread pool, where the
    dummy backend is another instance, so the test hears it by signal."""
    from django.tasks.signals import task_enqueued

    settings.TASKS = {"default": {"BACKEND": "django.tasks.backends.dummy.DummyBackend"}}
    policy(task=ASYNC, paused=True, defer_seconds=30)
    enqueued: list[Any] = []

    def heard(sender: Any, task_result: Any, **kwargs: Any) -> None:
        enqueued.append(task_result)

    task_enqueued.connect(heard)
    try:
        outcome = async_report.call("b")
    finally:
        task_enqueued.disconnect(heard)

    assert outcome["coordination"] == "deferred" and ran == []
    [again] = enqueued
    assert again.task.run_after is not None and again.args == ["b"]
    assert again.id in outcome["detail"]
    assert JobTally.objects.get(task=ASYNC, outcome="deferred").count == 1


@needs_django_tasks
def test_an_async_task_capped_by_max_running_skips_while_every_permit_is_held() -> None:
    policy(task=ASYNC, max_running=1)
    elsewhere = acquire_permit(jobs.permit_name(ASYNC), limit=1, holder="another run", ttl=30)

    busy = async_report.call("c")

    assert busy["reason"] == "lock_held" and ran == []
    assert JobTally.objects.get(task=ASYNC, outcome="skipped").count == 1
    locks.release(elsewhere)
    key_and_token = async_report.call("c")
    assert key_and_token.startswith("report:c#") and ran == ["c"]
    # The execution's permit was released with its grant: the next run gets it.
    assert async_report.call("c").startswith("report:c#") and ran == ["c", "c"]
    assert not Lock.objects.filter(key__startswith=jobs.permit_name(ASYNC), holder__gt="").exists()


@needs_django_tasks
def test_an_async_task_takes_the_ttl_override_of_its_policy() -> None:
    policy(task=MEASURED, ttl=42)

    measured_lease.call("e")

    assert len(leases) == 1 and 41 <= leases[0] <= 43  # the policy's 42 s, not the decorator's 5
