"""Prometheus metrics of the grant point and the fences, served by :func:`metrics_view`.

Counters and histograms follow the signals of :mod:`coordination.signals`, so
they count what committed, in the process where it happened. Lock states are
gauges read from the database at scrape time, so they are true whichever
process granted the locks. Mount the view in the site's URLs::

    path("metrics", coordination.metrics.metrics_view)

It is private by default: staff users whom access rules do not limit, or a
scraper sending ``Authorization: Bearer <COORDINATION["METRICS_TOKEN"]>``; set
``COORDINATION["METRICS_PUBLIC"] = True`` to open it. The counts cover every
lock key, and the process counters cannot be split by key, so a staff user
limited by access rules (docs/access-rules.md) is refused.

With several processes (gunicorn workers, Celery workers) set
``PROMETHEUS_MULTIPROC_DIR`` for all of them, as prometheus-client documents:
the view then adds up every process's counters.
"""

from __future__ import annotations

import datetime as dt
import hmac
import os
from collections.abc import Iterable
from typing import Any

from django.db import DatabaseError
from django.db.models import Count, Max, Q
from django.dispatch import receiver
from django.http import HttpRequest, HttpResponse
from django.views.decorators.http import require_GET
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram, multiprocess
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector

from . import access, signals
from .conf import app_settings
from .models import (
    DatabaseNow,
    Execution,
    GrantEnd,
    Lock,
    Rejection,
    RejectionReason,
    TokenFloor,
)

__all__ = ["LockStateCollector", "StrandedCollector", "metrics_view"]

GRANTS = Counter("coordination_grants", "Leases granted: acquire() calls that returned a grant.")
RENEWALS = Counter("coordination_renewals", "Leases extended by renew().")
RELEASES = Counter("coordination_releases", "Leases ended by their holder's release().")
EXPIRIES = Counter(
    "coordination_expiries",
    "Leases that ran out without a release (recorded by a late release or the next acquire).",
)
REVOCATIONS = Counter("coordination_revocations", "Leases ended by an operator's revoke().")
LEASES_LOST = Counter(
    "coordination_leases_lost", "renew() calls that found the lease already gone."
)
FENCED_WRITES = Counter(
    "coordination_fenced_writes",
    "Fenced writes by outcome: accepted, or the reason of the refusal.",
    ["outcome"],
)
ACQUIRE_WAIT = Histogram(
    "coordination_acquire_wait_seconds",
    "Time from the acquire() call to the grant, waiting for the lock included.",
    buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 300, 900, 3600),
)
LEASE_DURATION = Histogram(
    "coordination_lease_duration_seconds",
    "Database time from a grant to its release, revocation or expiry.",
    buckets=(0.01, 0.1, 0.5, 1, 5, 10, 30, 60, 300, 900, 3600, 4 * 3600, 24 * 3600),
)

# Job coordination's starts that did not happen as sent: executions deferred by
# a rate limit, and duplicates of a unique job (or of a task id whose body
# already completed) that did not run their body. Counted from the signals the
# executions send, per task.
JOBS_RATE_LIMITED = Counter(
    "coordination_jobs_rate_limited",
    "Executions of fenced tasks deferred by a rate limit instead of starting.",
    ["task"],
)
JOBS_DEDUPLICATED = Counter(
    "coordination_jobs_deduplicated",
    "Executions of fenced tasks that did not run their body: a duplicate of a unique job "
    "(reason duplicate) or of a task id whose body already completed (reason completed).",
    ["task", "reason"],
)

_ENDINGS: dict[str, Counter] = {
    GrantEnd.RELEASED: RELEASES, GrantEnd.REVOKED: REVOCATIONS, GrantEnd.EXPIRED: EXPIRIES,
}
OUTCOMES = ["accepted", *RejectionReason.values]
for _outcome in OUTCOMES:
    FENCED_WRITES.labels(outcome=_outcome)  # exported at 0 before the first one


