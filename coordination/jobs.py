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
- ``rate_limit`` per ``rate_period`` over ``rate_key``: at most N starts in
  any window of the period per rendered key, decided by the database
  (:mod:`coordination.ratelimits`); executions over it are deferred.
- ``key_cap`` over ``cap_key``: a fenced permit of the semaphore
  :func:`cap_name` per rendered key, so at most N run at once per key.
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

The executions themselves are recorded here too: :func:`acquire_execution`
takes an execution's grant with its record (in the grant's own statement
where the grant point can), :func:`record_execution` writes one after its
permits, and :func:`running` reads them back.
"""

from __future__ import annotations

import difflib
import functools
import hashlib
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

from django.db import DatabaseError, IntegrityError, transaction
from django.db.models import F, OuterRef, Subquery

from . import locks
from .backends import get_backend
from .backends.outcomes import Acquired, ExecutionRecord
from .conf import app_settings
from .exceptions import InvalidInput
from .leases import Lease
from .logfields import LogFields
from .models import (
    RATE_BUCKET_MAX_LENGTH,
    TASK_PATTERN_WILDCARD,
    DatabaseNow,
    Execution,
    Grant,
    JobOutcome,
    JobPolicy,
    JobTally,
    ReportedTask,
    WhenPaused,
    template_fields,
    validate_holder,
    validate_key,
)
from .waiting import (
    Waiter,
    announce_grant,
    await_grant,
    grant_point_call,
    grant_timings,
    wait_for_grant,
)

__all__ = [
    "HeldLeases", "Policy", "Running", "aacquire_execution", "acquire_execution", "cap_name",
    "clear_cache", "declare_task", "executions_of", "known_tasks",
    "pause", "permit_name", "policy_for", "rate_bucket", "record_execution", "report_tasks",
    "resume", "running", "tally", "template_refusal", "unknown_task",
]

logger = logging.getLogger("coordination.tasks")



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
    rate_limit: int | None = None
    rate_period: float | None = None
    rate_key: str = ""
    key_cap: int | None = None
    cap_key: str = ""

    @classmethod
    def of(cls, row: JobPolicy) -> Policy:
        return cls(
            task=row.task, paused=row.paused, when_paused=row.when_paused,
            defer_seconds=float(row.defer_seconds), max_running=row.max_running,
            ttl=None if row.ttl is None else float(row.ttl), on_busy=row.on_busy,
            rate_limit=row.rate_limit,
            rate_period=None if row.rate_period is None else float(row.rate_period),
            rate_key=row.rate_key, key_cap=row.key_cap, cap_key=row.cap_key,
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


def rate_bucket(scope: str, rendered: str) -> str:
    """The rate key counted for a start: the policy's task (or pattern), or the
    task's name for the decorator's ``rate``, and the rendered ``rate_key``. A
    pattern's executions share one count per rendered key (``billing.*``: ten
    starts per customer over every billing task)."""
    bucket = f"{scope}|{rendered}"
    if len(bucket) <= RATE_BUCKET_MAX_LENGTH:
        return bucket
    # A long key keeps its readable start and ends in its digest, so that two
    # long keys never share a count.
    digest = hashlib.sha256(bucket.encode()).hexdigest()
    return f"{bucket[:RATE_BUCKET_MAX_LENGTH - len(digest) - 1]}#{digest}"


def cap_name(scope: str, rendered: str) -> str:
    """The semaphore whose permits cap a policy's executions per key:
    ``cap:<task or pattern's beginning>:<rendered cap_key>`` (slots ``...@1``)."""
    return validate_key(f"cap:{scope.removesuffix(TASK_PATTERN_WILDCARD)}:{rendered}", what="cap key")


#: The fenced tasks declared in this process and their parameter names (None: any).
_declared: dict[str, list[str] | None] = {}


def declare_task(name: str, parameters: list[str] | None) -> None:
    """Note that this process declared fenced task ``name`` taking ``parameters``
    (None: any name, ``**kwargs``): what :func:`report_tasks` tells the site and
    :func:`template_refusal` checks a policy's templates against."""
    _declared[name] = parameters


def template_refusal(task: str, template: str, *, using: str | None = None) -> str | None:
    """Why the key template ``template`` of a policy for ``task`` (a name or a
    pattern) cannot be rendered for some task it applies to: a field the task does
    not take (its parameters as declared here or reported by a worker); None if
    every known task takes every field, or its parameters are unknown."""
    try:
        fields = template_fields(template)
    except InvalidInput as error:
        return str(error)
    alias = using or app_settings.DATABASE
    known: dict[str, list[str] | None] = dict(
        ReportedTask.objects.using(alias).values_list("task", "parameters")
    )
    known.update(_declared)
    prefix = task.removesuffix(TASK_PATTERN_WILDCARD)
    pattern = task.endswith(TASK_PATTERN_WILDCARD)
    for name, parameters in sorted(known.items()):
        if parameters is None or not (name.startswith(prefix) if pattern else name == task):
            continue
        for field in fields:
            if field not in parameters:
                return (
                    f"{{{field}}} is not an argument of task {name} "
                    f"(it takes {', '.join(parameters) or 'none'})"
                )
    return None


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


