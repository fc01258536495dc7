"""500 concurrent ``async with ahold(...)`` requests under a real ASGI server, and
what they do to the server's event loop.

The server is uvicorn running the site (``project.asgi``) with
:mod:`project.lab.asgi_settings`, whose URLs are the views below. A monitor
task in the server's loop sleeps 10 ms at a time and records how late it
wakes up: the event-loop lag every other request on that loop would feel.
The client (this process) opens ``requests`` connections at once, each one
HTTP/1.0 request, and times each answer.

Two ways of calling the grant point from an async view are measured side by
side, in the same run:

- ``ahold``: the app's async API, on its bounded pool of threads
  (``COORDINATION["ASYNC_THREADS"]``, one connection each);
- ``sync_to_async``: ``sync_to_async(locks.acquire)`` and ``locks.release``
  with Django's default ``thread_sensitive=True``, which under ASGI runs each
  request's calls on a thread of that request's own (one thread and one
  database connection per concurrent request).

Used by ``manage.py coordination_asgi_bench``; returns plain dicts.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from asgiref.sync import sync_to_async
from django.http import HttpRequest, JsonResponse
from django.urls import path

from coordination import aio, locks

KEY_PREFIX = "asgi-bench"
MONITOR_INTERVAL = 0.01

# --- the server side: views and the lag monitor -----------------------------------


class LagMonitor:
    """How late a 10 ms sleep wakes up on this event loop, sample by sample."""

    def __init__(self) -> None:
        self.samples: list[float] = []
        self.task: asyncio.Task[None] | None = None

    def ensure_running(self) -> None:
        if self.task is None or self.task.done():
            self.task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        # perf_counter, not loop.time(): uvloop's clock ticks in whole milliseconds.
        while True:
            started = time.perf_counter()
            await asyncio.sleep(MONITOR_INTERVAL)
            self.samples.append(max(0.0, time.perf_counter() - started - MONITOR_INTERVAL))

    def take(self) -> list[float]:
        samples, self.samples = self.samples, []
        return samples


monitor = LagMonitor()


class InFlight:
    """How many requests are inside their block at once (the peak since the last read)."""

    def __init__(self) -> None:
        self.now = 0
        self.peak = 0

    def __enter__(self) -> None:
        self.now += 1
        self.peak = max(self.peak, self.now)

    def __exit__(self, *exc_info: object) -> None:
        self.now -= 1

    def take_peak(self) -> int:
        peak, self.peak = self.peak, self.now
        return peak


in_flight = InFlight()


def _hold_seconds(request: HttpRequest) -> float:
    return min(float(request.GET.get("hold", "0")), 10.0)


async def hold_view(request: HttpRequest, key: str) -> JsonResponse:
    monitor.ensure_running()
    async with locks.ahold(f"{KEY_PREFIX}:{key}", holder="asgi-bench", ttl=30, wait=20) as grant:
        with in_flight:
            await asyncio.sleep(_hold_seconds(request))
        return JsonResponse({"token": grant.token})


async def hold_sync_to_async_view(request: HttpRequest, key: str) -> JsonResponse:
    monitor.ensure_running()
    grant = await sync_to_async(locks.acquire)(
        f"{KEY_PREFIX}:{key}", holder="asgi-bench", ttl=30, wait=20
    )
    try:
        with in_flight:
            await asyncio.sleep(_hold_seconds(request))
        return JsonResponse({"token": grant.token})
    finally:
        await sync_to_async(locks.release)(grant)


async def baseline_view(request: HttpRequest, key: str) -> JsonResponse:
    """The same request with no lock: what the server and Django cost on their own."""
    monitor.ensure_running()
    with in_flight:
        await asyncio.sleep(_hold_seconds(request))
    return JsonResponse({"token": 0})


async def lag_view(request: HttpRequest) -> JsonResponse:
    """The lag samples (seconds) since the last call; starts the monitor."""
    monitor.ensure_running()
    return JsonResponse({"samples": monitor.take(), "peak_in_flight": in_flight.take_peak()})


urlpatterns = [
    path("hold/ahold/<str:key>", hold_view),
    path("hold/sync_to_async/<str:key>", hold_sync_to_async_view),
    path("hold/baseline/<str:key>", baseline_view),
    path("lag", lag_view),
]

# --- the client side -----------------------------------------------------------------


async def _get(port: int, target: str, timeout: float) -> tuple[int, bytes, float]:
    started = time.perf_counter()
    reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), timeout)
    try:
        writer.write(
            f"GET {target} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n".encode()
        )
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), timeout)
    finally:
        writer.close()
    status = int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/") else 0
    head, _, body = answer.partition(b"\r\n\r\n")
    if b"transfer-encoding: chunked" in head.lower():
        body = _unchunk(body)
    return status, body, time.perf_counter() - started


def _unchunk(body: bytes) -> bytes:
    """The payload of a chunked HTTP/1.1 body (uvicorn's httptools side chunks)."""
    payload, rest = b"", body
    while rest:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line.split(b";")[0] or b"0", 16)
        if size == 0:
            break
        payload, rest = payload + rest[:size], rest[size + 2:]
    return payload


