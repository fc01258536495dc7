"""Job coordination's rows: policies and their changes, tallies, executions."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from django.core.exceptions import ValidationError
from django.db import models, transaction
from django.db.models import Exists, OuterRef, Q
from django.db.models.functions import Now
from django.utils.translation import gettext_lazy as _

from ..conf import app_settings
from ..exceptions import InvalidInput
from ..keys import (
    HOLDER_MAX_LENGTH,
    KEY_MAX_LENGTH,
    KEY_PATTERN,
)
from .grants import DatabaseNow, Lock
from .ratelimits import template_fields

if TYPE_CHECKING:
    pass


RATE_LIMIT_MAX = 100_000
RATE_PERIOD_MIN = 0.1
RATE_PERIOD_MAX = 86_400.0

TASK_PATTERN_WILDCARD = "*"
TASK_RULE = (
    "a task name (letters, digits and . _ : @ -, starting with a letter or digit), "
    "or a name's beginning followed by * (billing.* is every task whose name starts "
    "with billing.)"
)


def validate_task_pattern(task: object) -> str:
    """Return ``task`` if it names a task or a prefix of task names, else InvalidInput.

    Task names follow the key rule, so that ``task:<name>`` is a lock key: the
    key a policy answers to under the access rules (docs/jobs.md).
    """
    if not isinstance(task, str) or not task:
        raise InvalidInput(f"a job policy's task must be {TASK_RULE}")
    name = task.removesuffix(TASK_PATTERN_WILDCARD)
    if TASK_PATTERN_WILDCARD in name or not name or not KEY_PATTERN.fullmatch(name):
        raise InvalidInput(f"task {task!r} is not {TASK_RULE}")
    if len(task) > KEY_MAX_LENGTH - len("task:"):
        raise InvalidInput(f"task is {len(task)} characters long; at most {KEY_MAX_LENGTH - 5}")
    return task


def _task_field_validator(value: str) -> None:
    try:
        validate_task_pattern(value)
    except InvalidInput as error:
        raise ValidationError(str(error), code="invalid") from None


class WhenPaused(models.TextChoices):
    """What an execution that starts while its policy is paused does instead of its body."""

    DEFER = "defer", _("defer: run it after the resume")
    SKIP = "skip", _("skip: a Skipped result, not run")


class JobPolicy(models.Model):
    """How the executions of one fenced task (or of every task a pattern names)
    are coordinated, set at run time by an operator: paused, capped, its lease.

    Read by every execution of ``fenced_task`` and of its ``django.tasks``
    twin (:mod:`coordination.jobs`, through a per-process cache of
    ``COORDINATION["JOB_POLICY_REFRESH"]`` seconds), so a change applies
    without a restart. Every change is recorded as a :class:`JobPolicyChange`.
    Empty overrides keep what the task's decorator says.
    """

    task = models.CharField(
        max_length=KEY_MAX_LENGTH - 5, unique=True, validators=[_task_field_validator],
        help_text=_("The task's name (billing.tasks.settle), or a beginning followed by * "
                    "(billing.* : every task whose name starts with billing.). An exact name "
                    "wins over a pattern, a longer pattern over a shorter one."),
    )
    paused = models.BooleanField(
        default=False, db_default=False,
        help_text=_("Executions that start while paused do not run their body."),
    )
    when_paused = models.CharField(
        max_length=5, choices=WhenPaused.choices, default=WhenPaused.DEFER,
        db_default=WhenPaused.DEFER,
        help_text=_("Defer (sent again after a countdown until resumed; never lost) or "
                    "skip (a Skipped result)."),
    )
    defer_seconds = models.FloatField(
        default=10.0, db_default=10.0,
        help_text=_("Countdown of a deferred execution before it asks again, in seconds."),
    )
    max_running = models.PositiveIntegerField(
        null=True, blank=True,
        help_text=_("At most this many executions of the task run at once, over all "
                    "workers and keys, each holding a fenced permit. Empty: no cap."),
    )
    ttl = models.FloatField(
        null=True, blank=True,
        help_text=_("Lease of each execution in seconds, instead of the decorator's. Empty: "
                    "the decorator's."),
    )
    on_busy = models.CharField(
        max_length=5, blank=True, default="", db_default="",
        choices=[("retry", "retry"), ("skip", "skip"), ("raise", "raise")],
        help_text=_("What an execution does when its lock (or every permit) is held, "
                    "instead of the decorator's. Empty: the decorator's."),
    )
    rate_limit = models.PositiveIntegerField(
        null=True, blank=True,
        help_text=_("At most this many executions start in any window of the rate period, over "
                    "all workers, per rate key (deferred past it, never lost). Empty: no limit."),
    )
    rate_period = models.FloatField(
        null=True, blank=True, help_text=_("The rate limit's period in seconds (60: per minute)."),
    )
    rate_key = models.CharField(
        max_length=KEY_MAX_LENGTH, blank=True, default="", db_default="",
        help_text=_("What the rate limit counts per: a template over the task's arguments "
                    "({customer_id}). Empty: one limit for all of the policy's executions."),
    )
    key_cap = models.PositiveIntegerField(
        null=True, blank=True,
        help_text=_("At most this many executions at once per cap key, each holding a fenced "
                    "permit. Empty: no cap per key."),
    )
    cap_key = models.CharField(
        max_length=KEY_MAX_LENGTH, blank=True, default="", db_default="",
        help_text=_("What the cap counts per: a template over the task's arguments "
                    "({customer_id}); needed with a cap per key."),
    )
    note = models.CharField(max_length=200, blank=True, default="", db_default="")
    updated_at = models.DateTimeField(db_default=Now(), auto_now=True)

    class Meta:
        ordering = ["task"]
        verbose_name = _("job policy")
        verbose_name_plural = _("job policies")
        permissions = [("pause_jobpolicy", "Can pause and resume tasks, and revoke their leases")]
        constraints = [
            models.CheckConstraint(
                condition=Q(max_running__isnull=True) | Q(max_running__gte=1, max_running__lte=1000),
                name="coordination_jobpolicy_max_running",
                violation_error_message=_("max running is from 1 to 1000, or empty."),
            ),
            models.CheckConstraint(
                condition=Q(ttl__isnull=True) | Q(ttl__gt=0),
                name="coordination_jobpolicy_ttl_gt_0",
                violation_error_message=_("ttl is more than 0 seconds, or empty."),
            ),
            models.CheckConstraint(
                condition=Q(defer_seconds__gte=0.1, defer_seconds__lte=3600),
                name="coordination_jobpolicy_defer_seconds",
                violation_error_message=_("the defer countdown is from 0.1 to 3600 seconds."),
            ),
            models.CheckConstraint(
                condition=Q(rate_limit__isnull=True, rate_period__isnull=True, rate_key="")
                | Q(rate_limit__isnull=False, rate_limit__gte=1, rate_limit__lte=RATE_LIMIT_MAX,
                    rate_period__isnull=False, rate_period__gte=RATE_PERIOD_MIN,
                    rate_period__lte=RATE_PERIOD_MAX),
                name="coordination_jobpolicy_rate",
                violation_error_message=_("a rate limit is from 1 to 100000 starts per 0.1 to "
                                          "86400 seconds; a rate key needs a limit."),
            ),
            models.CheckConstraint(
                condition=Q(key_cap__isnull=True, cap_key="")
                | (Q(key_cap__isnull=False, key_cap__gte=1, key_cap__lte=1000) & ~Q(cap_key="")),
                name="coordination_jobpolicy_key_cap",
                violation_error_message=_("a cap per key is from 1 to 1000 and needs a cap key, "
                                          "or both are empty."),
            ),
        ]

    def __str__(self) -> str:
        return self.task

    def save(self, *args: Any, changed_by: str = "", via: str = "code", **kwargs: Any) -> None:
        """Save, and record the change (``changed_by``, ``via``, before and after) in
        the same transaction: a change nobody can see never applies."""
        alias = kwargs.get("using") or self._state.db or app_settings.DATABASE
        with transaction.atomic(using=alias):
            before = None
            if self.pk is not None:
                old = JobPolicy.objects.using(alias).select_for_update().filter(pk=self.pk).first()
                before = old.state() if old is not None else None
            super().save(*args, **kwargs)
            after = self.state()
            if before != after:
                JobPolicyChange.objects.using(alias).create(
                    policy=self, task=self.task, changed_by=changed_by, via=via,
                    before=before, after=after,
                )

    def delete(self, *args: Any, changed_by: str = "", via: str = "code", **kwargs: Any) -> Any:
        """Delete, recording the change; the record keeps the task's name."""
        alias = kwargs.get("using") or self._state.db or app_settings.DATABASE
        with transaction.atomic(using=alias):
            JobPolicyChange.objects.using(alias).create(
                policy=None, task=self.task, changed_by=changed_by, via=via,
                before=self.state(), after=None,
            )
            return super().delete(*args, **kwargs)

    @property
    def access_key(self) -> str:
        """The lock key the access rules see this policy as: ``task:<task>``
        (``task:billing.*`` for a pattern, matched by rule patterns as a key)."""
        return f"task:{self.task}"

    def state(self) -> dict[str, Any]:
        """The policy's settings as a change records them (before and after)."""
        return {
            "task": self.task, "paused": self.paused, "when_paused": self.when_paused,
            "defer_seconds": self.defer_seconds, "max_running": self.max_running,
            "ttl": self.ttl, "on_busy": self.on_busy, "note": self.note,
            "rate_limit": self.rate_limit, "rate_period": self.rate_period, "rate_key": self.rate_key,
            "key_cap": self.key_cap, "cap_key": self.cap_key,
        }

    def clean(self) -> None:
        """The key templates parse and name fields (which arguments the task takes is
        the forms' check: :func:`coordination.jobs.template_refusal`)."""
        errors = {}
        for name in ("rate_key", "cap_key"):
            value = getattr(self, name)
            try:
                if value:
                    template_fields(value)
            except InvalidInput as error:
                errors[name] = ValidationError(str(error), code="invalid")
        if errors:
            raise ValidationError(errors)