class HeldLeases:
    """What an execution's record says it holds: its lock's key and its permits'."""

    key: str
    permit: str
    cap_permit: str

    @property
    def permits(self) -> list[str]:
        """The permits' lock keys it holds: ``max_running``'s, the cap per key's."""
        return [key for key in (self.permit, self.cap_permit) if key]

    @property
    def keys(self) -> list[str]:
        """Every lock key the execution holds: its lock's and its permits'."""
        return [self.key, *self.permits]


@dataclass(frozen=True)
class Running(HeldLeases):
    """One execution of a task running now: its recorded start and its live grant."""

    task: str
    key: str
    token: int
    holder: str
    worker: str
    task_id: str
    since: Any
    expires_at: Any
    permit: str = ""
    cap_permit: str = ""


def record_execution(
    task: str,
    grant: Any,
    *,
    task_id: str | None,
    attempt: int,
    worker: str,
    permit: Any = None,
    cap_permit: Any = None,
    using: str | None = None,
) -> None:
    """Record that an execution of ``task`` started under ``grant`` (and ``permit``,
    ``max_running``'s, and ``cap_permit``, the cap per key's):
    one INSERT, whose commit does not wait for its flush where the database
    allows (a crash may lose a record, never a grant). Never raises: a failure
    is logged, and the execution only goes unseen on the jobs page.

    A fenced execution without permits writes its record with its grant instead
    (:func:`acquire_execution`)."""
    get_backend(using).write_record(
        ExecutionRecord.of(task, task_id, attempt, worker), grant, permit, cap_permit
    )


def acquire_execution(
    key: str, record: ExecutionRecord, *, holder: str, ttl: float | None = None,
    wait: float = 0.0, using: str | None = None,
) -> Lease:
    """:func:`~coordination.locks.acquire` for a fenced execution: the same grant,
    guarantees and errors, and with the grant the execution's ``record`` (what
    :func:`record_execution` writes). Where the grant point can, the record is
    written in the grant's own transaction (PostgreSQL's functions: no round
    trip of its own); else right after it. A record that cannot be written is
    logged, never raised."""
    key, holder = validate_key(key), validate_holder(holder)
    lease_seconds, wait, delay = grant_timings(ttl, wait, None)
    backend = get_backend(using)

    def attempt(ticket: int | None) -> Acquired:
        return backend.acquire_recorded(key, holder, lease_seconds, delay, ticket, record)

    started = time.monotonic()
    if wait == 0:
        with grant_point_call("acquire", key, using):
            acquired = attempt(None)
    else:
        waiter = Waiter(backend, key, holder, fair=False, wait=wait)
        acquired = wait_for_grant(attempt, wait=wait, waiter=waiter, key=key, using=using)
    return announce_grant(acquired, holder, time.monotonic() - started)


async def aacquire_execution(
    key: str, record: ExecutionRecord, *, holder: str, ttl: float | None = None,
    wait: float = 0.0, using: str | None = None,
) -> Lease:
    """:func:`acquire_execution` for async code, as ``locks.aacquire`` runs ``acquire()``."""

    def attempt() -> Lease:
        return acquire_execution(key, record, holder=holder, ttl=ttl, using=using)

    return await await_grant(attempt, wait=wait, release=functools.partial(locks.release, using=using))


def executions_of(rows: Any, key: str = "lock_key", token: str = "token") -> Any:
    """``rows`` (a queryset with a lock key and a token) annotated with ``execution_task``:
    the task of the execution recorded under that grant, or None."""
    recorded = Execution.objects.filter(lock_key=OuterRef(key), token=OuterRef(token))
    return rows.annotate(execution_task=Subquery(recorded.values("task")[:1]))


