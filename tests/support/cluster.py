"""The Patroni + etcd cluster of tests/cluster/, driven through bin/cluster.sh.

The app reaches it as a database alias of its own (``CLUSTER_ALIAS``) whose
settings say what a site's DATABASES entry would: the three nodes as one
multi-host libpq address with ``target_session_attrs=read-write``, so every new
connection finds the current primary. dj-database-url cannot parse a
multi-host URL, so the entry is built here (:func:`database_settings`).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bin" / "cluster.sh"
CLUSTER_ALIAS = "cluster"
NODES = (1, 2, 3)


def _env_port(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


REST_PORT = _env_port("COORDINATION_HA_REST_PORT", 8031)
PG_PORT = _env_port("COORDINATION_HA_PG_PORT", 55431)


def missing_parts() -> str | None:
    """What the cluster needs and this machine lacks, or None."""
    if shutil.which("etcd") is None:
        return "etcd (apt-get install etcd-server)"
    venv = _script("venv").strip()
    if not (Path(venv) / "bin" / "patroni").exists():
        return f"Patroni (a virtualenv at {venv} from requirements/ha.txt; bin/test creates it)"
    if not Path("/usr/lib/postgresql/15/bin/initdb").exists() and "COORDINATION_PG_BIN" not in os.environ:
        return "PostgreSQL 15 server binaries (apt-get install postgresql-15)"
    return None


def _script(*args: str, timeout: float = 180) -> str:
    # Files, not pipes: the servers it starts outlive it, and a pipe one of them
    # inherited would keep the call waiting for an end of file.
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        done = subprocess.run(
            [str(SCRIPT), *args], stdout=out, stderr=err, stdin=subprocess.DEVNULL,
            timeout=timeout, check=False,
        )
        out.seek(0)
        err.seek(0)
        if done.returncode:
            raise RuntimeError(f"bin/cluster.sh {' '.join(args)} failed:\n{err.read()[-3000:]}")
        return out.read()


def database_settings() -> dict[str, Any]:
    """The DATABASES entry of the cluster: the multi-host form of libpq."""
    return {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": "coordination",
        "USER": "coordination",
        "HOST": ",".join("127.0.0.1" for _ in NODES),
        "PORT": ",".join(str(PG_PORT + n - 1) for n in NODES),
        "OPTIONS": {"target_session_attrs": "read-write", "connect_timeout": 3},
    }


@dataclass(frozen=True)
class Member:
    name: str
    role: str
    state: str
    timeline: int | None

    @property
    def node(self) -> int:
        return int(self.name.removeprefix("node"))


class Cluster:
    """The running cluster: start, inspect, kill the leader, restart a node."""

    def start(self) -> None:
        _script("start")

    def stop(self) -> None:
        _script("stop", timeout=120)

    def root(self) -> Path:
        return Path(_script("root").strip())

    def set_mode(self, mode: str) -> None:
        _script("mode", mode)

    def members(self) -> list[Member]:
        for n in NODES:
            try:
                with urllib.request.urlopen(
                    f"http://127.0.0.1:{REST_PORT + n - 1}/cluster", timeout=3
                ) as answer:
                    found = json.load(answer)["members"]
            except (OSError, urllib.error.URLError, ValueError):
                continue
            return [
                Member(m["name"], m["role"], m["state"], m.get("timeline")) for m in found
            ]
        return []

    def leader(self) -> Member | None:
        leaders = [m for m in self.members() if m.role == "leader" and m.state == "running"]
        return leaders[0] if len(leaders) == 1 else None

    def wait(self, ready: Any, what: str, timeout: float = 90) -> Any:
        """Poll ``ready()`` until it returns something true; fail after ``timeout``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = ready()
            if found:
                return found
            time.sleep(0.3)
        raise AssertionError(f"the cluster never reached: {what} (members: {self.members()})")

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

    def kill_node(self, node: int) -> None:
        """SIGKILL the node's Patroni, then its PostgreSQL and every backend: the
        machine dies, nothing shuts down cleanly, the leader key expires."""
        root = self.root() / f"node{node}"
        runner = int((root / "patroni.pid").read_text())
        for pid in [*_children(runner), runner]:
            _kill(pid)
        pidfile = root / "data" / "postmaster.pid"
        if pidfile.exists():
            postmaster = int(pidfile.read_text().split()[0])
            # Stopped first, so it forks no backend after the list is read; a
            # backend left running would go on granting on the dead primary.
            _kill(postmaster, signal.SIGSTOP)
            for pid in _children(postmaster):
                _kill(pid)
            _kill(postmaster)

    def start_node(self, node: int) -> None:
        _script("start-node", str(node))


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(child) for child in text.split()]


def _kill(pid: int, how: signal.Signals = signal.SIGKILL) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, how)
