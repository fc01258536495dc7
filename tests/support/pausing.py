"""Pausing a real process the way a GC or VM pause does: SIGSTOP, then SIGCONT.

Every test that stops a process goes through :func:`paused`, so a failing
assertion inside the pause can never leave a worker, a server or a cluster
node stopped for the tests that follow (a module's shared worker that stays
stopped turns one failure into a cascade of timeouts).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def paused(process: int | subprocess.Popen[Any]) -> Iterator[None]:
    """Stop ``process`` (a pid or a ``Popen``) for the block; resume it when the
    block ends, however it ends.

    A process that has already gone (killed by the block, or exited) is not an
    error at resumption. Reaping a child stays with whoever started it.
    """
    pid = process if isinstance(process, int) else process.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
