"""The jobs page: every fenced task known, what runs now, what did not run, its policy."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from typing import Any

from .. import jobs
from ..conf import app_settings
from ..locks import database_now
from ..models import JobOutcome, JobPolicy, JobTally, Rejection
from ..stranded import Stranded, stranded_executions
from .data import Shown
from .queries import DAY


@dataclass(frozen=True)
class JobRow:
    """One fenced task on the jobs page: what runs now, what did not run, its policy.

    ``refused`` is None for a viewer without ``view_rejection``; ``running``
    holds only the executions whose keys the viewer may read.
    """

    task: str
    policy: JobPolicy | None
    running: list[jobs.Running]
    deferred: int
    skipped: int
    finished: int
    refused: int | None
    may_steer: bool = False

    @property
    def paused(self) -> bool:
        return self.policy is not None and self.policy.paused

    @property
    def own_policy(self) -> bool:
        """Whether the policy is the task's own row (not a pattern naming it)."""
        return self.policy is not None and self.policy.task == self.task


@dataclass(frozen=True)
class Jobs:
    now: dt.datetime
    rows: list[JobRow]
    patterns: list[JobPolicy]
    # Executions whose worker was lost, their lease expired and not released.
    stranded: list[Stranded] = field(default_factory=list)


def registered_fenced_tasks() -> list[str]:
    """The names of the fenced Celery tasks this process knows (none without Celery)."""
    try:
        from celery import current_app

        from ..contrib.celery import FencedTask
    except ImportError:
        return []
    return sorted(name for name, task in current_app.tasks.items() if isinstance(task, FencedTask))


def build_jobs(
    *, shown: Shown | None = None, may_steer: Any = None, limit: int = 200
) -> Jobs:
    """The jobs page: every fenced task known (registered here, reported by a
    worker at its start, run before, with a policy, a count or an execution
    running now) that the viewer may read as the key
    ``task:<name>``, with its executions running now (live grants, by the
    database clock), its deferred, skipped and finished-before counts, its refused writes of
    the last day and the policy in force. ``may_steer(task)`` says whether
    the viewer may pause and resume it."""
    shown = shown or Shown()
    alias = app_settings.DATABASE
    now = database_now(alias)
    readable = shown.access.allows
    policies = list(JobPolicy.objects.using(alias).order_by("task"))
    exact = {policy.task: policy for policy in policies if not policy.task.endswith("*")}
    patterns = sorted(
        (policy for policy in policies if policy.task.endswith("*")),
        key=lambda policy: len(policy.task), reverse=True,
    )
    tallies: dict[str, dict[str, int]] = {}
    for task, outcome, count in JobTally.objects.using(alias).values_list("task", "outcome", "count"):
        tallies.setdefault(task, {})[outcome] = count
    running: dict[str, list[jobs.Running]] = {}
    for execution in jobs.running(using=alias):
        running.setdefault(execution.task, []).append(execution)
    names = sorted(
        {*registered_fenced_tasks(), *jobs.known_tasks(using=alias), *exact, *tallies, *running}, key=str
    )
    names = [name for name in names if readable("read", jobs.permit_name(name))][:limit]
    refused: dict[str, int] = {}
    if shown.rejections and names:
        recent = shown.keys(
            Rejection.objects.using(alias).filter(created_at__gte=now - DAY), "lock_key"
        )
        # A refusal is a task's when its token is a recorded execution's grant.
        tasks = jobs.executions_of(recent).filter(execution_task__isnull=False)
        for name in tasks.values_list("execution_task", flat=True):
            refused[name] = refused.get(name, 0) + 1
    rows = []
    for name in names:
        policy = exact.get(name) or next(
            (pattern for pattern in patterns if name.startswith(pattern.task[:-1])), None
        )
        counts = tallies.get(name, {})
        rows.append(JobRow(
            task=name, policy=policy,
            running=[run for run in running.get(name, []) if readable("read", run.key)],
            deferred=counts.get(JobOutcome.DEFERRED, 0), skipped=counts.get(JobOutcome.SKIPPED, 0),
            finished=counts.get(JobOutcome.FINISHED, 0),
            refused=refused.get(name, 0) if shown.rejections else None,
            may_steer=bool(may_steer(name)) if may_steer is not None else False,
        ))
    visible_patterns = [
        policy for policy in patterns if readable("read", jobs.permit_name(policy.task))
    ]
    lost = [
        execution for execution in stranded_executions(limit=limit, using=alias)
        if readable("read", jobs.permit_name(execution.task))
        and all(readable("read", key) for key in execution.keys)
    ] if shown.grants else []
    return Jobs(now=now, rows=rows, patterns=visible_patterns, stranded=lost)
