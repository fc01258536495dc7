"""A TCP proxy in front of a real store that loses the reply to one request.

:meth:`ReplyLosingProxy.lose_reply_to` arms it: the next request whose bytes
contain every given marker (the next ``times`` such requests) is forwarded to
the store, which applies it, and the store's reply is not: the proxy closes the
client's connection instead, as a network partition or a dying load balancer
does between a write and its answer. The client sees the store go away with the outcome unknown; the test
then looks at what the store holds.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator


class ReplyLosingProxy:
    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port: int = self.server.getsockname()[1]
        self.lost = 0  # replies lost so far
        self._markers: tuple[bytes, ...] = ()
        self._times = 0
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def lose_reply_to(self, *markers: bytes, times: int = 1) -> None:
        with self._lock:
            self._markers, self._times, self.lost = markers, times, 0

    def close(self) -> None:
        self.server.close()

    def _armed_by(self, data: bytes) -> bool:
        with self._lock:
            if self._times and all(marker in data for marker in self._markers):
                self._times -= 1
                return True
        return False

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        upstream = socket.create_connection(self.upstream)
        cut = threading.Event()

        def forward_requests() -> None:
            with contextlib.suppress(OSError):
                while data := client.recv(65536):
                    if self._armed_by(data):
                        cut.set()
                    upstream.sendall(data)

        threading.Thread(target=forward_requests, daemon=True).start()
        with contextlib.suppress(OSError):
            while data := upstream.recv(65536):
                # An HTTP "100 Continue" asks for the body: not the answer yet.
                if cut.is_set() and not data.startswith(b"HTTP/1.1 100 "):
                    with self._lock:  # the store answered the armed request: drop the answer
                        self.lost += 1
                    break
                client.sendall(data)
        for end in (client, upstream):
            with contextlib.suppress(OSError):
                end.shutdown(socket.SHUT_RDWR)
            end.close()


@contextlib.contextmanager
def reply_losing_proxy(host: str, port: int) -> Iterator[ReplyLosingProxy]:
    proxy = ReplyLosingProxy((host, port))
    try:
        yield proxy
    finally:
        proxy.close()
