"""Fenced Celery tasks on real ``celery worker`` processes, a real Redis broker and
the real test database: pauses with SIGSTOP, kills with SIGKILL, redelivery by
Redis's visibility timeout. Each test checks the rule it names over what the
workers reported and what the database holds."""

from __future__ import annotations

import datetime as dt
import os
import signal
import time
from collections.abc import Callable
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from coordination import locks
from coordination.exceptions import LockHeld
from coordination.models import Grant, GrantEnd, Lock, Rejection, RejectionReason
from coordination.semaphores import acquire_permit
from project.demo.models import Account
from tests.support import celery_worker_tasks as tasks
from tests.support.celery_workers import (
    RedisBroker,
    Worker,
    events,
    publish,
    start_worker,
    unique,
    wait_for_event,
    wait_ready,
    wait_until_workers_disconnect,
)
from tests.support.factories import AccountFactory
from tests.support.pausing import paused
from tests.support.waiting import wait_for, wait_until_database_time_passes

# Real workers on a Redis broker, paused and killed: on SQLite a paused worker that
# holds the database's one write lock stops every other process, which is what the
# SQLite grant point documents, not what these tests are about. The SQLite leg runs
# the demo on real workers (tests/processes/test_celery_demo.py).
pytestmark = [
    pytest.mark.legs(
        "pg",
        reason="real workers paused and killed need a database with row locks;"
        " the LTS leg runs the first test",
    ),
    pytest.mark.django_db(transaction=True),
]


@pytest.fixture(scope="module")
def workers(start_workers: Callable[..., Worker]) -> dict[str, Worker]:
    """A solo, a prefork and a threads worker, each on a queue of its own."""
    started = {
        "solo": start_workers("solo", ready=False),
        "prefork": start_workers("prefork", pool="prefork", concurrency=2, ready=False),
        "threads": start_workers("threads", pool="threads", concurrency=2, ready=False),
    }
    wait_ready(started.values())
    return started


def balance(account: Account) -> Decimal:
    return Account.objects.get(pk=account.pk).balance


@pytest.mark.legs("pg", "lts", reason="real workers paused and killed need a database with row locks")
def test_sigstop_timeline_late_worker_is_rejected_and_newer_balance_stays(
    workers: dict[str, Worker], broker: RedisBroker, tmp_path: Path
) -> None:
    """The seed's t0..t4 with real workers: A (token n) is stopped past its lease, B
    (n+1) writes, A resumes and its write with n is refused by the fence."""
    a, b = workers["solo"], workers["prefork"]
    account = AccountFactory(balance=Decimal("100.00"))
    report = tmp_path / "events.jsonl"
    pause = tmp_path / "pause-a"
    pause.touch()

    publish(tasks.deposit_plain_lease, a.queue, broker, account.pk, "10",
         kwargs={"report": str(report), "pause_once": str(pause)})
    t0 = wait_for_event(report, lambda e: e["event"] == "acquired", workers=[a])
    with paused(t0["pid"]):  # t1: A stops, holding token n, having read 100
        wait_until_database_time_passes(dt.datetime.fromisoformat(t0["expires_at"]), margin=0.2)  # t2

        publish(tasks.deposit_plain_lease, b.queue, broker, account.pk, "50", kwargs={"report": str(report)})
        t3 = wait_for_event(report, lambda e: e["event"] == "written", workers=[b])
        assert t3["token"] == t0["token"] + 1
    # t4: A resumes
    (tmp_path / "pause-a.go").touch()
    late = wait_for_event(report, lambda e: e["event"] == "refused", workers=[a])

    assert late["token"] == t0["token"]
    assert late["code"] == "stale_token"
    assert balance(account) == Decimal("150.00")
    assert Account.objects.get(pk=account.pk).fence == t3["token"]
    rejection = Rejection.objects.get(token=t0["token"], lock_key=f"account:{account.pk}")
    assert rejection.reason == RejectionReason.STALE
    assert rejection.watermark_token == t3["token"]