# --- counters, from the signals ------------------------------------------------------
# Receivers run inside the grant point's and the fences' calls: they only touch
# in-memory metrics and never raise.


@receiver(signals.lock_acquired, dispatch_uid="coordination.metrics.acquired")
def _count_grant(sender: object, waited: float | None = None, **kwargs: Any) -> None:
    GRANTS.inc()
    if isinstance(waited, int | float) and waited >= 0:
        ACQUIRE_WAIT.observe(waited)


@receiver(signals.lock_renewed, dispatch_uid="coordination.metrics.renewed")
def _count_renewal(sender: object, **kwargs: Any) -> None:
    RENEWALS.inc()


@receiver(signals.lock_released, dispatch_uid="coordination.metrics.released")
def _count_release(sender: object, grant: Any = None, reason: str = "", **kwargs: Any) -> None:
    counter = _ENDINGS.get(reason)
    if counter is not None:
        counter.inc()
    _observe_lease(getattr(grant, "acquired_at", None), getattr(grant, "ended_at", None))


@receiver(signals.lock_expired, dispatch_uid="coordination.metrics.expired")
def _count_expiry(
    sender: object,
    acquired_at: dt.datetime | None = None,
    expired_at: dt.datetime | None = None,
    **kwargs: Any,
) -> None:
    EXPIRIES.inc()
    _observe_lease(acquired_at, expired_at)


@receiver(signals.lock_lost, dispatch_uid="coordination.metrics.lost")
def _count_lost(sender: object, **kwargs: Any) -> None:
    LEASES_LOST.inc()


# Looked up once: the counter every accepted fenced write increments.
_ACCEPTED_WRITES = FENCED_WRITES.labels(outcome="accepted")


@receiver(signals.write_accepted, dispatch_uid="coordination.metrics.accepted")
def _count_accepted(sender: object, **kwargs: Any) -> None:
    _ACCEPTED_WRITES.inc()


@receiver(signals.write_rejected, dispatch_uid="coordination.metrics.rejected")
def _count_rejected(sender: object, rejection: Rejection | None = None, **kwargs: Any) -> None:
    reason = str(getattr(rejection, "reason", "") or "unknown")
    FENCED_WRITES.labels(outcome=reason).inc()


@receiver(signals.task_rate_limited, dispatch_uid="coordination.metrics.rate_limited")
def _count_rate_limited(sender: object, task: str | None = None, **kwargs: Any) -> None:
    JOBS_RATE_LIMITED.labels(task=task or "").inc()


@receiver(signals.task_skipped, dispatch_uid="coordination.metrics.deduplicated")
def _count_deduplicated(sender: object, task: Any = None, reason: str = "", **kwargs: Any) -> None:
    if reason in {"duplicate", "completed"}:
        name = getattr(task, "name", None) or getattr(task, "__qualname__", None) or str(task or "")
        JOBS_DEDUPLICATED.labels(task=name, reason=reason).inc()


def _observe_lease(start: object, end: object) -> None:
    if isinstance(start, dt.datetime) and isinstance(end, dt.datetime) and end >= start:
        LEASE_DURATION.observe((end - start).total_seconds())


# --- gauges, from the database at scrape time ----------------------------------------


class LockStateCollector(Collector):
    """Locks by state (held, expired and not released, free), the highest token issued
    and the token floor."""

    def collect(self) -> Iterable[Metric]:
        up = GaugeMetricFamily(
            "coordination_database_up", "1 if the lock table could be read at this scrape."
        )
        try:
            found = Lock.objects.using(app_settings.DATABASE).aggregate(
                held=Count("pk", filter=Q(holder__gt="", expires_at__gt=DatabaseNow())),
                expired=Count("pk", filter=Q(holder__gt="", expires_at__lte=DatabaseNow())),
                free=Count("pk", filter=Q(holder="")),
                max_token=Max("token"),
            )
            floor = TokenFloor.objects.using(app_settings.DATABASE).value()
        except DatabaseError:
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        states = GaugeMetricFamily(
            "coordination_locks", "Lock keys by state, by the database clock.", labels=["state"]
        )
        for state in ("held", "expired", "free"):
            states.add_metric([state], found[state])
        yield states
        yield GaugeMetricFamily(
            "coordination_max_token",
            "The highest token any lock has issued (tokens end at 2**63-1).",
            value=found["max_token"] or 0,
        )
        yield GaugeMetricFamily(
            "coordination_token_floor",
            "No key is issued a token at or below this one (raised by the restore guard).",
            value=floor,
        )


