"""Faults the chaos controller injects, and the PostgreSQL server it may manage.

Process faults use real signals on real worker processes: SIGSTOP/SIGCONT for a
pause (a GC or VM pause the process does not notice), SIGKILL for a crash.
Connection faults use ``pg_terminate_backend``, only on backends of the run's own
database. Server restarts only ever touch a throwaway cluster this module created
(:class:`ManagedPostgres`), never a server someone else runs.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

__all__ = ["FAULT_KINDS", "ManagedPostgres", "ManagedServerError", "postgres_bindir"]

FAULT_KINDS = ("pause", "kill", "terminate_backend", "restart_fast", "restart_immediate")


class ManagedServerError(RuntimeError):
    """The throwaway PostgreSQL server could not be set up, started or restarted."""


def postgres_bindir() -> Path | None:
    """Where initdb and pg_ctl are: $COORDINATION_PG_BINDIR, Debian's layout, or PATH."""
    configured = os.environ.get("COORDINATION_PG_BINDIR")
    candidates = [configured] if configured else []
    candidates += sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=_version, reverse=True)
    found = shutil.which("pg_ctl")
    if found:
        candidates.append(str(Path(found).parent))
    for candidate in candidates:
        if candidate and (Path(candidate) / "initdb").exists() and (Path(candidate) / "pg_ctl").exists():
            return Path(candidate)
    return None


def _version(path: str) -> int:
    with contextlib.suppress(ValueError):
        return int(Path(path).parent.name)
    return 0


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class ManagedPostgres:
    """A throwaway PostgreSQL cluster under a temporary directory, on a free port.

    Run as root, the server runs as the ``postgres`` OS user (PostgreSQL refuses
    to run as root). ``stop()`` removes everything; call it on every exit path.
    """

    database = "chaos"
    user = "chaos"

    def __init__(self, bindir: Path | None = None) -> None:
        found = bindir or postgres_bindir()
        if found is None:
            raise ManagedServerError(
                "--manage-postgres needs the PostgreSQL server binaries (initdb, pg_ctl); "
                "install postgresql or set COORDINATION_PG_BINDIR"
            )
        self.bindir = found
        self.root = Path(tempfile.mkdtemp(prefix="coordination-chaos-pg-"))
        self.data = self.root / "data"
        self.log = self.root / "server.log"
        self.port = _free_port()
        self.restarts = 0
        self._as_postgres = os.geteuid() == 0

    def _run(self, *args: str, timeout: float = 120) -> None:
        command = [str(self.bindir / args[0]), *args[1:]]
        if self._as_postgres:
            command = ["runuser", "-u", "postgres", "--", *command]
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)
        if result.returncode != 0:
            raise ManagedServerError(
                f"{args[0]} failed ({result.returncode}): {result.stderr.strip() or result.stdout.strip()}"
            )

    def _pg_ctl(self, *args: str) -> None:
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-w", "-t", "60", *args)

    def start(self) -> None:
        if self._as_postgres:
            shutil.chown(self.root, "postgres", "postgres")
        self._run("initdb", "-D", str(self.data), "-U", self.user, "--auth=trust", "-E", "UTF8",
                  "--no-sync", "--no-instructions")
        options = (f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 "
                   "-c max_connections=200 -c fsync=on -c synchronous_commit=on")
        self._pg_ctl("-o", options, "start")
        self._run("createdb", "-h", "127.0.0.1", "-p", str(self.port), "-U", self.user, self.database)

    def restart(self, mode: str) -> float:
        """Restart with ``pg_ctl restart -m fast|immediate``; returns the seconds it took."""
        started = time.monotonic()
        self._pg_ctl("-m", mode, "restart")
        self.restarts += 1
        return time.monotonic() - started

    def settings_dict(self) -> dict[str, Any]:
        return {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": self.database,
            "USER": self.user,
            "PASSWORD": "",
            "HOST": "127.0.0.1",
            "PORT": str(self.port),
            "CONN_MAX_AGE": 0,
        }

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            if (self.data / "postmaster.pid").exists():
                self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "-t", "30", "stop")
        shutil.rmtree(self.root, ignore_errors=True)