class JobPolicyChange(models.Model):
    """One change of a job policy: who, when, through what, before and after.

    Written in the same transaction as the change by
    :func:`coordination.jobs.save_policy` and :func:`~coordination.jobs.delete_policy`;
    kept when the policy is deleted (``task`` names it).
    """

    policy = models.ForeignKey(
        JobPolicy, on_delete=models.SET_NULL, null=True, blank=True, related_name="changes"
    )
    task = models.CharField(max_length=KEY_MAX_LENGTH)
    changed_by = models.CharField(max_length=150, blank=True, default="")
    via = models.CharField(max_length=40, blank=True, default="")
    changed_at = models.DateTimeField(db_default=Now())
    before = models.JSONField(null=True, blank=True)
    after = models.JSONField(null=True, blank=True)

    class Meta:
        ordering = ["-changed_at", "-id"]
        verbose_name = _("job policy change")

    def __str__(self) -> str:
        return f"{self.task} by {self.changed_by or 'code'} at {self.changed_at}"

    @property
    def summary(self) -> str:
        """``paused: False -> True; max_running: None -> 2``: what changed."""
        before, after = self.before or {}, self.after or {}
        if not before:
            return "created"
        if not after:
            return "deleted"
        return "; ".join(
            f"{name}: {before.get(name)!r} -> {after.get(name)!r}"
            for name in after if before.get(name) != after.get(name)
        ) or "no change"


