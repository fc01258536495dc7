"""Prometheus metrics of the outbox (extra ``[metrics]``).

- ``coordination_outbox_transitions_total{state}``: calls that entered each
  state, counted from :data:`~coordination.stores.outbox.call_state_changed` in
  the process where the transition committed;
- ``coordination_outbox_calls{state}``: the calls in each state now, read from
  the database at scrape time (true whichever process moved them).

Importing the module connects the counter; :func:`install` registers the gauge
with a registry (the default one unless given), once.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from django.db import DatabaseError
from django.db.models import Count
from prometheus_client import REGISTRY, CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ..models import OutboxCall, OutboxState
from .outbox import call_state_changed

TRANSITIONS = Counter(
    "coordination_outbox_transitions", "Outbox calls that entered a state.", ["state"]
)


def _count(sender: object, state: str = "", **kwargs: Any) -> None:
    TRANSITIONS.labels(state=state).inc()


call_state_changed.connect(_count, dispatch_uid="coordination.outbox.metrics")


class OutboxCollector(Collector):
    """The calls in each state, read at scrape time."""

    def describe(self) -> Iterable[Metric]:
        # What registering asks for: the names, without reading the database (the
        # app registers the collector in its ready(), before any query may run).
        return [self._gauge()]

    def _gauge(self) -> GaugeMetricFamily:
        return GaugeMetricFamily("coordination_outbox_calls", "Outbox calls by state.", labels=["state"])

    def collect(self) -> Iterable[Metric]:
        gauge = self._gauge()
        try:
            counts = dict(OutboxCall.objects.values_list("state").annotate(n=Count("id")))
        except DatabaseError:
            return []
        for state in OutboxState.values:
            gauge.add_metric([state], counts.get(state, 0))
        return [gauge]


_installed: set[int] = set()


def install(registry: CollectorRegistry = REGISTRY) -> None:
    if id(registry) not in _installed:
        registry.register(OutboxCollector())
        _installed.add(id(registry))