def test_redelivered_copy_of_one_task_id_gets_its_own_token_and_only_the_newest_write_stands(
    tmp_path: Path, django_db_setup: None
) -> None:
    """Redis hands an unacknowledged task to another worker after its visibility
    timeout. Both copies share the task id but each holds its own grant, so the
    paused first copy cannot overwrite the redelivered one."""
    queue = unique("redelivery")
    broker = RedisBroker.fresh()  # its sweeps (8 s visibility) must not see other tests' messages
    pair = [
        # Redelivered once the paused copy's lease has run out (KEEPALIVE_TTL).
        start_worker(name, queue, tmp_path, broker=broker, COORDINATION_TEST_VISIBILITY_TIMEOUT="8")
        for name in ("redeliver-1", "redeliver-2")
    ]
    try:
        wait_ready(pair)
        account = AccountFactory(balance=Decimal("100.00"))
        report = tmp_path / "events.jsonl"
        pause = tmp_path / "pause-first-copy"
        pause.touch()
        task_id = unique("one-task-id")

        publish(tasks.deposit, queue, broker, account.pk, "10", task_id=task_id,
             kwargs={"report": str(report), "pause_once": str(pause)})
        first = wait_for_event(report, lambda e: e["event"] == "acquired", workers=pair)
        with paused(first["pid"]):
            second = wait_for_event(
                report, lambda e: e["event"] == "written", timeout=45, workers=pair
            )
        (tmp_path / "pause-first-copy.go").touch()
        late = wait_for_event(report, lambda e: e["event"] == "refused", workers=pair)
    finally:
        for worker in pair:
            worker.stop()
        broker.clean()
        wait_until_workers_disconnect()

    acquired = [e for e in events(report) if e["event"] == "acquired"]
    assert [e["task_id"] for e in acquired] == [task_id, task_id]
    assert acquired[1]["pid"] != first["pid"]
    assert second["token"] == first["token"] + 1
    assert late["token"] == first["token"]
    # Awake again, the first copy's keep-alive may notice first (lease_lost) or the
    # fence may refuse its write (stale_token): either way it is not applied.
    assert late["code"] in {"stale_token", "lease_lost"}
    assert balance(account) == Decimal("110.00")  # the second copy's 100 + 10
    assert Account.objects.get(pk=account.pk).fence == second["token"]


def test_keepalive_holds_its_lease_across_more_than_two_ttls(
    workers: dict[str, Worker], broker: RedisBroker, tmp_path: Path
) -> None:
    worker = workers["solo"]
    account = AccountFactory(balance=Decimal("100.00"))
    report = tmp_path / "events.jsonl"
    hold = 2 * tasks.KEEPALIVE_TTL + 1
    publish(tasks.deposit, worker.queue, broker, account.pk, "5",
         kwargs={"report": str(report), "hold": hold})
    started = wait_for_event(report, lambda e: e["event"] == "acquired", workers=[worker])
    key = f"account:{account.pk}"

    # Past the lease as first granted, by the database's clock: only renewals keep it.
    wait_until_database_time_passes(dt.datetime.fromisoformat(started["expires_at"]), margin=1.0)
    with pytest.raises(LockHeld):
        locks.acquire(key, holder="intruder", ttl=1)
    written = wait_for_event(report, lambda e: e["event"] == "written", timeout=60, workers=[worker])

    assert written["token"] == started["token"]
    wait_until_free(key)  # the release follows the body's last report
    grant = Grant.objects.get(lock__key=key, token=started["token"])
    assert grant.end_reason == GrantEnd.RELEASED
    assert (grant.ended_at - grant.acquired_at).total_seconds() >= hold
    renewed = [e for e in events(report) if e["event"] == "renewed"]
    assert len(renewed) >= hold / tasks.KEEPALIVE_TTL, renewed
    assert not [e for e in events(report) if e["event"] == "lease_lost"]
    assert balance(account) == Decimal("105.00")