async def _burst(
    port: int, mode: str, requests: int, run_id: str, timeout: float, ramp: float = 0.0,
    hold: float = 0.0,
) -> dict[str, Any]:
    async def one(index: int) -> tuple[int, float]:
        # Arrivals spread evenly over ``ramp`` seconds; each holds ``hold`` seconds.
        await asyncio.sleep(ramp * index / requests)
        try:
            status, _body, took = await _get(
                port, f"/hold/{mode}/{run_id}-{index}?hold={hold}", timeout
            )
        except (OSError, TimeoutError):
            return 0, timeout
        return status, took

    began = time.perf_counter()
    answers = await asyncio.gather(*(one(i) for i in range(requests)))
    wall = time.perf_counter() - began
    latencies = sorted(took for status, took in answers if status == 200)
    return {
        "requests": requests,
        "ok": len(latencies),
        "errors": requests - len(latencies),
        "wall_s": round(wall, 3),
        "requests_per_s": round(len(latencies) / wall, 1) if wall else 0.0,
        "latency_p50_ms": _ms(_percentile(latencies, 50)),
        "latency_p99_ms": _ms(_percentile(latencies, 99)),
    }


async def _lag(port: int) -> tuple[list[float], int]:
    status, body, _ = await _get(port, "/lag", 30)
    if status != 200:
        raise RuntimeError(f"the server's /lag answered {status}")
    answer = json.loads(body)
    return [float(value) for value in answer["samples"]], int(answer["peak_in_flight"])


def _percentile(values: list[float], percent: float) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(percent) - 1]


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 2)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


SERVERS = {
    # uvicorn's pure-Python stack: the asyncio loop and h11 parsing the requests.
    "asyncio-h11": ["--loop", "asyncio", "--http", "h11"],
    # What `pip install uvicorn[standard]` serves with: uvloop and httptools (C).
    "uvloop-httptools": ["--loop", "uvloop", "--http", "httptools"],
}


def start_server(port: int, env: dict[str, str], server: str = "uvloop-httptools") -> subprocess.Popen[bytes]:
    root = Path(__file__).resolve().parents[2]
    return subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "project.asgi:application", "--host", "127.0.0.1",
         "--port", str(port), "--no-access-log", "--log-level", "warning",
         "--backlog", "4096", "--timeout-keep-alive", "1", *SERVERS[server]],
        cwd=root, env={**env, "DJANGO_SETTINGS_MODULE": "project.lab.asgi_settings"},
    )


