"""Waiting for a lock: LISTEN/NOTIFY wake-ups and fairness."""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from typing import Any

from django.db import connections

from coordination import locks
from coordination.exceptions import LockHeld

from .common import BenchConfig, _percentile_ms, bench_settings


def wakeup_suite(config: BenchConfig, alias: str, progress: Callable[[str], None]) -> dict[str, Any]:
    """Release to the waiter's grant: LISTEN/NOTIFY wake-ups against polling.

    A holder keeps the lock; a waiter in another thread blocks in
    ``acquire(wait=...)``; after a random pause the holder releases. The time
    from the release's return to the waiter's grant is one sample.
    """

    logging.getLogger("coordination").setLevel(logging.WARNING)
    modes = {"polling": False}
    if connections[alias].vendor == "postgresql":
        modes = {"notify": True, "polling": False}
    result: dict[str, Any] = {}
    rng = random.Random(5)
    for mode, wake_ups in modes.items():
        progress(f"wake-up latency: {mode}")
        samples: list[float] = []
        with bench_settings(alias, WAKE_UPS=wake_ups):
            for n in range(config.wakeup_samples):
                key = f"wake-{mode}-{n}"
                held = locks.acquire(key, holder="holder", ttl=30, using=alias)
                granted: list[float] = []

                def wait_for_it(key: str = key, granted: list[float] = granted) -> None:
                    try:
                        grant = locks.acquire(key, holder="waiter", ttl=30, wait=30, using=alias)
                        granted.append(time.perf_counter())
                        locks.release(grant, using=alias)
                    finally:
                        connections.close_all()

                waiter = threading.Thread(target=wait_for_it)
                waiter.start()
                time.sleep(rng.uniform(0.05, 0.3))
                locks.release(held, using=alias)
                released = time.perf_counter()
                waiter.join(60)
                samples.append(granted[0] - released)
        samples.sort()
        result[mode] = {
            "samples": len(samples),
            "p50_ms": _percentile_ms(samples, 0.5),
            "p99_ms": _percentile_ms(samples, 0.99),
            "max_ms": round(samples[-1] * 1000, 3),
        }
    return result


def fairness_suite(config: BenchConfig, alias: str, progress: Callable[[str], None]) -> dict[str, Any]:
    """Threads contending for one key, with and without fair queueing.

    Each thread loops acquire(wait) / short hold / release for a fixed time.
    Reports cycles/s, each thread's share (min and max grants) and the longest
    wait: fairness trades some throughput for no starvation.
    """

    logging.getLogger("coordination").setLevel(logging.WARNING)
    result: dict[str, Any] = {}
    guard = threading.Lock()
    for fair in (False, True):
        name = "fair" if fair else "unfair"
        progress(f"fairness: {name}, {config.fair_threads} threads")
        key = f"fairness-{name}"
        counts = [0] * config.fair_threads
        waits: list[float] = []
        stop_at = time.monotonic() + config.duration * 2

        def worker(index: int, fair: bool = fair, key: str = key, counts: list[int] = counts,
                   waits: list[float] = waits, stop_at: float = stop_at) -> None:
            try:
                while time.monotonic() < stop_at:
                    began = time.perf_counter()
                    try:
                        grant = locks.acquire(
                            key, holder=f"t{index}", ttl=30, wait=max(0.1, stop_at - time.monotonic()),
                            fair=fair, using=alias,
                        )
                    except LockHeld:
                        break
                    waited = time.perf_counter() - began
                    time.sleep(0.002)  # the work under the lock
                    locks.release(grant, using=alias)
                    with guard:
                        counts[index] += 1
                        waits.append(waited)
            finally:
                connections.close_all()

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(config.fair_threads)]
        began = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(config.duration * 2 + 120)
        elapsed = time.perf_counter() - began
        waits.sort()
        result[name] = {
            "threads": config.fair_threads,
            "cycles_per_s": round(sum(counts) / elapsed, 1),
            "grants_per_thread_min": min(counts),
            "grants_per_thread_max": max(counts),
            "wait_p50_ms": _percentile_ms(waits, 0.5),
            "wait_max_ms": round(waits[-1] * 1000, 3) if waits else None,
        }
    unfair = result["unfair"]["cycles_per_s"]
    result["fair_over_unfair_throughput"] = (
        round(result["fair"]["cycles_per_s"] / unfair, 3) if unfair else None
    )
    return result