def test_keepalive_thread_starts_only_for_a_body_still_running_when_its_renewal_nears(
    workers: dict[str, Worker], broker: RedisBroker, tmp_path: Path
) -> None:
    """A short body costs no thread (the keep-alive waits in the process's starter
    thread); a body still running a sixth of the ttl in gets its own keep-alive
    thread, which is gone once the task has ended; both leases are released."""
    worker = workers["solo"]
    report = tmp_path / "events.jsonl"
    name = unique("short")

    def threads_of(name: str, timeout: float = 30) -> dict[str, Any]:
        return wait_for_event(
            report, lambda e: e["event"] == "threads" and e["name"] == name,
            timeout=timeout, workers=[worker],
        )

    publish(tasks.keepalive_threads, worker.queue, broker, name, kwargs={"report": str(report)})
    short = threads_of(name)
    # The ttl is 30 s: the keep-alive's thread is due 5 s after the acquire, and
    # the body looked at once.
    assert short["own"] not in short["at_start"], short
    long_name = unique("long")
    publish(tasks.keepalive_threads, worker.queue, broker, long_name,
         kwargs={"report": str(report), "until_kept_alive": True})
    long = threads_of(long_name, timeout=90)
    assert long["own"] not in long["at_start"], long
    assert long["own"] in long["later"], long  # started while the body still ran
    assert "coordination-keepalive-starter" in long["later"], long
    after = unique("after")
    publish(tasks.keepalive_threads, worker.queue, broker, after, kwargs={"report": str(report)})
    assert long["own"] not in threads_of(after)["at_start"]  # stopped and joined at the end
    for key, token in ((f"threads:{name}", short["token"]), (f"threads:{long_name}", long["token"])):
        wait_until_free(key)
        assert Grant.objects.get(lock__key=key, token=token).end_reason == GrantEnd.RELEASED


def test_keepalive_marks_the_grant_lost_after_a_pause_past_its_lease_and_later_writes_fail(
    workers: dict[str, Worker], broker: RedisBroker, tmp_path: Path
) -> None:
    worker = workers["solo"]
    account = AccountFactory(balance=Decimal("100.00"))
    report = tmp_path / "events.jsonl"
    pause = tmp_path / "pause"
    pause.touch()
    publish(tasks.deposit, worker.queue, broker, account.pk, "5",
         kwargs={"report": str(report), "pause_once": str(pause)})
    started = wait_for_event(report, lambda e: e["event"] == "acquired", workers=[worker])

    with paused(started["pid"]):
        # A renewal that landed (or was under way) before the pause gives the lease at
        # most one ttl from now: wait past that, by the database's clock.
        paused_at = locks.database_now()
        wait_until_database_time_passes(
            paused_at + dt.timedelta(seconds=tasks.KEEPALIVE_TTL), margin=0.5
        )
    wait_for_event(report, lambda e: e["event"] == "lease_lost", workers=[worker])
    (tmp_path / "pause.go").touch()
    refused = wait_for_event(report, lambda e: e["event"] == "refused", workers=[worker])

    assert refused["code"] == "lease_lost"
    assert balance(account) == Decimal("100.00")
    assert Rejection.objects.filter(
        token=started["token"], reason=RejectionReason.LEASE_LOST
    ).exists()


EXIT_PATHS = ["success", "exception", "retry", "reject", "ignore", "soft_time_limit"]


def test_every_exit_path_releases_its_own_lease(
    workers: dict[str, Worker], broker: RedisBroker, tmp_path: Path
) -> None:
    worker = workers["prefork"]
    report = tmp_path / "events.jsonl"
    for path in EXIT_PATHS:
        options: dict[str, object] = {"soft_time_limit": 1} if path == "soft_time_limit" else {}
        publish(tasks.exit_path, worker.queue, broker, path, kwargs={"report": str(report)}, **options)
    publish(tasks.exit_by_autoretry, worker.queue, broker, "autoretry", kwargs={"report": str(report)})
    expected = {path: 1 for path in EXIT_PATHS} | {"retry": 2, "autoretry": 2}

    deadline = time.monotonic() + 40
    while True:
        grants = {
            path: list(Grant.objects.filter(lock__key=f"exit:{path}").order_by("token"))
            for path in expected
        }
        done = all(
            len(grants[path]) == count and all(g.ended_at for g in grants[path])
            for path, count in expected.items()
        )
        if done:
            break
        assert time.monotonic() < deadline, f"{grants}\n{events(report)}\n{worker.log_text()[-3000:]}"
        time.sleep(0.1)

    for path, ended in grants.items():
        assert [g.end_reason for g in ended] == [GrantEnd.RELEASED] * expected[path], path
        assert Lock.objects.get(key=f"exit:{path}").holder == ""
    soft = grants["soft_time_limit"][0]
    assert (soft.ended_at - soft.acquired_at).total_seconds() < 4  # not its 5 s lease
    retried = [e for e in events(report) if e.get("path") == "retry"]
    assert [e["retries"] for e in retried] == [0, 1]
    assert retried[0]["token"] < retried[1]["token"]


