"""The site under ``gunicorn project.wsgi``, as production runs it: what the server
answers itself and what reaches the API's JSON answers (gunicorn.conf.py)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.processes.test_third_party_site import free_port
from tests.support.celery_workers import REPO, worker_environment

pytestmark = [
    pytest.mark.legs("pg", reason="one run of the production server; its limits are the same on every leg"),
]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """``gunicorn project.wsgi`` started in the repository (so it reads gunicorn.conf.py); its port."""
    var_dir = tmp_path_factory.mktemp("var")
    env = worker_environment(None, COORDINATION_VAR_DIR=str(var_dir), DJANGO_ALLOWED_HOSTS="127.0.0.1")
    env.pop("DJANGO_DEBUG", None)
    port = free_port()
    log = var_dir / "gunicorn.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "gunicorn", "project.wsgi", "--bind", f"127.0.0.1:{port}", "-w", "1"],
            cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 90
        while True:
            with contextlib.suppress(OSError):
                if raw(port, b"GET /api/ HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")[0]:
                    break
            if process.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"gunicorn did not answer:\n{log.read_text()[-3000:]}")
            time.sleep(0.1)
        yield port
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(10)


def raw(port: int, request: bytes) -> tuple[int, str, bytes]:
    """Send ``request`` as it is; the status, the Content-Type and the body answered."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as connection:
        connection.sendall(request)
        answer = b""
        while chunk := connection.recv(65536):
            answer += chunk
            if b"\r\n\r\n" in answer:
                head, _, body = answer.partition(b"\r\n\r\n")
                length = next(
                    (int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                     if line.lower().startswith(b"content-length:")), None,
                )
                if length is not None and len(body) >= length:
                    break
    head, _, body = answer.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ")[1]) if lines[0].startswith("HTTP/") else 0
    content_type = next(
        (line.split(":", 1)[1].strip() for line in lines[1:] if line.lower().startswith("content-type:")), ""
    )
    return status, content_type, body


def get(port: int, path: str, *headers: str) -> tuple[int, str, bytes]:
    lines = [f"GET {path} HTTP/1.1", "Host: 127.0.0.1", "Connection: close", *headers]
    return raw(port, ("\r\n".join(lines) + "\r\n\r\n").encode())


def test_a_key_far_longer_than_the_api_accepts_still_gets_the_apis_json(server: int) -> None:
    # 7,900 characters: past gunicorn's default request-line limit (4,094 bytes),
    # within the site's (8,190), so the API itself refuses it, in JSON.
    status, content_type, body = get(server, "/api/locks/" + "k" * 7900 + "/acquire")
    assert status == 401 and content_type == "application/json", (status, content_type, body[:200])


def test_past_the_servers_own_limit_gunicorn_answers_414_as_the_docs_say(server: int) -> None:
    status, _, _ = get(server, "/api/locks/" + "k" * 9000)
    assert status == 414


def test_an_undecodable_charset_is_415_from_the_server_too(server: int) -> None:
    status, content_type, body = get(server, "/api/locks/?a=b", "Content-Type: text/plain; charset=zlib")
    assert (status, content_type) == (415, "application/json"), body
    status, content_type, _ = get(server, "/admin/login/?next=/x", "Content-Type: text/plain; charset=hex")
    assert status == 415 and content_type.startswith("text/plain")


def test_a_malformed_content_length_is_the_servers_400_as_the_docs_say(server: int) -> None:
    status, _, _ = raw(
        server, b"POST /api/locks/a/acquire HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: -1\r\n\r\n"
    )
    assert status == 400


def test_the_configuration_is_the_one_in_the_repository() -> None:
    assert (Path(REPO) / "gunicorn.conf.py").is_file()
