"""The frame of a chaos run of real Celery processes: the beat run's and the jobs run's.

A run has a seed, a work directory for the processes' logs, and a tag that
names its queue and its Redis keys, so that runs on one Redis never meet. Its
processes are ``celery`` commands started under a settings module of the lab
(``project.lab.chaos.<kind>_settings``) over the site's own settings and this
process's database, each in a session of its own (so a SIGKILL reaches its
pool). :meth:`CeleryChaos.run` always stops every process it started, removes
the run's Redis keys and, unless ``COORDINATION_<KIND>_CHAOS_KEEP`` is set, its
work directory.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

from django.conf import settings
from django.db import connections

__all__ = ["CeleryChaos", "ChaosProcess", "Output", "RunConfig"]


class Output(Protocol):
    def write(self, text: str, /) -> Any: ...


class RunConfig(Protocol):
    """What the frame reads of a run's configuration."""

    seed: int | None
    broker: str | None
    celery_app: str


@dataclass
class ChaosProcess:
    """A ``celery`` process of the run: its log, and whether the run paused it."""

    name: str
    process: subprocess.Popen[bytes]
    log: Path
    paused: bool = False

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


C = TypeVar("C", bound=RunConfig)


class CeleryChaos(Generic[C]):
    """One run; a subclass names its ``kind`` (``beat``, ``jobs``), writes ``_run``
    and lists its processes in ``_processes``."""

    kind = "celery"
    label = "chaos"

    def __init__(self, config: C, out: Output | None = None) -> None:
        self.config = config
        self.out = out or sys.stdout
        self.seed = config.seed if config.seed is not None else random.randrange(2**32)
        self.rng = random.Random(self.seed)
        self.workdir = Path(tempfile.mkdtemp(prefix=f"coordination-{self.kind}-chaos-"))
        self.tag = uuid.uuid4().hex[:10]
        self.queue = f"coordination-{self.kind}-{self.tag}"
        self.prefix = f"coordination-{self.kind}-{self.tag}:"
        self.spawned = 0
        self.started = 0.0

    def run(self) -> Any:
        try:
            return self._run()
        finally:
            self._cleanup()

    def _run(self) -> Any:
        raise NotImplementedError

    def _processes(self) -> list[ChaosProcess]:
        raise NotImplementedError

    # --- processes -------------------------------------------------------------------

    def _broker(self) -> str:
        return self.config.broker or str(getattr(settings, "CELERY_BROKER_URL", ""))

    def _settings(self) -> dict[str, str]:
        """The run's own ``COORDINATION_<KIND>_...`` variables for its processes."""
        return {}

    def _environment(self) -> dict[str, str]:
        """The site on the path, the lab's settings over the site's own, this
        process's database and the run's broker, keys and settings."""
        database = json.loads(json.dumps(connections["default"].settings_dict, default=str))
        database["CONN_MAX_AGE"] = 0
        database.pop("TEST", None)
        import project

        root = str(Path(project.__file__).resolve().parent.parent)
        name = f"COORDINATION_{self.kind.upper()}"
        return {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(p for p in [root, os.environ.get("PYTHONPATH", "")] if p),
            "DJANGO_SETTINGS_MODULE": f"project.lab.chaos.{self.kind}_settings",
            f"{name}_BASE_SETTINGS": settings.SETTINGS_MODULE,
            f"{name}_DATABASE": json.dumps(database),
            f"{name}_BROKER": self._broker(),
            f"{name}_PREFIX": self.prefix,
            "COORDINATION_LOG_LEVEL": "INFO",
            **self._settings(),
        }

    def _start(self, name: str, arguments: list[str]) -> ChaosProcess:
        """Start ``celery -A <app> <arguments>``, its output appended to ``<name>.log``."""
        log = self.workdir / f"{name}.log"
        command = [sys.executable, "-m", "celery", "-A", self.config.celery_app, *arguments]
        with open(log, "ab") as out:
            process = subprocess.Popen(
                command, cwd=self.workdir, env=self._environment(), stdin=subprocess.DEVNULL,
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            )
        return ChaosProcess(name, process, log)

    # --- helpers ---------------------------------------------------------------------

    def _wait(self, condition: Any, timeout: float, what: str) -> Any:
        """Poll ``condition`` until it returns a true value (returned), or fail with
        the processes' logs after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                value = condition()
            except Exception:  # a query on a connection the faults or the server dropped
                connections["default"].close()
                value = None
            if value:
                return value
            if time.monotonic() > deadline:
                logs = "\n".join(f"--- {p.name}\n{p.text()[-2500:]}" for p in self._processes())
                raise AssertionError(
                    f"{self.label}: waited {timeout:.0f} s for {what}\n{self._diagnostics()}\n{logs}"
                )
            time.sleep(0.1)

    def _diagnostics(self) -> str:
        """For a failed wait: what else the run can say about its state."""
        return ""

    def _say(self, message: str) -> None:
        self.out.write(message + "\n")

    def _forget(self) -> None:
        """Remove what the run left in the database (called at its end, errors ignored)."""

    def _cleanup(self) -> None:
        for process in self._processes():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGCONT)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            with contextlib.suppress(Exception):
                process.process.wait(10)
        if self._broker().startswith("redis"):
            with contextlib.suppress(Exception):
                import redis

                client = redis.Redis.from_url(self._broker())
                keys = list(client.scan_iter(match=self.prefix + "*", count=500))
                keys += [f"_kombu.binding.{self.queue}", f"_kombu.binding_permanent.{self.queue}"]
                client.delete(*keys)
        with contextlib.suppress(Exception):  # the database may be what failed
            self._forget()
        if not os.environ.get(f"COORDINATION_{self.kind.upper()}_CHAOS_KEEP"):
            shutil.rmtree(self.workdir, ignore_errors=True)
