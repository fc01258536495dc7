"""Job policies: how an operator pauses, caps and tunes fenced tasks at run time.

A :class:`~coordination.models.JobPolicy` row names a task (or a prefix of
task names, ``billing.*``) and overrides what its decorator fixed in code:

- ``paused``: an execution that starts while paused does not run its body.
  By default it is *deferred*: its message is sent again after
  ``defer_seconds`` (Celery: a copy of the message with the same id and
  retry count, so deferrals never spend ``max_retries``), until the policy is
  resumed; ``when_paused="skip"`` returns a
  :class:`~coordination.contrib.execution.Skipped` result instead.
- ``max_running``: each execution takes one of N fenced permits of the
  semaphore ``task:<name>`` (:mod:`coordination.semaphores`) beside its key's
  lock, so at most N bodies of the task run at once over all workers and keys.
- ``ttl`` and ``on_busy``: the lease and the busy behaviour of its executions.

Workers read the policies through a per-process cache refreshed every
``COORDINATION["JOB_POLICY_REFRESH"]`` seconds (one query for all policies),
so a change applies to executions that start at most that long after it,
without a restart. Every change made with ``save()``/``delete()`` of the model
(the admin, the REST API and the dashboard buttons all go through them) is
recorded as a :class:`~coordination.models.JobPolicyChange`; a queryset
``update()`` bypasses the record and is not the way to change a policy.

Under the access rules a policy is the lock key ``task:<task>``: seeing it
needs ``read`` on that key, changing, pausing or resuming it ``revoke``
(operators' steering, like revoking a lease); "pause and revoke running"
also needs ``revoke`` on each running execution's own key.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from dataclasses import dataclass
from typing import Any

from django.db import IntegrityError, transaction
from django.db.models import F

from . import locks
from .conf import app_settings
from .logfields import LogFields
from .models import (
    TASK_PATTERN_WILDCARD,
    DatabaseNow,
    Grant,
    JobOutcome,
    JobPolicy,
    JobTally,
    WhenPaused,
)

__all__ = [
    "Policy", "Running", "clear_cache", "pause", "permit_name", "policy_for", "resume",
    "running", "tally",
]

logger = logging.getLogger("coordination.tasks")

# holder_name() of coordination.contrib.execution: "<task>[<id>]#<attempt> on <host>:<pid>".
HOLDER = re.compile(r"(?P<task>[^\[]+)\[(?P<id>[^\]]*)\]#(?P<attempt>\d+) on (?P<worker>.*)")


@dataclass(frozen=True)
class Policy:
    """What one execution reads of its task's policy: a snapshot, not a row."""

    task: str
    paused: bool = False
    when_paused: str = WhenPaused.DEFER
    defer_seconds: float = 10.0
    max_running: int | None = None
    ttl: float | None = None
    on_busy: str = ""

    @classmethod
    def of(cls, row: JobPolicy) -> Policy:
        return cls(
            task=row.task, paused=row.paused, when_paused=row.when_paused,
            defer_seconds=float(row.defer_seconds), max_running=row.max_running,
            ttl=None if row.ttl is None else float(row.ttl), on_busy=row.on_busy,
        )


