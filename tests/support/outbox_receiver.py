"""A small HTTP receiver for the outbox tests: it records every request with its
idempotency key, and applies each key's effect once (what a receiver that keeps
idempotency keys does).

``hold`` makes it keep the first request of a key unanswered until ``release``
is set: the test kills the relay meanwhile, between the send and its record.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass
class Receiver:
    url: str = ""
    requests: list[tuple[str, Any]] = field(default_factory=list)
    effects: dict[str, Any] = field(default_factory=dict)
    status: int = 200
    hold: bool = False
    received: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def keys(self) -> list[str]:
        with self.lock:
            return [key for key, _ in self.requests]


@contextmanager
def receiver() -> Iterator[Receiver]:
    state = Receiver()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            key = self.headers.get("Idempotency-Key", "")
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"null")
            with state.lock:
                first = key not in state.effects
                state.requests.append((key, body))
                state.effects.setdefault(key, body)
            state.received.set()
            if state.hold and first:
                state.release.wait(30)
            self.send_response(state.status)
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    state.url = f"http://127.0.0.1:{server.server_address[1]}/hook"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield state
    finally:
        state.release.set()
        server.shutdown()
        server.server_close()