def running(task: str | None = None, *, using: str | None = None) -> list[Running]:
    """The executions running now of ``task``, or of every fenced task: those the
    tasks recorded (:func:`record_execution`) whose grant is live by the database
    clock; oldest first. A lock taken any other way is no task's execution,
    whatever its holder is called."""
    alias = using or app_settings.DATABASE
    recorded = Execution.objects.using(alias).filter(
        lock_key=OuterRef("lock__key"), token=OuterRef("token")
    )
    if task is not None:
        recorded = recorded.filter(task=task)
    rows = list(
        Grant.objects.using(alias).live()
        .annotate(execution=Subquery(recorded.values("pk")[:1]))
        .filter(execution__isnull=False)
        .order_by("acquired_at", "id")
        .values_list("lock__key", "token", "holder", "acquired_at", "expires_at", "execution")
    )
    executions = Execution.objects.using(alias).in_bulk([row[-1] for row in rows])
    found = []
    for key, token, holder, since, expires_at, pk in rows:
        execution = executions.get(pk)
        if execution is not None:
            found.append(Running(
                task=execution.task, key=key, token=token, holder=holder,
                worker=execution.worker, task_id=execution.task_id, since=since,
                expires_at=expires_at, permit=execution.permit_key,
                cap_permit=execution.cap_permit_key,
            ))
    return found


def pause(
    task: str, *, by: str = "", via: str = "code", revoke_running: bool = False,
    may_revoke: Any = None,
) -> tuple[JobPolicy, list[Grant]]:
    """Pause ``task`` (a policy row is created if there is none) and, with
    ``revoke_running``, revoke the leases of its running executions (their key
    and their permits, ``max_running``'s and the cap per key's; for a pattern,
    those of the tasks whose policy in force it is): their keep-alives find the
    lease lost and mark it so, their later fenced writes are refused, and the
    next grant of each key fences them out. ``may_revoke(key)`` (default: every
    key) filters the keys revoked. A lease that changed hands between the read
    and the revoke is revoked all the same: a revoke ends whoever holds the key
    then."""
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
        for execution in _steered_by(task):
            for key in execution.keys:
                if may_revoke is None or may_revoke(key):
                    grant = locks.revoke(key)
                    if grant is not None:
                        revoked.append(grant)
    return policy, revoked


def _steered_by(task: str) -> list[Running]:
    """The running executions whose policy in force is ``task``'s: a pattern steers
    the tasks it names that no exact policy or longer pattern claims."""
    if not task.endswith(TASK_PATTERN_WILDCARD):
        return running(task)
    rows = JobPolicy.objects.using(app_settings.DATABASE)
    patterns = [name[:-1] for name in rows.filter(task__endswith=TASK_PATTERN_WILDCARD)
                .values_list("task", flat=True)]
    found = [run for run in running() if run.task.startswith(task[:-1])]
    exact = set(rows.filter(task__in={run.task for run in found}).values_list("task", flat=True))
    return [
        run for run in found if run.task not in exact
        and max((p for p in patterns if run.task.startswith(p)), key=len, default="") == task[:-1]
    ]


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


# --- the site's fenced tasks, as the web process knows them -------------------------


def report_tasks(names: list[str], *, using: str | None = None) -> None:
    """Record that a worker runs the fenced tasks ``names`` (called when it starts),
    with the parameters of those declared in this process (:func:`declare_task`).
    Never raises: a worker is not stopped over this bookkeeping."""
    alias = using or app_settings.DATABASE
    try:
        rows = ReportedTask.objects.using(alias)
        rows.bulk_create([ReportedTask(task=name) for name in names], ignore_conflicts=True)
        rows.filter(task__in=names).update(reported_at=DatabaseNow())
        for name in names:
            if name in _declared:
                rows.filter(task=name).update(parameters=_declared[name])
    except DatabaseError as error:
        logger.warning("could not record the worker's fenced tasks %s", LogFields(error=str(error)))


def known_tasks(*, using: str | None = None) -> set[str]:
    """The fenced tasks this site knows without importing them: those a worker
    reported when it started and those that have run (their Execution rows)."""
    alias = using or app_settings.DATABASE
    reported = ReportedTask.objects.using(alias).values_list("task", flat=True)
    ran = Execution.objects.using(alias).order_by().values_list("task", flat=True).distinct()
    return {*reported, *ran}


def unknown_task(task: str, known: set[str], remedy: str = "") -> str | None:
    """Why a policy for ``task`` would steer nothing (a name no known task has, a
    pattern matching none), then ``remedy`` (what to do), then the nearest known
    names, which may be long and are the part a bounded message may cut; None if
    it names one."""
    then = f"; {remedy}" if remedy else ""
    if task.endswith(TASK_PATTERN_WILDCARD):
        prefix = task[: -len(TASK_PATTERN_WILDCARD)]
        if any(name.startswith(prefix) for name in known):
            return None
        return f"{task!r} matches none of the fenced tasks this site knows{then}"
    if task in known:
        return None
    close = difflib.get_close_matches(task, sorted(known), n=3, cutoff=0.6)
    hint = f"; did you mean {' or '.join(repr(name) for name in close)}?" if close else ""
    return f"no fenced task named {task!r} is known to this site{then}{hint}"
