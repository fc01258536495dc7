"""The scripts that start servers take free ports and use nothing they did not
start: with another program listening on the port a script would take (the
default, unless something holds it already; a plain socket here) the private
Redis and the bench's etcd start on another port and work, and a taken port
the caller names fails at once, before anything starts.

Each script runs with a lock directory (or peers directory) of its own, so
no server of another run counts as ours.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from project.lab import benchmarks
from tests.support.legs import missing_service
from tests.support.ports import free_port, taken

pytestmark = pytest.mark.legs("pg", reason="the scripts need no database; once is enough")

REPO = Path(__file__).resolve().parents[2]
# The scripts' defaults (bin/services.sh, bin/bench-peers.sh).
REDIS_DEFAULT, BENCH_ETCD_DEFAULT = 63799, 23850
# What names a port or a server to the scripts; a test gives none of it unless it says.
PORT_VARIABLES = (
    "COORDINATION_PG_PORT", "COORDINATION_REDIS_PORT", "COORDINATION_TEST_DATABASE_URL",
    "COORDINATION_TEST_REDIS_URL", "COORDINATION_KEEP_SERVICES", "COORDINATION_HA_ETCD_PORT",
    "COORDINATION_HA_REST_PORT", "COORDINATION_HA_PG_PORT", "COORDINATION_BENCH_ETCD_PORT",
    "COORDINATION_BENCH_ZOOKEEPER_PORT", "COORDINATION_MARIADB_PORT", "COORDINATION_TEST_MARIADB_URL",
    "COORDINATION_MARIADB_DURABLE",
)


def script_env(**extra: str) -> dict[str, str]:
    env = {name: value for name, value in os.environ.items() if name not in PORT_VARIABLES}
    return {**env, **extra}


def bash(script: str, env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", "-c", script], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout, check=False)


def test_redis_starts_past_a_port_another_program_listens_on(tmp_path: Path) -> None:
    if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
        missing_service("redis-server and redis-cli (apt-get install redis-server)")
    env = script_env(COORDINATION_SERVICES_LOCK_DIR=str(tmp_path))
    first = free_port(REDIS_DEFAULT)  # the default, on a machine where nothing holds it
    with taken(first):
        done = bash(
            'source bin/services.sh && start_redis && echo "$COORDINATION_REDIS_PORT $(_redis_pid)" '
            '&& cat "$COORDINATION_SERVICES_LOCK_DIR/redis-$COORDINATION_REDIS_PORT.server" '
            '&& redis-cli -p "$COORDINATION_REDIS_PORT" set seen yes '
            '&& redis-cli -u "$COORDINATION_TEST_REDIS_URL" get seen',
            env,
        )
    assert done.returncode == 0, done.stderr
    chosen, pid, recorded_pid, _start_time, *answers = done.stdout.split()
    assert int(chosen) != first and int(chosen) >= REDIS_DEFAULT
    assert pid == recorded_pid  # the Redis there is the one the script started
    assert answers == ["OK", "yes"]  # it works, on the port it exported
    assert free_port(int(chosen)) == int(chosen)  # and the last user out stopped it


@pytest.mark.parametrize("service", ["redis", "postgres"])
def test_a_port_taken_between_the_check_and_the_bind_moves_the_start_on(
    service: str, tmp_path: Path,
) -> None:
    """Two runs with lock directories of their own can both find a port free
    and both start a server on it; the one that loses the bind goes on to the
    next port instead of failing. Here the check is made to say "free" while
    a socket holds the port, which is what the loser sees."""
    if service == "redis" and (shutil.which("redis-server") is None or shutil.which("redis-cli") is None):
        missing_service("redis-server and redis-cli (apt-get install redis-server)")
    port_variable = {"redis": "COORDINATION_REDIS_PORT", "postgres": "COORDINATION_PG_PORT"}[service]
    first = free_port({"redis": REDIS_DEFAULT, "postgres": 54329}[service])
    env = script_env(COORDINATION_SERVICES_LOCK_DIR=str(tmp_path))
    # Unset, the search starts at the default; the default may be in use by this run.
    answers = {
        "redis": 'redis-cli -u "$COORDINATION_TEST_REDIS_URL" ping',
        "postgres": '_pg_psql coordination "select 41 + 1"',
    }[service]
    # bin/services.sh keeps the default port's data in var/pg, another port's in var/pg-<port>.
    data = REPO / "var" / ("pg" if first == 54329 else f"pg-{first}")
    data_before = data.exists()
    with taken(first):
        done = bash(
            # Only the first port is said to be free when it is not; the search
            # then asks the real check, as the loser of a race does.
            "source bin/services.sh && eval \"$(declare -f port_free | sed 1s/port_free/real_port_free/)\" "
            f"&& port_free() {{ (( $1 == {first} )) || real_port_free \"$@\"; }} "
            f"&& start_{service} && echo \"${port_variable}\" && {answers}",
            env, timeout=180,
        )
    assert done.returncode == 0, done.stderr
    chosen, answer = done.stdout.split()
    assert int(chosen) > first  # the lost port was left for the next one
    assert answer == {"redis": "PONG", "postgres": "42"}[service]
    assert "was taken while starting" in done.stderr
    if service == "postgres" and not data_before:
        assert not data.exists()  # the attempt left no data directory


def test_a_taken_port_the_caller_names_fails_the_start_at_once(tmp_path: Path) -> None:
    port = free_port(40000)
    with taken(port):
        for script, variable in (
            ("source bin/services.sh && start_redis", "COORDINATION_REDIS_PORT"),
            ("source bin/services.sh && start_postgres", "COORDINATION_PG_PORT"),
            ("bin/cluster.sh start", "COORDINATION_HA_ETCD_PORT"),
            ("bin/bench-peers.sh start", "COORDINATION_BENCH_ZOOKEEPER_PORT"),
        ):
            started = time.monotonic()
            done = bash(script, script_env(**{
                variable: str(port), "COORDINATION_SERVICES_LOCK_DIR": str(tmp_path / "locks"),
                "COORDINATION_HA_DIR": str(tmp_path / "ha"),
                "COORDINATION_BENCH_PEERS_DIR": str(tmp_path / "peers"),
            }), timeout=60)
            assert done.returncode != 0, f"{script}: {done.stderr}"
            assert f"port {port}" in done.stderr and variable in done.stderr, done.stderr
            # Refused before anything was started: no waiting on a server that cannot bind.
            assert time.monotonic() - started < 20, f"{script} took {time.monotonic() - started:.0f} s"
    assert not (tmp_path / "ha" / "etcd.pid").exists()
    assert not list((tmp_path / "peers").glob("*.pid"))


def test_the_bench_etcd_starts_past_a_port_another_program_listens_on_and_answers() -> None:
    if shutil.which("etcd") is None:
        missing_service("etcd (apt-get install etcd-server)")
    # Not under pytest's tmp_path: as root, etcd runs as the etcd user, who
    # must reach the directory (the script removes it on stop).
    peers = Path(tempfile.mkdtemp(prefix="coordination-bench-peers-test-"))
    peers.chmod(0o755)
    env = script_env(COORDINATION_BENCH_PEERS_DIR=str(peers))
    first = free_port(BENCH_ETCD_DEFAULT, 2)  # its client port, the peer port after it
    with taken(first):
        done = bash("bin/bench-peers.sh start", env)
    try:
        assert done.returncode == 0, done.stderr
        exports = dict(line.removeprefix("export ").split("=", 1) for line in done.stdout.splitlines())
        url = exports["COORDINATION_BENCH_ETCD_URL"]
        assert int(url.rsplit(":", 1)[1]) not in (first - 1, first)  # neither of its ports is the taken one
        assert benchmarks.etcd_available(url) is None  # the bench's own check: it answers
        assert bash("bin/bench-peers.sh env", env).stdout == done.stdout  # recorded for later scripts
    finally:
        bash("bin/bench-peers.sh stop", env)
        shutil.rmtree(peers, ignore_errors=True)


def test_the_bench_mariadb_commits_durably_and_is_never_the_tests_server(tmp_path: Path) -> None:
    """bin/bench-mariadb.sh runs its command against a MariaDB whose commits are
    durable; the tests' server of the same scripts (commits not waiting for the
    disk) on the port it would take is not reused, and is left running."""
    if shutil.which("mariadb-install-db") is None or shutil.which("mariadb") is None:
        missing_service("MariaDB (apt-get install mariadb-server)")
    env = script_env(COORDINATION_SERVICES_LOCK_DIR=str(tmp_path))
    flush = 'mariadb --no-defaults -h 127.0.0.1 -P "$COORDINATION_MARIADB_PORT" -u coordination ' \
        '-pcoordination -N -e "SELECT @@innodb_flush_log_at_trx_commit"'
    tests_server = bash(f'source bin/services.sh && start_mariadb && echo "$COORDINATION_MARIADB_PORT" '
                        f'&& {flush}', {**env, "COORDINATION_KEEP_SERVICES": "1"}, timeout=180)
    assert tests_server.returncode == 0, tests_server.stderr
    port, tests_flush = tests_server.stdout.split()
    try:
        assert tests_flush == "2"
        # The search starts at the default, as the tests' server's did, and passes it.
        bench = bash(f"bin/bench-mariadb.sh bash -c 'echo \"$DATABASE_URL\" && {flush}'", env, timeout=180)
    finally:
        # Reused by a start of the same kind, then stopped by it as the last user out.
        stop = bash("source bin/services.sh && start_mariadb",
                    {**env, "COORDINATION_MARIADB_PORT": port}, timeout=180)
    assert bench.returncode == 0, bench.stderr
    url, bench_flush = bench.stdout.split()
    assert url.startswith("mysql://") and f":{port}/" not in url  # not the tests' server
    assert bench_flush == "1"
    assert "runs innodb_flush_log_at_trx_commit=2, not 1" in bench.stderr
    assert stop.returncode == 0 and "MariaDB: reusing ours" in stop.stderr, stop.stderr
    assert free_port(int(port)) == int(port)