class _Cache:
    """The policies this process read, and when (monotonic clock)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.pid = os.getpid()
        self.read_at: float | None = None
        self.exact: dict[str, Policy] = {}
        self.prefixes: list[tuple[str, Policy]] = []  # longest prefix first


_cache = _Cache()


def clear_cache() -> None:
    """Forget the policies read: the next execution reads them again."""
    global _cache
    _cache = _Cache()


def policy_for(task: str, *, using: str | None = None) -> Policy | None:
    """The policy in force for task ``task``: its own row, else the longest
    pattern that names it, else None (the decorator's settings apply).

    Read from the database at most every ``COORDINATION["JOB_POLICY_REFRESH"]``
    seconds per process (all policies in one query); an error reading them
    propagates, as the execution's acquire would fail on the same database.
    """
    cache = _cache
    refresh = float(app_settings.JOB_POLICY_REFRESH)
    now = time.monotonic()
    if cache.pid != os.getpid() or cache.read_at is None or now - cache.read_at >= refresh:
        with cache.lock:
            if cache.read_at is None or time.monotonic() - cache.read_at >= refresh:
                _read(cache, using)
    found = cache.exact.get(task)
    if found is not None:
        return found
    for prefix, policy in cache.prefixes:
        if task.startswith(prefix):
            return policy
    return None


def _read(cache: _Cache, using: str | None) -> None:
    rows = list(JobPolicy.objects.using(using or app_settings.DATABASE).all())
    exact: dict[str, Policy] = {}
    prefixes: list[tuple[str, Policy]] = []
    for row in rows:
        if row.task.endswith(TASK_PATTERN_WILDCARD):
            prefixes.append((row.task.removesuffix(TASK_PATTERN_WILDCARD), Policy.of(row)))
        else:
            exact[row.task] = Policy.of(row)
    prefixes.sort(key=lambda pair: len(pair[0]), reverse=True)
    cache.exact, cache.prefixes = exact, prefixes
    cache.pid = os.getpid()
    cache.read_at = time.monotonic()


def permit_name(task: str) -> str:
    """The semaphore whose permits cap the running executions of ``task``:
    ``task:<name>`` (its slots are the lock keys ``task:<name>@1`` ...)."""
    return f"task:{task}"


def tally(task: str, outcome: JobOutcome | str, *, using: str | None = None) -> None:
    """Count one execution of ``task`` that did not run its body (``deferred`` or
    ``skipped``) for the dashboard. One UPDATE (an INSERT the first time).
    Never raises: a count is not worth failing a task over; a failure is logged."""
    alias = using or app_settings.DATABASE
    rows = JobTally.objects.using(alias).filter(task=task, outcome=outcome)
    try:
        if rows.update(count=F("count") + 1, last_at=DatabaseNow()):
            return
        try:
            with transaction.atomic(using=alias):
                JobTally.objects.using(alias).create(task=task, outcome=outcome, count=1)
        except IntegrityError:  # created meanwhile by another execution
            rows.update(count=F("count") + 1, last_at=DatabaseNow())
    except Exception as error:
        logger.warning("job tally failed %s", LogFields(task=task, outcome=outcome, error=error))


@dataclass(frozen=True)
class Running:
    """One execution of a task running now: its key's live grant (and permit)."""

    task: str
    key: str
    token: int
    holder: str
    worker: str
    task_id: str
    since: Any
    expires_at: Any
    permit: str = ""


def running(task: str | None = None, *, using: str | None = None) -> list[Running]:
    """The executions running now (live grants by the database clock) of ``task``,
    or of every fenced task, told by their holder names (``<task>[<id>]#<n> on
    <worker>``); oldest first."""
    grants = Grant.objects.using(using or app_settings.DATABASE).live().select_related("lock")
    if task is not None:
        grants = grants.filter(holder__startswith=f"{task}[")
    else:
        grants = grants.filter(holder__contains="]#")
    found: dict[str, dict[str, Any]] = {}
    for grant in grants.order_by("acquired_at", "id"):
        match = HOLDER.fullmatch(grant.holder)
        if match is None:
            continue
        name = match["task"]
        entry = found.setdefault(grant.holder, {"task": name, "match": match})
        if grant.lock.key.startswith(permit_name(name) + "@"):
            entry["permit"] = grant.lock.key
        else:
            entry["grant"] = grant
    result = []
    for holder, entry in found.items():
        if "grant" not in entry:
            continue
        row: Grant = entry["grant"]
        match = entry["match"]
        result.append(Running(
            task=entry["task"], key=row.lock.key, token=row.token, holder=holder,
            worker=match["worker"], task_id=match["id"], since=row.acquired_at,
            expires_at=row.expires_at, permit=entry.get("permit", ""),
        ))
    return result


def pause(
    task: str, *, by: str = "", via: str = "code", revoke_running: bool = False,
    may_revoke: Any = None,
) -> tuple[JobPolicy, list[Grant]]:
    """Pause ``task`` (a policy row is created if there is none) and, with
    ``revoke_running``, revoke the leases of its running executions (their key
    and their permit): their keep-alives find the lease lost and mark it so,
    their later fenced writes are refused, and the next grant of each key
    fences them out. ``may_revoke(key)`` (default: every key) filters the keys
    revoked. A lease that changed hands between the read and the revoke is
    revoked all the same: a revoke ends whoever holds the key then."""
    with transaction.atomic(using=app_settings.DATABASE):
        policy = (
            JobPolicy.objects.using(app_settings.DATABASE).select_for_update()
            .filter(task=task).first()
        ) or _new_policy(task)
        if not policy.paused or policy.pk is None:
            policy.paused = True
            policy.save(changed_by=by, via=via)
    revoked: list[Grant] = []
    if revoke_running:
        for execution in running(task):
            for key in (execution.key, execution.permit):
                if key and (may_revoke is None or may_revoke(key)):
                    grant = locks.revoke(key)
                    if grant is not None:
                        revoked.append(grant)
    return policy, revoked


def _new_policy(task: str) -> JobPolicy:
    """A policy of its own for ``task``, starting from the pattern that named it
    (if any): pausing one task of ``billing.*`` keeps the pattern's cap and lease."""
    policy = JobPolicy(task=task)
    patterns = JobPolicy.objects.using(app_settings.DATABASE).filter(task__endswith=TASK_PATTERN_WILDCARD)
    named = [row for row in patterns if task.startswith(row.task[:-1])]
    if named:
        base = max(named, key=lambda row: len(row.task))
        for name, value in base.state().items():
            if name not in ("task", "note"):
                setattr(policy, name, value)
        policy.note = f"from {base.task}"
    return policy


def resume(task: str, *, by: str = "", via: str = "code") -> JobPolicy | None:
    """Resume ``task``: deferred executions run when their countdown next ends."""
    with transaction.atomic(using=app_settings.DATABASE):
        policy = (
            JobPolicy.objects.using(app_settings.DATABASE).select_for_update()
            .filter(task=task).first()
        )
        if policy is not None and policy.paused:
            policy.paused = False
            policy.save(changed_by=by, via=via)
    return policy
