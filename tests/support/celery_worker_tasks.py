"""Tasks the worker tests send to real ``celery worker`` processes.

Each task reports what happened as JSON lines to the file named by its
``report`` argument (the test reads it): the token it got, its process id,
its attempt, and the outcome of its write. Times are the database's.

``pause_once`` is a path: the first execution that claims it (an atomic
rename, so exactly one copy of a redelivered task wins) waits until
``<pause_once>.go`` exists. That is where a test pauses or kills a worker.
"""

from __future__ import annotations

import json
import os
import threading
import time
from decimal import Decimal
from pathlib import Path
from typing import Any

from celery import shared_task
from celery.exceptions import Ignore, Reject
from celery.signals import task_retry
from django.db import transaction

from coordination import locks, signals
from coordination.contrib.celery import fenced_task
from coordination.exceptions import CoordinationError
from coordination.fencing import fence
from coordination.leases import Lease
from project.demo.models import Account

#: The lease of the kept-alive tasks: the shortest ttl docs/celery.md calls safe
#: with the keep-alive, so a loaded machine's stalls never decide a test.
KEEPALIVE_TTL = 5.0

_reports: dict[tuple[str, int], str] = {}
_reports_guard = threading.Lock()


def record(report_to: str, event: str, **fields: Any) -> None:
    line = {"event": event, "at": locks.database_now().isoformat(), "pid": os.getpid(), **fields}
    with open(report_to, "a", encoding="utf-8") as out:
        out.write(json.dumps(line) + "\n")


def pause_here_once(pause_once: str) -> bool:
    if not pause_once:
        return False
    try:
        os.rename(pause_once, pause_once + ".claimed")
    except FileNotFoundError:
        return False  # another copy claimed it
    deadline = time.monotonic() + 90
    while not Path(pause_once + ".go").exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    return True


def _deposit(task: Any, account_id: int, amount: str, report_to: str, pause_once: str, hold: float) -> Any:
    grant = task.grant
    assert grant is not None and locks.current_grant() is grant
    with _reports_guard:
        _reports[(grant.key, grant.token)] = report_to
    account = Account.objects.get(pk=account_id)
    record(
        report_to, "acquired", token=grant.token, task_id=task.request.id,
        retries=task.request.retries, expires_at=grant.expires_at.isoformat(),
        read=str(account.balance),
    )
    paused = pause_here_once(pause_once)
    if hold:
        time.sleep(hold)
    new_balance = account.balance + Decimal(amount)
    try:
        Account.objects.filter(pk=account_id).fenced_update(balance=new_balance)
    except CoordinationError as refused:
        record(report_to, "refused", token=grant.token, code=refused.code, paused=paused)
        return {"written": False, "code": refused.code}
    record(report_to, "written", token=grant.token, balance=str(new_balance), paused=paused)
    return {"written": True, "token": grant.token}


@fenced_task(lock="account:{account_id}", ttl=KEEPALIVE_TTL, bind=True)
def deposit(
    self: Any, account_id: int, amount: str, *, report: str, pause_once: str = "", hold: float = 0.0
) -> Any:
    """Read-modify-write of a balance under a lease kept alive (renewed every ttl/3)."""
    return _deposit(self, account_id, amount, report, pause_once, hold)


@fenced_task(lock="account:{account_id}", ttl=KEEPALIVE_TTL, bind=True)
def deposit_long_lease(
    self: Any, account_id: int, amount: str, *, report: str, pause_once: str = "", hold: float = 0.0
) -> Any:
    """A kept-alive lease long enough that a requeued copy still finds it held."""
    return _deposit(self, account_id, amount, report, pause_once, hold)


@fenced_task(lock="account:{account_id}", ttl=1.0, keepalive=False, on_busy="raise", bind=True)
def deposit_plain_lease(
    self: Any, account_id: int, amount: str, *, report: str, pause_once: str = "", hold: float = 0.0
) -> Any:
    """The seed's client: a 1 s lease and no keep-alive."""
    return _deposit(self, account_id, amount, report, pause_once, hold)


@fenced_task(lock="exit:{path}", ttl=5.0, bind=True, max_retries=1, default_retry_delay=0)
def exit_path(self: Any, path: str, *, report: str) -> Any:
    """Leaves its body by ``path``: success, exception, retry, reject, ignore, soft_time_limit."""
    record(report, "running", path=path, token=self.grant.token, retries=self.request.retries)
    if path == "exception":
        raise ValueError("the body failed")
    if path == "retry" and self.request.retries == 0:
        raise self.retry(countdown=0)
    if path == "reject":
        raise Reject("rejected by the body", requeue=False)
    if path == "ignore":
        raise Ignore()
    if path == "soft_time_limit":
        time.sleep(30)
    return "done"


@fenced_task(
    lock="exit:{path}", ttl=5.0, bind=True, autoretry_for=(ValueError,), max_retries=1,
    default_retry_delay=0, retry_backoff=False, retry_jitter=False,
)
def exit_by_autoretry(self: Any, path: str, *, report: str) -> Any:
    record(report, "running", path=path, token=self.grant.token, retries=self.request.retries)
    if self.request.retries == 0:
        raise ValueError("first attempt fails; autoretry_for retries it")
    return "done"


@fenced_task(lock="digest:{name}", ttl=5.0, supersede=True, bind=True)
def rebuild_digest(self: Any, name: str, version: int, *, report: str) -> Any:
    """Latest wins: only the newest enqueue of a name runs."""
    record(report, "ran", version=version, token=self.grant.token)
    return version