class StrandedCollector(Collector):
    """Executions whose worker was lost: their lease expired without a release and
    no worker has taken their key since (:mod:`coordination.stranded`)."""

    def collect(self) -> Iterable[Metric]:
        try:
            count = Execution.objects.using(app_settings.DATABASE).stranded().count()
        except DatabaseError:
            return  # coordination_database_up says so
        yield GaugeMetricFamily(
            "coordination_jobs_stranded",
            "Executions of fenced tasks whose lease expired without a release and whose key "
            "nobody has taken since (the worker was lost), by the database clock.",
            value=count,
        )


class _Scrape(Collector):
    """One scrape: this process's (or every process's) metrics, then the database gauges."""

    def __init__(self, source: CollectorRegistry) -> None:
        self.source = source

    def collect(self) -> Iterable[Metric]:
        yield from self.source.collect()
        yield from LockStateCollector().collect()
        yield from StrandedCollector().collect()


def _source() -> CollectorRegistry:
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
        return registry
    return REGISTRY


# --- the view ----------------------------------------------------------------------


@require_GET
def metrics_view(request: HttpRequest) -> HttpResponse:
    """The metrics in Prometheus (or OpenMetrics, by ``Accept``) text format.

    401 without credentials, 403 with wrong ones or for a staff user limited by
    access rules, unless METRICS_PUBLIC is on.
    """
    refusal = _refusal(request)
    if refusal is not None:
        return refusal
    registry = CollectorRegistry()
    registry.register(_Scrape(_source()))
    encoder, content_type = choose_encoder(request.headers.get("Accept", ""))
    return HttpResponse(encoder(registry), content_type=content_type)


def _refusal(request: HttpRequest) -> HttpResponse | None:
    if app_settings.METRICS_PUBLIC:
        return None
    user = getattr(request, "user", None)
    if user is not None and user.is_active and user.is_staff:
        if not access.access_for(user).limited:
            return None
        return HttpResponse(
            "Metrics count every lock key, and your access rules limit the keys you may "
            "read: ask an administrator, or scrape with the METRICS_TOKEN.\n",
            status=403, content_type="text/plain",
        )
    header = request.headers.get("Authorization", "")
    scheme, _, presented = header.partition(" ")
    expected = str(app_settings.METRICS_TOKEN or "")
    bearer = scheme.lower() == "bearer"
    if bearer and expected and presented:
        if hmac.compare_digest(presented.strip().encode(), expected.encode()):
            return None
        return HttpResponse("Wrong metrics token.\n", status=403, content_type="text/plain")
    signed_in = user is not None and user.is_authenticated
    if bearer and not expected:
        # The scraper is set up and the site is not: say which setting it lacks.
        text = (
            "Metrics are private and this site accepts no bearer token: set "
            'COORDINATION["METRICS_TOKEN"] to the token the scraper sends.\n'
        )
    else:
        text = (
            "Metrics are private: sign in as staff, or send Authorization: Bearer "
            '<COORDINATION["METRICS_TOKEN"]> (COORDINATION["METRICS_PUBLIC"] = True opens '
            "them to anyone).\n"
        )
    response = HttpResponse(text, status=403 if header or signed_in else 401, content_type="text/plain")
    response["WWW-Authenticate"] = 'Bearer realm="metrics"'
    return response
