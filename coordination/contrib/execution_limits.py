"""The limits one fenced execution takes beside its key's lock: a cap per key and a rate.

Steps of :class:`~coordination.contrib.execution._Machine` (both drivers), run
after the key's lock and the policy's ``max_running`` permit were granted:

- **a cap per key** (the policy's ``key_cap`` over ``cap_key``): one of the N
  fenced permits of the semaphore :func:`coordination.jobs.cap_name`, kept
  alive beside the grant; its loss (a pause past its lease) marks the grant
  lost, and a resource fenced by the permit's slot key refuses the late copy;
- **a rate** (the policy's ``rate_limit`` per ``rate_period`` over
  ``rate_key``, else the decorator's ``rate``): one start logged by
  :func:`coordination.ratelimits.take_start`; over the limit, every lease
  taken is released and :class:`RateLimited` carries the countdown the
  limiter computed, which the execution is deferred by (never lost).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Mapping
from typing import Any

from .. import jobs, signals
from ..exceptions import InvalidInput
from ..leases import Lease
from ..logfields import LogFields
from ..models import JobOutcome, render_template, template_fields
from ..ratelimits import Rate, parse_rate, take_start
from . import execution_steps as steps

__all__ = ["RateLimited", "call_arguments", "check_rate", "parameters_of"]

logger = logging.getLogger("coordination.tasks")


def call_arguments(signature: inspect.Signature, args: Any, kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """One call's arguments by name, defaults applied and ``**kwargs`` spread: what
    a policy's key templates are rendered with ({} when the call does not bind,
    which its own lock key reports)."""
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError:
        return {}
    bound.apply_defaults()
    arguments = dict(bound.arguments)
    for parameter in signature.parameters.values():
        if parameter.kind is parameter.VAR_KEYWORD:
            arguments.update(arguments.pop(parameter.name, {}))
    return arguments


def parameters_of(signature: inspect.Signature) -> list[str] | None:
    """The names a key template may use for a task of ``signature``; None when it
    takes ``**kwargs`` (any name)."""
    parameters = list(signature.parameters.values())
    if any(parameter.kind is parameter.VAR_KEYWORD for parameter in parameters):
        return None
    return [p.name for p in parameters if p.kind is not p.VAR_POSITIONAL]


def check_rate(
    rate: object, rate_key: object, signature: inspect.Signature, where: str
) -> Rate | None:
    """The decorator's ``rate`` parsed, and its ``rate_key`` checked against the
    function's parameters: ``InvalidInput`` when the task is declared, not in the
    worker."""
    if rate is None:
        if rate_key:
            raise InvalidInput(f"{where}(rate_key=...) needs a rate: rate=\"10/m\"")
        return None
    parsed = parse_rate(rate)
    if not isinstance(rate_key, str):
        raise InvalidInput(f"{where}(rate_key=...) must be a key template over the task's arguments")
    parameters = parameters_of(signature)
    for field in template_fields(rate_key) if rate_key else ():
        if parameters is not None and field not in parameters:
            raise InvalidInput(
                f"{where}(rate_key={rate_key!r}) names {{{field}}}, which is not one of its "
                f"parameters ({', '.join(parameters) or 'none'})"
            )
    return parsed


class RateLimited(Exception):
    """An execution over its rate limit: deferred by ``countdown`` seconds."""

    def __init__(self, bucket: str, rate: Rate, countdown: float) -> None:
        self.bucket, self.rate, self.countdown = bucket, rate, countdown
        self.detail = (
            f"rate limit {rate} of {bucket!r} reached; a start is free in {countdown:.3f} s"
        )
        super().__init__(self.detail)


class _Limits:
    """A fenced execution's cap per key and rate (see the module)."""

    name: str | None
    key: str
    label: str
    using: str | None
    keepalive: bool
    wait: float
    permit: Lease | None
    policy: jobs.Policy | None
    _keeper: Any

    #: The call's arguments by name (what the key templates are rendered with), or
    #: a function that binds them when a template is first rendered.
    arguments: Mapping[str, Any] | Callable[[], Mapping[str, Any]] | None = None
    #: The decorator's ``rate`` and ``rate_key`` (a policy's replace them).
    rate: Rate | None = None
    rate_key: str = ""
    #: With a cap per key: its permit.
    cap_permit: Lease | None = None
    #: Under a rate: the database time this execution's start was logged at.
    rate_started_at: Any = None

    def _render(self, template: str, what: str) -> str:
        if not template:
            return ""
        if callable(self.arguments):
            self.arguments = self.arguments()
        return render_template(template, self.arguments or {}, what=what)

    def _rate_in_force(self) -> tuple[str, Rate] | None:
        policy = self.policy
        if policy is not None and policy.rate_limit is not None and policy.rate_period is not None:
            rate = Rate(policy.rate_limit, policy.rate_period)
            return jobs.rate_bucket(policy.task, self._render(policy.rate_key, "rate_key")), rate
        if self.rate is not None:
            return jobs.rate_bucket(self.name or self.key, self._render(self.rate_key, "rate_key")), self.rate
        return None

    def _cap_in_force(self) -> tuple[str, int] | None:
        policy = self.policy
        if policy is None or policy.key_cap is None or not policy.cap_key:
            return None
        return jobs.cap_name(policy.task, self._render(policy.cap_key, "cap_key")), policy.key_cap

    def _take_rate(self) -> RateLimited | None:
        found = self._rate_in_force()
        if found is None:
            return None
        bucket, rate = found
        decision = take_start(bucket, rate, task=self.name or "", using=self.using)
        if decision.granted:
            self.rate_started_at = decision.at
            return None
        return RateLimited(bucket, rate, decision.countdown)

    @property
    def _limited(self) -> bool:
        """Whether a cap per key or a rate may apply (the policy's, the decorator's)."""
        policy = self.policy
        return self.rate is not None or (
            policy is not None and (policy.key_cap is not None or policy.rate_limit is not None)
        )

    def _limit_steps(self, grant: Lease) -> steps.Steps[None]:
        """The cap per key's permit, then the rate's start; on a refusal (or an
        error) every lease taken so far is given back before it propagates."""
        if not self._limited:
            return
        try:
            cap = yield steps.Call(self._cap_in_force)
            if cap is not None:
                if self.keepalive and self.wait > 0 and self._keeper is None:
                    # The wait for a permit may outlast the key's lease: keep it alive.
                    self._keeper = yield steps.StartKeepAlive(grant)
                self.cap_permit = yield steps.Acquire(*cap)
            limited = yield steps.Call(self._take_rate)
            if limited is not None:
                raise limited
        except BaseException:
            yield from self._give_back(grant)
            raise

    def _give_back(self, grant: Lease) -> steps.Steps[None]:
        try:
            if self._keeper is not None:
                keeper, self._keeper = self._keeper, None
                yield steps.StopKeepAlive(keeper)
        finally:
            for lease in (self.cap_permit, self.permit, grant):
                if lease is not None:
                    yield steps.Release(lease)
            self.cap_permit = self.permit = None

    def _defer_rate(self, limited: RateLimited) -> None:
        logger.info("task rate limited %s", LogFields(
            task=self.label, countdown=f"{limited.countdown:.3f}s", detail=limited.detail,
        ))
        if self.name is not None:
            jobs.tally(self.name, JobOutcome.DEFERRED, using=self.using)
        signals.task_rate_limited.send(
            sender=type(self), task=self.name, key=limited.bucket, countdown=limited.countdown
        )
