"""Tasks the ``once`` and chain worker tests send to real ``celery worker`` processes.

Each body reports ``body`` (its task id, attempt and token) as a JSON line to
its ``report`` file before its write; a ``task_postrun`` receiver reports
``returned`` with what the task returned (the stored result, for a copy that
did not run its body) and, for the first message that claims ``pause_after``,
waits there: after the body's transaction committed, before the worker
acknowledges the message. That is where a test SIGKILLs the worker's process.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any

from celery import chord, shared_task
from celery.signals import task_postrun
from django.db.models import F

from coordination.contrib.celery import fenced_task
from coordination.exceptions import StaleToken
from project.demo.models import Account
from tests.support.celery_worker_tasks import KEEPALIVE_TTL, pause_here_once, record


def _deposit(task: Any, account_id: int, amount: str, report: str, hold: float, fail_first: bool) -> Any:
    import time

    record(
        report, "body", task_id=task.request.id, retries=task.request.retries,
        token=task.grant.token,
    )
    if hold:
        time.sleep(hold)
    Account.objects.filter(pk=account_id).fenced_update(balance=F("balance") + Decimal(amount))
    if fail_first and task.request.retries == 0:
        # After its write: the retry must find the write rolled back with the attempt.
        raise task.retry(countdown=1)
    return {"deposited": amount, "token": task.grant.token}


@fenced_task(
    lock="account:{account_id}", ttl=KEEPALIVE_TTL, wait=60, once=True, bind=True, max_retries=3,
)
def deposit_once(
    self: Any, account_id: int, amount: str, *, report: str, pause_after: str = "",
    hold: float = 0.0, fail_first: bool = False,
) -> Any:
    """A deposit whose finished execution is not run again."""
    return _deposit(self, account_id, amount, report, hold, fail_first)


@fenced_task(lock="account:{account_id}", ttl=KEEPALIVE_TTL, wait=60, bind=True, max_retries=3)
def deposit_every_time(
    self: Any, account_id: int, amount: str, *, report: str, pause_after: str = "",
    hold: float = 0.0, fail_first: bool = False,
) -> Any:
    """The negative control: the same deposit without ``once``."""
    return _deposit(self, account_id, amount, report, hold, fail_first)


@task_postrun.connect(dispatch_uid="tests.support.once_tasks.returned")
def _returned(task_id: str = "", task: Any = None, kwargs: Any = None, retval: Any = None, **_: Any) -> None:
    kwargs = kwargs or {}
    if getattr(task, "name", "").startswith(__name__) and kwargs.get("report"):
        record(kwargs["report"], "returned", task=task.name.rsplit(".", 1)[-1], task_id=task_id,
               retval=retval if isinstance(retval, (dict, list, str, int)) else repr(retval))
        pause_here_once(kwargs.get("pause_after", ""))


# --- links of chains and chords ---------------------------------------------------


def _step(task: Any, value: Any, name: str, report: str) -> list[Any]:
    record(report, "step", name=name, received=value, task_id=task.request.id)
    return (value if isinstance(value, list) else [value]) + [name]


@fenced_task(lock="step:{name}", ttl=KEEPALIVE_TTL, once=True, bind=True)
def step(self: Any, value: Any, name: str, *, report: str) -> list[Any]:
    """A link that appends its name to what it received."""
    return _step(self, value, name, report)


@fenced_task(lock="step:{name}", ttl=KEEPALIVE_TTL, on_busy="skip", bind=True)
def skippable_step(self: Any, value: Any, name: str, *, report: str) -> list[Any]:
    """A link skipped while its key is held elsewhere."""
    return _step(self, value, name, report)


@fenced_task(lock="step:{name}", ttl=KEEPALIVE_TTL, bind=True)
def paused_step(self: Any, value: Any, name: str, *, report: str) -> list[Any]:
    """A link a job policy pauses (deferred) in the chain tests."""
    return _step(self, value, name, report)


@fenced_task(lock="step:{name}", ttl=KEEPALIVE_TTL, bind=True)
def refused_step(self: Any, value: Any, name: str, *, report: str) -> list[Any]:
    """A link whose write the fence refuses, as a newer token's write would make it."""
    record(report, "refused", name=name, task_id=self.request.id)
    raise StaleToken(f"step:{name}", self.grant.token, self.grant.token + 1)


@shared_task
def collect(results: list[Any], *, report: str) -> None:
    """A chord's body: reports what the header's links returned."""
    record(report, "collected", results=results)


@shared_task
def launch_chord(links: list[tuple[str, str]], *, report: str, queue: str) -> None:
    """Send a chord from the worker, which has the result backend a chord needs.

    ``links``: (kind, name) pairs, kind ``"step"``, ``"skippable"`` or ``"refused"``."""
    kinds = {"step": step, "skippable": skippable_step, "refused": refused_step}
    header = [kinds[kind].s([], name, report=report).set(queue=queue) for kind, name in links]
    chord(header)(collect.s(report=report).set(queue=queue))
