"""moto's S3 server in a subprocess on a free port, for the object store tests.

``python -m tests.support.s3_server [--serial]`` binds port 0, prints the port
it got on its first line, and serves until killed. ``--serial`` answers one
request at a time: moto checks a conditional write and then stores the object
in two steps, without a lock between them, so only a server that serializes
requests makes the check and the write one step (see
tests/db/stores/test_s3_conditional_writes.py for what the threaded server does).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--serial", action="store_true")
    args = parser.parse_args()
    from moto.moto_server.threaded_moto_server import MotoRequestHandler
    from moto.server import DomainDispatcherApplication, create_backend_app
    from werkzeug.serving import make_server

    app = DomainDispatcherApplication(create_backend_app)
    server = make_server(
        "127.0.0.1", 0, app, threaded=not args.serial, request_handler=MotoRequestHandler
    )
    print(server.port, flush=True)
    server.serve_forever()


@contextmanager
def s3_server(*, serial: bool) -> Iterator[str]:
    """The endpoint URL of a fresh moto S3 server, stopped after the block."""
    env = {**os.environ, "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test"}
    command = [sys.executable, "-m", "tests.support.s3_server", *(["--serial"] if serial else [])]
    process = subprocess.Popen(
        command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    try:
        assert process.stdout is not None
        port = int(process.stdout.readline())
        yield f"http://127.0.0.1:{port}"
    finally:
        process.kill()
        process.wait(timeout=30)


if __name__ == "__main__":
    main()