def _count_running(counter_id: int, peak_id: int, change: int) -> int:
    """Add ``change`` to the number of bodies running (an Account's balance, under its
    row lock) and raise the peak (another Account's balance): the overlap as the
    database saw it. Returns the number running after the change."""
    with transaction.atomic():
        counter = Account.objects.select_for_update().get(pk=counter_id)
        running = counter.balance + change
        Account.objects.filter(pk=counter_id).update(balance=running)
        Account.objects.filter(pk=peak_id, balance__lt=running).update(balance=running)
    return int(running)


def _capped(
    task: Any, name: str, counter: int, peak: int, report_to: str, pause_once: str, hold: float
) -> Any:
    grant = task.grant
    assert grant is not None and locks.current_grant() is grant
    running = _count_running(counter, peak, +1)
    try:
        record(
            report_to, "acquired", token=grant.token, key=grant.key, task_id=task.request.id,
            retries=task.request.retries, expires_at=grant.expires_at.isoformat(), running=running,
        )
        paused = pause_here_once(pause_once)
        if hold:
            time.sleep(hold)
        try:
            with fence(grant.key, grant):  # the slot's own fence: its tokens only
                pass
        except CoordinationError as refused:
            record(report_to, "refused", token=grant.token, key=grant.key, code=refused.code)
            return {"written": False, "code": refused.code}
        record(report_to, "written", token=grant.token, key=grant.key, paused=paused)
        return {"written": True, "token": grant.token}
    finally:
        _count_running(counter, peak, -1)


@fenced_task(
    lock="export:{name}", concurrency=2, ttl=KEEPALIVE_TTL, bind=True, max_retries=50,
)
def capped_export(
    self: Any, name: str, *, counter: int, peak: int, report: str, pause_once: str = "",
    hold: float = 0.0,
) -> Any:
    """At most two executions per name at once; the others retry (``on_busy="retry"``)."""
    return _capped(self, name, counter, peak, report, pause_once, hold)


@fenced_task(
    lock="export:{name}", concurrency=2, ttl=1.0, keepalive=False, on_busy="raise", bind=True,
)
def capped_export_plain_lease(
    self: Any, name: str, *, counter: int, peak: int, report: str, pause_once: str = "",
    hold: float = 0.0,
) -> Any:
    """A permit with a 1 s lease and no keep-alive, for the pause past the lease."""
    return _capped(self, name, counter, peak, report, pause_once, hold)


def keepalive_thread_names() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("coordination-keepalive"))


@fenced_task(lock="threads:{name}", ttl=30.0, bind=True)
def keepalive_threads(self: Any, name: str, *, report: str, until_kept_alive: bool = False) -> None:
    """Reports this process's keep-alive threads at the body's start and, with
    ``until_kept_alive``, once this execution's own keep-alive thread runs (its
    start is due a sixth of the 30 s ttl after the acquire)."""
    own = f"coordination-keepalive-{self.grant.key}#{self.grant.token}"
    at_start = keepalive_thread_names()
    later = None
    if until_kept_alive:
        deadline = time.monotonic() + 60
        while own not in keepalive_thread_names() and time.monotonic() < deadline:
            time.sleep(0.05)
        later = keepalive_thread_names()
    record(report, "threads", name=name, token=self.grant.token, own=own, at_start=at_start, later=later)


@shared_task(bind=True)
def current_grant_of_process(self: Any, *, report: str) -> None:
    """A plain task: sees no grant, even right after a fenced task on the same process."""
    record(
        report, "observed", current_grant=repr(locks.current_grant()),
        deposit_grant=repr(deposit.grant), task_id=self.request.id,
    )


@shared_task
def wait_at(pause_once: str, *, report: str) -> None:
    """Keeps a worker busy until the test opens the gate."""
    record(report, "waiting")
    pause_here_once(pause_once)


def _report_for(key: str, token: int) -> str | None:
    with _reports_guard:
        return _reports.get((key, token))


def _on_lock_lost(sender: Any, grant: Lease, error: Exception, **kwargs: Any) -> None:
    path = _report_for(grant.key, grant.token)
    if path:
        record(path, "lease_lost", token=grant.token, error=type(error).__name__)


def _on_renewed(sender: Any, grant: Lease, **kwargs: Any) -> None:
    path = _report_for(grant.key, grant.token)
    if path:
        record(path, "renewed", token=grant.token, expires_at=grant.expires_at.isoformat())


def _on_skipped(sender: Any, task: Any, key: str, reason: str, **kwargs: Any) -> None:
    request = getattr(task, "request", None)  # django.tasks send the plain function
    path = (getattr(request, "kwargs", None) or {}).get("report")
    if path:
        record(path, "skipped", reason=reason, key=key, args=list(request.args or ()))


def _on_retry(sender: Any, request: Any, reason: Any, **kwargs: Any) -> None:
    path = (request.kwargs or {}).get("report")
    if path:
        cause = getattr(reason, "exc", None) or reason  # Retry wraps the exception that caused it
        when = getattr(reason, "when", None)
        record(
            path, "retry", reason=type(cause).__name__, detail=str(cause), retries=request.retries,
            countdown=when if isinstance(when, int | float) else None,
        )


signals.lock_lost.connect(_on_lock_lost, dispatch_uid="tests.support.celery_worker_tasks.lock_lost")
signals.lock_renewed.connect(_on_renewed, dispatch_uid="tests.support.celery_worker_tasks.lock_renewed")
signals.task_skipped.connect(_on_skipped, dispatch_uid="tests.support.celery_worker_tasks.task_skipped")
task_retry.connect(_on_retry, dispatch_uid="tests.support.celery_worker_tasks.task_retry", weak=False)
