"""The cluster takes free ports: another process listening where a node would go
(the session's ``squatted_port``) is passed over, not fought, and the cluster
started on the ports after it works."""

from __future__ import annotations

import os
from typing import Any

from django.db import connections

from project.lab.chaos.patroni import NODES
from tests.support.cluster import CLUSTER_ALIAS, Cluster


def test_the_cluster_leaves_a_port_another_process_listens_on_alone(
    cluster: Cluster, squatted_port: int | None, django_db_blocker: Any,
) -> None:
    ours = {port + n for port in (cluster.pg_port, cluster.rest_port) for n in range(len(NODES))}
    ours.add(cluster.etcd_port)
    if squatted_port is None:  # the ports were given: exactly those
        assert cluster.pg_port == int(os.environ["COORDINATION_HA_PG_PORT"])
    else:
        assert squatted_port not in ours

    cluster.wait(cluster.leader, "a leader")  # earlier tests may leave a node down
    with django_db_blocker.unblock(), connections[CLUSTER_ALIAS].cursor() as cursor:
        cursor.execute("SELECT inet_server_port()")
        (port,) = cursor.fetchone()
    assert port in {cluster.pg_port + n for n in range(len(NODES))}