class JobOutcome(models.TextChoices):
    DEFERRED = "deferred", _("deferred")
    SKIPPED = "skipped", _("skipped")
    #: ``once``: a redelivery of a task id whose body completed, not run again.
    FINISHED = "finished", _("finished before")


class JobTally(models.Model):
    """How many executions of a task did not run their body, and how: deferred
    (paused, sent again), skipped (paused with skip, lock or permits busy,
    superseded) or finished (a ``once`` task id whose body completed before).
    One row per task and outcome, counted up by
    :func:`coordination.jobs.tally`."""

    task = models.CharField(max_length=KEY_MAX_LENGTH)
    outcome = models.CharField(max_length=8, choices=JobOutcome.choices)
    count = models.BigIntegerField(default=0, db_default=0)
    last_at = models.DateTimeField(db_default=Now())

    class Meta:
        ordering = ["task", "outcome"]
        constraints = [
            models.UniqueConstraint(fields=["task", "outcome"], name="coordination_jobtally_once"),
        ]

    def __str__(self) -> str:
        return f"{self.task} {self.outcome}: {self.count}"


class ExecutionQuerySet(models.QuerySet["Execution"]):
    def stranded(self) -> ExecutionQuerySet:
        """Executions whose lease ran out without a release and that nobody has
        taken over: their lock still names their grant (key and token) as its
        lease, expired by the database clock. Their worker was lost (SIGKILL, an
        OOM kill, a hard time limit, a machine gone); nothing will release them."""
        expired = Lock.objects.filter(holder__gt="", expires_at__lte=DatabaseNow())
        return self.filter(
            Exists(expired.filter(key=OuterRef("lock_key"), token=OuterRef("token"))),
            lock_key__in=expired.values("key"),
        )