def test_sigkilled_worker_recovers_by_lease_expiry_without_cleanup(
    workers: dict[str, Worker], broker: RedisBroker, tmp_path: Path
) -> None:
    """SIGKILL mid-task: nothing releases the lease; it expires (database clock) and the
    requeued copy (acks_late + reject_on_worker_lost) runs with a higher token."""
    worker = workers["prefork"]
    account = AccountFactory(balance=Decimal("100.00"))
    report = tmp_path / "events.jsonl"
    pause = tmp_path / "pause"
    pause.touch()
    publish(tasks.deposit_long_lease, worker.queue, broker, account.pk, "7",
         kwargs={"report": str(report), "pause_once": str(pause)})
    killed = wait_for_event(report, lambda e: e["event"] == "acquired", workers=[worker])
    os.kill(killed["pid"], signal.SIGKILL)

    written = wait_for_event(report, lambda e: e["event"] == "written", timeout=40, workers=[worker])
    rerun = [e for e in events(report) if e["event"] == "acquired"][-1]

    assert rerun["task_id"] == killed["task_id"]
    assert written["token"] == killed["token"] + 1
    first = Grant.objects.get(lock__key=f"account:{account.pk}", token=killed["token"])
    assert first.end_reason == GrantEnd.EXPIRED  # closed by the next acquire, not by a release
    assert dt.datetime.fromisoformat(rerun["at"]) >= first.expires_at
    assert balance(account) == Decimal("107.00")
    wait_until_free(f"account:{account.pk}")


def test_a_copy_of_the_same_task_id_backs_off_while_its_previous_execution_holds_the_lease(
    workers: dict[str, Worker], broker: RedisBroker, tmp_path: Path
) -> None:
    """The task id is not a holder identity: a second delivery of a running task
    finds the lock held by its own earlier execution, retries after the remaining
    lease (plus jitter), and runs under a new token once the first has released."""
    worker = workers["prefork"]
    account = AccountFactory(balance=Decimal("100.00"))
    report = tmp_path / "events.jsonl"
    pause = tmp_path / "pause"
    pause.touch()
    task_id = unique("same-id")
    arguments = {"report": str(report), "pause_once": str(pause)}
    publish(tasks.deposit, worker.queue, broker, account.pk, "7", task_id=task_id, kwargs=arguments)
    first = wait_for_event(report, lambda e: e["event"] == "acquired", workers=[worker])
    publish(tasks.deposit, worker.queue, broker, account.pk, "7", task_id=task_id, kwargs=arguments)
    retry = wait_for_event(report, lambda e: e["event"] == "retry", workers=[worker])
    (tmp_path / "pause.go").touch()

    deadline = time.monotonic() + 30
    while len([e for e in events(report) if e["event"] == "written"]) < 2:
        assert time.monotonic() < deadline, (events(report), worker.log_text()[-4000:])
        time.sleep(0.05)
    acquired = [e for e in events(report) if e["event"] == "acquired"]

    assert retry["reason"] == "LockHeld"
    # Back-off from the holder's remaining lease (at most its ttl) plus jitter (at most 1.05 s).
    assert 0 < retry["countdown"] <= tasks.KEEPALIVE_TTL + 1.05
    assert [e["task_id"] for e in acquired] == [task_id, task_id]
    assert acquired[1]["token"] == first["token"] + 1
    assert acquired[1]["retries"] >= 1
    assert balance(account) == Decimal("114.00")  # both ran, one after the other


