"""Fenced writes against plain ones."""

from __future__ import annotations

import contextlib
import logging
import statistics
import time
from collections.abc import Callable
from typing import Any

from django.db import transaction

from coordination import locks
from coordination.conf import app_settings

from .common import BenchConfig, _percentile_ms, bench_settings, fenced_model


def fenced_suite(config: BenchConfig, alias: str) -> dict[str, Any]:
    """fenced_update against a plain ORM update() of the same row, one client.

    Each in autocommit (one commit per write, as a caller outside a transaction
    pays) and inside one transaction (the statement alone, without the commit's
    disk flush). Short alternating blocks, so that background load falls on
    every variant alike.
    """
    model: Any = fenced_model()
    if model is None:
        return {"skipped": "no FencedModel to measure (project.demo is not installed)"}
    logging.getLogger("coordination").setLevel(logging.WARNING)
    rows = model._default_manager.using(alias)
    row = rows.create(owner="bench")
    grant = locks.acquire(f"account:{row.pk}", holder="bench", ttl=3600, using=alias)
    value = 0

    def fenced() -> None:
        rows.filter(pk=row.pk).fenced_update(grant, balance=value)

    def plain() -> None:
        rows.filter(pk=row.pk).update(balance=value)

    # The app's default keeps no row per accepted write; the recorded variant is
    # what RECORD_WRITES = True costs on top.
    variants: dict[str, tuple[Callable[[], None], bool]] = {
        "plain_update": (plain, False), "fenced_update": (fenced, False),
    }
    if "RECORD_WRITES" in app_settings._values():
        variants["fenced_update_recorded"] = (fenced, True)
    result: dict[str, Any] = {}
    block = 20
    for mode in ("autocommit", "in_transaction"):
        timings: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(max(1, config.fenced_rounds // block)):
            for name, (write, record) in variants.items():
                with bench_settings(alias, RECORD_WRITES=record), (
                    transaction.atomic(using=alias)
                    if mode == "in_transaction" else contextlib.nullcontext()
                ):
                    for _ in range(block):
                        value += 1
                        began = time.perf_counter()
                        write()
                        timings[name].append(time.perf_counter() - began)
        plain_p50 = _percentile_ms(sorted(timings["plain_update"]), 0.5) or 1.0
        result[mode] = {}
        for name, values in timings.items():
            values.sort()
            p50 = _percentile_ms(values, 0.5) or 0.0
            result[mode][name] = {
                "ops": len(values),
                "mean_ms": round(statistics.fmean(values) * 1000, 4),
                "p50_ms": p50,
                "p99_ms": _percentile_ms(values, 0.99),
                "over_plain": round(p50 / plain_p50, 3),
            }
    locks.release(grant, using=alias)
    result["fenced_over_plain"] = result["autocommit"]["fenced_update"]["over_plain"]
    result["fenced_over_plain_in_transaction"] = (
        result["in_transaction"]["fenced_update"]["over_plain"]
    )
    return result
