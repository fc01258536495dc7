"""One Patroni + etcd cluster for the whole session (bin/cluster.sh), reached
through the ``cluster`` database alias (tests/support/cluster.py)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
from django.core.management import call_command
from django.db import connections

from project.lab.chaos.patroni import NODES, PatroniCluster
from tests.support.cluster import CLUSTER_ALIAS, Cluster, database_settings, missing_parts
from tests.support.legs import missing_service
from tests.support.ports import free_port, taken


@pytest.fixture(scope="session")
def squatted_port() -> Iterator[int | None]:
    """A port where the cluster would put node 2's PostgreSQL, held for the session
    by a plain listening socket, as on a machine that runs another PostgreSQL
    there: bin/cluster.sh must go past it (tests/cluster/test_ports.py). None when
    COORDINATION_HA_PG_PORT gives the ports."""
    if os.environ.get("COORDINATION_HA_PG_PORT"):
        yield None
        return
    first = free_port(PatroniCluster().ports["PG_PORT"], len(NODES))
    with taken(first + 1):
        yield first + 1


@pytest.fixture(scope="session")
def cluster(django_db_setup: Any, django_db_blocker: Any, squatted_port: int | None) -> Iterator[Cluster]:
    """The running cluster, migrated, as the ``cluster`` alias; stopped at the end
    (left running with COORDINATION_KEEP_SERVICES=1, as bin/test leaves its servers).
    It is started with a port it would otherwise take held by another process."""
    missing = missing_parts()
    if missing is not None:
        missing_service(missing)
    running = Cluster()
    try:
        running.start()
    except BaseException:
        running.stop()
        raise
    configured = connections.configure_settings(
        {"default": connections.settings["default"], CLUSTER_ALIAS: database_settings()}
    )
    entry = configured[CLUSTER_ALIAS]
    connections.settings[CLUSTER_ALIAS] = entry
    try:
        with django_db_blocker.unblock():
            call_command("migrate", database=CLUSTER_ALIAS, verbosity=0)
        yield running
    finally:
        connections[CLUSTER_ALIAS].close()
        del connections.settings[CLUSTER_ALIAS]
        if os.environ.get("COORDINATION_KEEP_SERVICES") != "1":
            running.stop()


@pytest.fixture
def cluster_db(cluster: Cluster, django_db_blocker: Any, settings: Any) -> Iterator[Cluster]:
    """The cluster as the app's database (``COORDINATION["DATABASE"]``), with
    database access allowed in any thread."""
    settings.COORDINATION = {
        **(getattr(settings, "COORDINATION", None) or {}), "DATABASE": CLUSTER_ALIAS,
    }
    with django_db_blocker.unblock():
        yield cluster