class Execution(models.Model):
    """One execution of a fenced task, recorded by the task itself when its grant
    was taken: which task, which message and attempt, which worker, under which
    grant (and permits). What the jobs page calls running comes from these rows
    and the grant's lease, never from a holder name a client may choose.

    Written once per execution with its grant (in the grant's own statement on
    PostgreSQL, right after it elsewhere or after the execution's permits; never
    failing the task over its bookkeeping), and pruned with the grant history.
    """

    task = models.CharField(max_length=255)
    task_id = models.CharField(max_length=255, blank=True, default="")
    attempt = models.PositiveIntegerField(default=1)
    worker = models.CharField(max_length=HOLDER_MAX_LENGTH, blank=True, default="")
    lock_key = models.CharField(max_length=KEY_MAX_LENGTH)
    token = models.BigIntegerField()
    permit_key = models.CharField(max_length=KEY_MAX_LENGTH, blank=True, default="")
    permit_token = models.BigIntegerField(null=True, blank=True)
    # The permit of the policy's cap per key (``key_cap``), beside ``max_running``'s.
    cap_permit_key = models.CharField(max_length=KEY_MAX_LENGTH, blank=True, default="")
    cap_permit_token = models.BigIntegerField(null=True, blank=True)
    started_at = models.DateTimeField(db_default=Now())
    # The lease's length when it was granted; the keep-alive renews to the same
    # length, so a lease that ends at E was last renewed at E - ttl.
    ttl = models.FloatField(null=True, blank=True)

    objects = ExecutionQuerySet.as_manager()

    class Meta:
        ordering = ["started_at", "id"]
        constraints = [
            models.UniqueConstraint(fields=["lock_key", "token"], name="coordination_execution_grant"),
        ]
        indexes = [models.Index(fields=["started_at"], name="coordination_execution_started")]

    def __str__(self) -> str:
        return f"{self.task}[{self.task_id}]#{self.attempt} under {self.lock_key} token {self.token}"


class ReportedTask(models.Model):
    """A fenced task a worker said it runs, when it started: how the jobs page and
    the job policies know the site's fenced tasks without the web process
    importing them (it never imports a ``tasks.py`` in a usual setup)."""

    task = models.CharField(max_length=255, unique=True)
    reported_at = models.DateTimeField(db_default=Now())
    #: The names of the task's parameters (the key templates of its policies may
    #: name them); None: not reported, or it takes ``**kwargs`` (any name).
    parameters = models.JSONField(null=True, blank=True)

    class Meta:
        ordering = ["task"]

    def __str__(self) -> str:
        return self.task


class UniqueScope(models.TextChoices):
    """How long a unique job's key stays claimed by one execution."""

    QUEUED = "queued", _("while queued")
    RUNNING = "running", _("while running")
    SUCCEEDED = "succeeded", _("until it succeeded")
    SECONDS = "seconds", _("for some seconds")


class UniqueClaim(models.Model):
    """The execution that holds a unique job's key now, and until when.

    One row per key (the unique constraint decides between producers that claim
    it at once). Held while ``holds_until`` is in the future, or while the grant
    ``lock_key``/``token`` (the running execution's lease) is live, both by the
    database clock: a worker killed mid-run leaves a claim that ends with its
    lease, and a message lost in the broker one that ends at ``holds_until``.
    Written by :mod:`coordination.unique`; an ended row is taken over in place.
    """

    key = models.CharField(max_length=KEY_MAX_LENGTH, unique=True)
    task = models.CharField(max_length=255)
    task_id = models.CharField(max_length=255)
    scope = models.CharField(max_length=9, choices=UniqueScope.choices)
    holds_until = models.DateTimeField(null=True, blank=True)
    lock_key = models.CharField(max_length=KEY_MAX_LENGTH, blank=True, default="")
    token = models.BigIntegerField(null=True, blank=True)
    claimed_at = models.DateTimeField(db_default=Now())

    class Meta:
        ordering = ["key"]

    def __str__(self) -> str:
        return f"{self.key} held by {self.task}[{self.task_id}] ({self.scope})"
