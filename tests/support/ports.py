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
    """``port`` held by another program for the block: a socket of this process
    listening on 127.0.0.1 that never answers (what a program the scripts did
    not start looks like to them), or, when the port cannot be bound, whatever
    holds it already."""
    with socket.socket() as listener:
        try:
            listener.bind(("127.0.0.1", port))
            listener.listen()
        except OSError:
            pass  # someone holds it already: taken all the same
        yield
