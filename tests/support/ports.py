"""Ports for the tests of the scripts that choose them: the scripts' own search
(``free_port`` of bin/_bootstrap.sh, so a test asks exactly what a script
would), and a port held by another program for a while."""

from __future__ import annotations

import socket
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

BOOTSTRAP = Path(__file__).resolve().parents[2] / "bin" / "_bootstrap.sh"


def free_port(first: int, count: int = 1) -> int:
    """The first port from ``first`` where ``count`` free ports follow, as the
    scripts find it. Raises CalledProcessError if there is none."""
    found = subprocess.run(
        ["bash", "-c", 'source "$0" && free_port "$1" "$2"', str(BOOTSTRAP), str(first), str(count)],
        capture_output=True, text=True, check=True, timeout=30,
    )
    return int(found.stdout)


@contextmanager
def taken(port: int) -> Iterator[None]:
    """``port`` held for the block by a socket of this process that listens on
    127.0.0.1 and never answers: what a program the scripts did not start looks
    like to them. Raises OSError if the port cannot be bound (find it with
    :func:`free_port` first)."""
    with socket.socket() as listener:
        # As servers bind (and free_port probes): a port left in TIME_WAIT is free.
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", port))
        listener.listen()
        yield
