"""bin/run, the main job's command, as a developer runs it.

- With port 8000 taken (a site of their own already running), ``bin/run --check``
  serves on the next free port and passes: CI's smoke test must not fail over it.
- ``bin/run 2>&1 | tee log`` stopped with Ctrl-C in a terminal leaves no process
  behind: the terminal's SIGINT reaches tee as well, and bin/run's cleanup, which
  writes to the closed pipe, must still stop the worker and the server.

Each run uses its own ``COORDINATION_VAR_DIR`` (database, broker folder, logs), and
its processes are found by that directory in their environment.
"""

from __future__ import annotations

import contextlib
import os
import pty
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.legs(
    "sqlite", reason="bin/run's own setup is the embedded SQLite default; one run is enough"
)


def run_environment(var_dir: Path) -> dict[str, str]:
    env = {
        name: value for name, value in os.environ.items()
        if not name.startswith(("DJANGO_", "COORDINATION_", "CELERY_", "PYTEST_"))
        and name not in {"DATABASE_URL", "PORT"}
    }
    env["COORDINATION_VAR_DIR"] = str(var_dir)
    return env


def processes_of(var_dir: Path) -> list[int]:
    """The pids whose environment names ``var_dir`` (what bin/run started for it)."""
    marker = f"COORDINATION_VAR_DIR={var_dir}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if marker in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


@pytest.fixture
def port_8000() -> Iterator[None]:
    """Port 8000 taken, by this test if nobody holds it already."""
    holder = socket.socket()
    holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        holder.bind(("127.0.0.1", 8000))
        holder.listen()
    except OSError:
        pass  # someone else's: taken all the same
    try:
        yield
    finally:
        holder.close()


@pytest.mark.usefixtures("port_8000")
def test_the_smoke_test_serves_on_the_next_free_port_when_8000_is_taken(tmp_path: Path) -> None:
    done = subprocess.run(
        ["bin/run", "--check"], cwd=REPO, env=run_environment(tmp_path / "var"),
        capture_output=True, text=True, timeout=600, check=False,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    assert "port 8000 is taken; serving on" in output, output[-3000:]


def test_ctrl_c_of_bin_run_piped_into_tee_leaves_no_process(tmp_path: Path) -> None:
    var_dir = tmp_path / "var"
    log = tmp_path / "run.log"
    env = run_environment(var_dir)
    env["PORT"] = str(_free_port())
    pid, terminal = pty.fork()
    if pid == 0:  # the child: a shell in its own terminal, as a developer's
        os.chdir(REPO)
        os.execvpe("bash", ["bash", "-c", f"bin/run 2>&1 | tee {log}"], env)
    try:
        started = time.monotonic()
        seen = b""
        # The hardest moment: the demo's worker A is stopped (SIGSTOP), so it cannot
        # see the Ctrl-C or a SIGTERM; the demo must end it all the same.
        paused = b"A pause (SIGSTOP)"
        while paused not in seen and time.monotonic() - started < 300:
            try:
                seen += os.read(terminal, 65536)
            except OSError:
                break
        assert b"Admin:" in seen and paused in seen, seen.decode(errors="replace")[-3000:]
        assert processes_of(var_dir), "bin/run started nothing?"
        os.write(terminal, b"\x03")  # Ctrl-C: SIGINT to the terminal's foreground group
        deadline = time.monotonic() + 90
        while processes_of(var_dir) and time.monotonic() < deadline:
            with contextlib.suppress(OSError):  # keep the terminal drained
                os.read(terminal, 65536)
            time.sleep(0.5)
        left = processes_of(var_dir)
        assert left == [], f"still running after Ctrl-C: {[_command(p) for p in left]}"
    finally:
        for leftover in processes_of(var_dir):
            os.kill(leftover, signal.SIGKILL)
        os.close(terminal)
        os.waitpid(pid, 0)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def _command(pid: int) -> str:
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return str(pid)
