"""tests.support.pausing.paused: the process is stopped inside the block and
running again after it, however the block ends (a failing assertion included),
so one failed test cannot leave a worker stopped for the tests after it."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.pausing import paused


def state(pid: int) -> str:
    """The process's state letter from /proc: ``T`` when stopped."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat.rpartition(")")[2].split()[0]


def wait_until(pid: int, stopped: bool) -> None:
    deadline = time.monotonic() + 10
    while (state(pid) == "T") != stopped:
        assert time.monotonic() < deadline, f"process {pid} in state {state(pid)!r}, stopped={stopped}"
        time.sleep(0.01)


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        yield process
    finally:
        process.kill()
        process.wait(10)


def test_the_process_is_stopped_inside_and_running_after(sleeper: subprocess.Popen[bytes]) -> None:
    with paused(sleeper):
        wait_until(sleeper.pid, stopped=True)
    wait_until(sleeper.pid, stopped=False)


def test_a_failure_inside_the_pause_still_resumes_the_process(sleeper: subprocess.Popen[bytes]) -> None:
    with pytest.raises(AssertionError, match="a failing check"), paused(sleeper.pid):
        wait_until(sleeper.pid, stopped=True)
        raise AssertionError("a failing check")
    wait_until(sleeper.pid, stopped=False)


def test_a_process_gone_during_the_pause_is_not_an_error(sleeper: subprocess.Popen[bytes]) -> None:
    with paused(sleeper):
        sleeper.kill()
        sleeper.wait(10)
