"""The Patroni + etcd cluster of tests/cluster/, driven through bin/cluster.sh.

The app reaches it as a database alias of its own (``CLUSTER_ALIAS``) whose
settings say what a site's DATABASES entry would: the three nodes as one
multi-host libpq address with ``target_session_attrs=read-write``, so every new
connection finds the current primary. dj-database-url cannot parse a
multi-host URL, so the entry is built here (:func:`database_settings`).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from project.lab.chaos.patroni import Member, PatroniCluster, PatroniError

CLUSTER_ALIAS = "cluster"


def missing_parts() -> str | None:
    """What the cluster needs and this machine lacks, or None."""
    if shutil.which("etcd") is None:
        return "etcd (apt-get install etcd-server)"
    venv = PatroniCluster().script("venv").strip()
    if not (Path(venv) / "bin" / "patroni").exists():
        return f"Patroni (a virtualenv at {venv} from requirements/ha.txt; bin/test creates it)"
    if not Path("/usr/lib/postgresql/15/bin/initdb").exists() and "COORDINATION_PG_BIN" not in os.environ:
        return "PostgreSQL 15 server binaries (apt-get install postgresql-15)"
    return None


def database_settings() -> dict[str, Any]:
    """The DATABASES entry of the cluster: the multi-host form of libpq."""
    return PatroniCluster().database_settings()


class Cluster(PatroniCluster):
    """The running cluster as the tests drive it: start, stop, replication
    mode and health on top of the chaos tool's inspection and kills
    (:class:`project.lab.chaos.patroni.PatroniCluster`); a wait that times out
    fails the test."""

    def start(self) -> None:
        self.script("start")
        self._ports = None  # a new cluster may be on other ports than asked before

    def stop(self) -> None:
        self.script("stop", timeout=120)

    def set_mode(self, mode: str) -> None:
        self.script("mode", mode)

    def wait(self, ready: Any, what: str, timeout: float = 90, stop: Any = None) -> Any:
        """Poll ``ready()`` until it returns something true; fail after ``timeout``."""
        try:
            return super().wait(ready, what, timeout, stop)
        except PatroniError as error:
            raise AssertionError(str(error)) from None

    def wait_healthy(self, replicas: int = 2, sync: bool = False) -> Member:
        def ready() -> Member | None:
            members = self.members()
            leader = self.leader()
            streaming = [m for m in members if m.role in ("replica", "sync_standby", "quorum_standby")
                         and m.state == "streaming"]
            if sync and not any(m.role == "sync_standby" for m in streaming):
                return None
            return leader if leader and len(streaming) >= replicas else None

        found: Member = self.wait(ready, f"a leader and {replicas} streaming replicas")
        return found
