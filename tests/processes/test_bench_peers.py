"""The bench's etcd peer against a real etcd: its lock refuses a held key and
grants a free one, and a peer that cannot run is skipped with a reason.

etcd is optional for the bench, not for the suite: bin/test installs it (the
cluster tests need it too), and without it the etcd test is a missing service.
"""

from __future__ import annotations

import base64
import json
import shutil
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from project.lab import benchmarks
from tests.support.legs import missing_service

pytestmark = pytest.mark.legs(
    "pg", reason="the peers need no database; once is enough"
)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture
def etcd_url(tmp_path: Path) -> Iterator[str]:
    binary = shutil.which("etcd")
    if binary is None:
        missing_service("etcd (apt-get install etcd-server)")
    client, peer = _free_port(), _free_port()
    url = f"http://127.0.0.1:{client}"
    server = subprocess.Popen(
        [binary, "--name", "t", "--data-dir", str(tmp_path / "etcd"),
         "--listen-client-urls", url, "--advertise-client-urls", url,
         "--listen-peer-urls", f"http://127.0.0.1:{peer}",
         "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
         "--initial-cluster", f"t=http://127.0.0.1:{peer}", "--log-level", "error"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        while benchmarks.etcd_available(url) is not None:
            assert server.poll() is None, "etcd exited"
            assert time.monotonic() < deadline, f"etcd did not answer: {benchmarks.etcd_available(url)}"
            time.sleep(0.2)
        yield url
    finally:
        server.terminate()
        try:
            server.wait(15)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def _put(url: str, key: str) -> None:
    body = json.dumps({"key": base64.b64encode(key.encode()).decode(), "value": "eA=="})
    request = urllib.request.Request(f"{url}/v3/kv/put", body.encode(), method="POST")
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.status == 200


def _exists(url: str, key: str) -> bool:
    body = json.dumps({"key": base64.b64encode(key.encode()).decode()})
    request = urllib.request.Request(f"{url}/v3/kv/range", body.encode(), method="POST")
    with urllib.request.urlopen(request, timeout=10) as response:
        return int(json.loads(response.read()).get("count", 0)) > 0


def test_etcd_peer_refuses_a_held_key_and_grants_and_releases_a_free_one(etcd_url: str) -> None:
    cycle = benchmarks.etcd_client(etcd_url, hot=True)(0)
    _put(etcd_url, "bench-hot")  # someone else holds the hot key
    assert cycle() is False
    assert _exists(etcd_url, "bench-hot")  # a refused try leaves the holder's key alone

    urllib.request.urlopen(urllib.request.Request(
        f"{etcd_url}/v3/kv/deleterange",
        json.dumps({"key": base64.b64encode(b"bench-hot").decode()}).encode(), method="POST",
    ), timeout=10).close()
    assert cycle() is True and cycle() is True  # granted, and released each time
    assert not _exists(etcd_url, "bench-hot")


def test_peers_that_cannot_run_say_why() -> None:
    assert "no etcd URL" in str(benchmarks.etcd_available(None))
    assert "does not answer" in str(benchmarks.etcd_available(f"http://127.0.0.1:{_free_port()}"))
    assert "no ZooKeeper hosts" in str(benchmarks.zookeeper_available(None))