async def _wait_ready(port: int, server: subprocess.Popen[bytes], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if server.poll() is not None:
            raise RuntimeError(f"uvicorn exited with {server.returncode}")
        try:
            await _lag(port)
            return
        except (OSError, RuntimeError, ValueError):
            if time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not answer within a minute") from None
            await asyncio.sleep(0.1)


async def _measure(
    port: int, modes: list[str], requests: int, rounds: int, ramp: float, hold: float
) -> dict[str, Any]:
    run_id = uuid.uuid4().hex[:8]
    results: dict[str, Any] = {}
    for mode in modes:
        # Warm up: connections, the pool's threads, Django's URL resolver.
        await _burst(port, mode, 20, f"{run_id}-warm", 60)
        await asyncio.sleep(1.0)  # let the warm-up's connections close
        rows: list[dict[str, Any]] = []
        lag: list[float] = []
        for number in range(rounds):
            await _lag(port)  # drop the samples taken before this round
            row = await _burst(port, mode, requests, f"{run_id}-{number}", 120, ramp, hold)
            samples, row["peak_in_flight"] = await _lag(port)
            lag.extend(samples)
            rows.append(row)
        ok = sum(row["ok"] for row in rows)
        results[mode] = {
            "rounds": rows,
            "ok": ok,
            "errors": sum(row["errors"] for row in rows),
            "requests_per_s": round(statistics.median(row["requests_per_s"] for row in rows), 1),
            "latency_p50_ms": statistics.median(
                row["latency_p50_ms"] for row in rows if row["latency_p50_ms"] is not None
            ) if ok else None,
            "latency_p99_ms": max(
                (row["latency_p99_ms"] for row in rows if row["latency_p99_ms"] is not None),
                default=None,
            ),
            "peak_in_flight": max(row["peak_in_flight"] for row in rows),
            "lag_samples": len(lag),
            "lag_p50_ms": _ms(_percentile(lag, 50)),
            "lag_p99_ms": _ms(_percentile(lag, 99)),
            "lag_max_ms": _ms(max(lag, default=None)),
        }
    return results


def run(
    *, requests: int = 500, rounds: int = 3, ramp: float = 1.0, hold: float = 1.0,
    modes: list[str] | None = None, env: dict[str, str] | None = None,
    server_kind: str = "uvloop-httptools",
) -> dict[str, Any]:
    """Start uvicorn (``server_kind``: a key of ``SERVERS``), measure each mode, stop
    it. Keys are new per run and per request."""
    modes = modes or ["baseline", "ahold", "sync_to_async"]
    port = _free_port()
    server = start_server(port, dict(env or os.environ), server_kind)
    try:
        async def main() -> dict[str, Any]:
            await _wait_ready(port, server)
            return await _measure(port, modes, requests, rounds, ramp, hold)

        results = asyncio.run(main())
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    return {
        "requests": requests, "rounds": rounds, "ramp_s": ramp, "hold_s": hold,
        "server": f"uvicorn, one worker, {server_kind}", **results,
    }


def in_process(*, requests: int = 500, ramp: float = 1.0, hold: float = 1.0) -> dict[str, Any]:
    """The same holders without HTTP: ``requests`` coroutines in this process's loop,
    each ``async with ahold(...)`` on a key of its own for ``hold`` seconds, with
    the loop's lag monitored. What the async API alone does to an event loop."""

    async def main() -> dict[str, Any]:
        lag = LagMonitor()
        lag.ensure_running()
        run_id = uuid.uuid4().hex[:8]
        peak = InFlight()

        async def one(index: int) -> float:
            await asyncio.sleep(ramp * index / requests)
            started = time.perf_counter()
            async with locks.ahold(f"{KEY_PREFIX}:{run_id}-{index}", holder="in-process", ttl=30):
                with peak:
                    await asyncio.sleep(hold)
            return time.perf_counter() - started - hold

        began = time.perf_counter()
        overheads = sorted(await asyncio.gather(*(one(i) for i in range(requests))))
        wall = time.perf_counter() - began
        assert lag.task is not None
        lag.task.cancel()
        samples = lag.take()
        return {
            "requests": requests, "wall_s": round(wall, 3), "peak_in_flight": peak.peak,
            "acquire_release_p50_ms": _ms(_percentile(overheads, 50)),
            "acquire_release_p99_ms": _ms(_percentile(overheads, 99)),
            "lag_samples": len(samples),
            "lag_p50_ms": _ms(_percentile(samples, 50)),
            "lag_p99_ms": _ms(_percentile(samples, 99)),
            "lag_max_ms": _ms(max(samples, default=None)),
        }

    try:
        return asyncio.run(main())
    finally:
        aio.close_threads()


def _cell(value: float | None) -> str:
    return f"{'-' if value is None else f'{value:.1f}':>9}"


def table(results: dict[str, Any]) -> str:
    lines = [
        f"{results['requests']} requests arriving over {results['ramp_s']} s, each holding "
        f"{results['hold_s']} s; {results['rounds']} rounds ({results['server']})",
        f"{'mode':<15}{'ok':>6}{'errors':>7}{'peak':>6}{'p50 ms':>9}{'p99 ms':>9}"
        f"{'lag p50':>9}{'lag p99':>9}{'lag max':>9}",
    ]
    for mode in ("baseline", "ahold", "sync_to_async"):
        row = results.get(mode)
        if row is None:
            continue
        lines.append(
            f"{mode:<15}{row['ok']:>6}{row['errors']:>7}{row['peak_in_flight']:>6}"
            + "".join(_cell(row[name]) for name in (
                "latency_p50_ms", "latency_p99_ms", "lag_p50_ms", "lag_p99_ms", "lag_max_ms"))
        )
    alone = results.get("in_process")
    if alone is not None:
        lines.append(
            f"{'in_process':<15}{alone['requests']:>6}{0:>7}{alone['peak_in_flight']:>6}"
            + "".join(_cell(alone[name]) for name in (
                "acquire_release_p50_ms", "acquire_release_p99_ms", "lag_p50_ms", "lag_p99_ms",
                "lag_max_ms"))
            + "   (no HTTP; p50/p99: acquire + release)"
        )
    return "\n".join(lines) + "\n"