def wait_until_free(key: str, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while Lock.objects.get(key=key).holder:
        assert time.monotonic() < deadline, f"lock {key} was never released"
        time.sleep(0.05)


def test_grant_context_does_not_leak_into_the_next_task_on_the_same_process(
    workers: dict[str, Worker], broker: RedisBroker, tmp_path: Path
) -> None:
    worker = workers["solo"]
    account = AccountFactory()
    report = tmp_path / "events.jsonl"
    publish(tasks.deposit, worker.queue, broker, account.pk, "1", kwargs={"report": str(report)})
    publish(tasks.current_grant_of_process, worker.queue, broker, kwargs={"report": str(report)})
    observed = wait_for_event(report, lambda e: e["event"] == "observed", workers=[worker])
    written = next(e for e in events(report) if e["event"] == "written")

    assert observed["pid"] == written["pid"]  # the same process ran both
    assert observed["current_grant"] == "None"
    assert observed["deposit_grant"] == "None"


def test_supersede_runs_only_the_latest_enqueue_and_acks_the_others_unrun(
    workers: dict[str, Worker], broker: RedisBroker, tmp_path: Path
) -> None:
    worker = workers["solo"]
    report = tmp_path / "events.jsonl"
    gate = tmp_path / "gate"
    gate.touch()
    publish(tasks.wait_at, worker.queue, broker, str(gate), kwargs={"report": str(report)})
    wait_for_event(report, lambda e: e["event"] == "waiting", workers=[worker])
    for version in (1, 2, 3):
        publish(tasks.rebuild_digest, worker.queue, broker, "daily", version,
             kwargs={"report": str(report)})
    (tmp_path / "gate.go").touch()

    ran = wait_for_event(report, lambda e: e["event"] == "ran", workers=[worker])
    deadline = time.monotonic() + 15
    while len([e for e in events(report) if e["event"] == "skipped"]) < 2:
        assert time.monotonic() < deadline, events(report)
        time.sleep(0.05)

    assert ran["version"] == 3
    assert [e["version"] for e in events(report) if e["event"] == "ran"] == [3]
    skipped = [e for e in events(report) if e["event"] == "skipped"]
    assert {e["reason"] for e in skipped} == {"superseded"}
    assert sorted(e["args"][1] for e in skipped) == [1, 2]
    deadline = time.monotonic() + 5
    while broker.queue_length(worker.queue) or broker.unacked_on(worker.queue):
        assert time.monotonic() < deadline, "superseded messages were not acknowledged"
        time.sleep(0.05)


def test_threads_pool_keeps_each_concurrent_tasks_grant_to_its_own_thread(
    workers: dict[str, Worker], broker: RedisBroker, tmp_path: Path
) -> None:
    worker = workers["threads"]
    accounts = [AccountFactory(balance=Decimal("100.00")) for _ in range(2)]
    report = tmp_path / "events.jsonl"
    for index, account in enumerate(accounts):
        (tmp_path / f"pause-{index}").touch()
        publish(tasks.deposit, worker.queue, broker, account.pk, "1",
             kwargs={"report": str(report), "pause_once": str(tmp_path / f"pause-{index}")})
    deadline = time.monotonic() + 30
    while len([e for e in events(report) if e["event"] == "acquired"]) < 2:
        assert time.monotonic() < deadline, (events(report), worker.log_text()[-3000:])
        time.sleep(0.05)
    for index in range(2):
        (tmp_path / f"pause-{index}.go").touch()
    while len([e for e in events(report) if e["event"] == "written"]) < 2:
        assert time.monotonic() < deadline, (events(report), worker.log_text()[-3000:])
        time.sleep(0.05)

    acquired = [e for e in events(report) if e["event"] == "acquired"]
    assert acquired[0]["pid"] == acquired[1]["pid"]  # one process, two threads at once
    for account in accounts:
        assert balance(account) == Decimal("101.00")
        # The task reports its write before it returns; the release follows.
        grant = Grant.objects.get(lock__key=f"account:{account.pk}")
        while not grant.end_reason:
            assert time.monotonic() < deadline, (events(report), worker.log_text()[-3000:])
            time.sleep(0.05)
            grant.refresh_from_db()
        assert (grant.token, grant.end_reason) == (1, GrantEnd.RELEASED)


def test_concurrency_caps_running_executions_and_the_others_retry(
    workers: dict[str, Worker], broker: RedisBroker, tmp_path: Path
) -> None:
    """``fenced_task(concurrency=2)``: five executions queued on workers that could
    run all five at once; the database never counts more than two bodies
    running, the others retry as on a busy lock, and every write is accepted
    under its slot's own token."""
    name = unique("export")
    counter, peak = AccountFactory(balance=Decimal("0")), AccountFactory(balance=Decimal("0"))
    report = tmp_path / "events.jsonl"
    arguments = {"counter": counter.pk, "peak": peak.pk, "report": str(report), "hold": 1.5}
    # One execution per free process: solo 1, prefork 2, threads 2.
    for queue in [workers["solo"].queue] + [workers["prefork"].queue] * 2 + [workers["threads"].queue] * 2:
        publish(tasks.capped_export, queue, broker, name, kwargs=arguments)

    deadline = time.monotonic() + 60
    while len([e for e in events(report) if e["event"] == "written"]) < 5:
        assert time.monotonic() < deadline, (
            events(report), [w.log_text()[-2000:] for w in workers.values()]
        )
        time.sleep(0.1)
    acquired = [e for e in events(report) if e["event"] == "acquired"]
    retries = [e for e in events(report) if e["event"] == "retry"]

    assert Account.objects.get(pk=peak.pk).balance <= 2  # never more than two at once
    # The last body counts itself out just after it reports its write.
    wait_for(lambda: Account.objects.get(pk=counter.pk).balance == 0, what="every body finished")
    assert max(e["running"] for e in acquired) <= 2
    assert retries and {e["reason"] for e in retries} == {"LockHeld"}
    assert {e["key"] for e in acquired} <= {f"export:{name}@1", f"export:{name}@2"}
    for key in {e["key"] for e in acquired}:
        tokens = sorted(e["token"] for e in acquired if e["key"] == key)
        assert len(set(tokens)) == len(tokens)  # each execution its own token of its slot
    assert len(acquired) == 5


def test_concurrency_permit_holder_paused_past_its_lease_is_refused_by_its_slots_fence(
    workers: dict[str, Worker], broker: RedisBroker, tmp_path: Path
) -> None:
    """A (``concurrency=2``, 1 s lease, no keep-alive) is stopped past its lease while
    holding slot s; B is granted slot s (the other slot is held throughout) and
    writes; A resumes and its write under the older token of slot s is refused."""
    a, b = workers["solo"], workers["prefork"]
    name = unique("export")
    counter, peak = AccountFactory(balance=Decimal("0")), AccountFactory(balance=Decimal("0"))
    report = tmp_path / "events.jsonl"
    pause = tmp_path / "pause-a"
    pause.touch()
    arguments = {"counter": counter.pk, "peak": peak.pk, "report": str(report)}
    other = acquire_permit(f"export:{name}", limit=2, holder="the other slot", ttl=60)
    try:
        publish(tasks.capped_export_plain_lease, a.queue, broker, name,
             kwargs={**arguments, "pause_once": str(pause)})
        t0 = wait_for_event(report, lambda e: e["event"] == "acquired", workers=[a])
        with paused(t0["pid"]):
            wait_until_database_time_passes(dt.datetime.fromisoformat(t0["expires_at"]), margin=0.2)

            publish(tasks.capped_export_plain_lease, b.queue, broker, name, kwargs=arguments)
            t3 = wait_for_event(report, lambda e: e["event"] == "written", workers=[b])
        (tmp_path / "pause-a.go").touch()
        late = wait_for_event(report, lambda e: e["event"] == "refused", workers=[a])
    finally:
        locks.release(other)

    assert t0["key"] != other.key and t3["key"] == t0["key"]
    assert t3["token"] == t0["token"] + 1
    assert (late["key"], late["token"], late["code"]) == (t0["key"], t0["token"], "stale_token")
    rejection = Rejection.objects.get(token=t0["token"], lock_key=t0["key"])
    assert rejection.reason == RejectionReason.STALE
    assert rejection.watermark_token == t3["token"]
