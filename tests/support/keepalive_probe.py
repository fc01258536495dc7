"""Measure the keep-alive: when each renewal was due, when it ran, how long it took,
and how much of the lease was left when it landed (by the database's clock).

Run it against a migrated database (the site's settings read DATABASE_URL)::

    DATABASE_URL=postgres://... python -m tests.support.keepalive_probe \\
        --ttl 1 --runs 20 --seconds 3.5 --body cpu --load 2

``--body`` is what the task does while the keep-alive runs: ``sleep`` (I/O-bound,
releases the GIL), ``cpu`` (a pure-Python loop: the interpreter hands the GIL
over every ``sys.getswitchinterval()``), or ``cpu-c`` (one long C call that never
releases the GIL: ``sum(range(...))``; nothing in the process runs meanwhile).
``--load N`` starts N busy-loop processes for the duration (a loaded machine).

Prints one line per run and a summary; ``--json PATH`` writes every renewal.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import multiprocessing
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class Renewal:
    due: float  # seconds after the acquire it was due: a third of ttl after the previous start
    started: float  # seconds after the acquire the renew() call began
    took: float  # seconds the renew() call took
    left: float  # lease left by the database clock when it landed (old expiry - db now)
    ok: bool
    error: str = ""


@dataclass
class Run:
    body: str
    ttl: float
    renewals: list[Renewal] = field(default_factory=list)
    lost: bool = False
    first_started: float = -1.0


def _busy(stop_at: float) -> None:  # pragma: no cover - runs in a child process
    while time.monotonic() < stop_at:
        pass


def _body(kind: str, seconds: float) -> None:
    end = time.monotonic() + seconds
    if kind == "sleep":
        time.sleep(seconds)
    elif kind == "cpu":
        x = 0
        while time.monotonic() < end:
            for i in range(10_000):
                x += i * i
    elif kind == "cpu-c":
        # Calibrated chunks of a C loop that holds the GIL throughout.
        while time.monotonic() < end:
            sum(range(20_000_000))
    else:
        raise SystemExit(f"unknown body {kind!r}")


def probe(ttl: float, seconds: float, body: str, key: str) -> Run:
    from coordination import locks, renewal
    from coordination.contrib import execution

    run = Run(body=body, ttl=ttl)
    real_renew = renewal.renew
    grant = locks.acquire(key, holder="probe", ttl=ttl)
    t0 = time.monotonic()
    expires = [grant.expires_at]

    def timed_renew(g: Any, **kwargs: Any) -> Any:
        started = time.monotonic()
        due = (run.renewals[-1].started if run.renewals else 0.0) + ttl / 3
        old_expiry = expires[-1]
        try:
            result = real_renew(g, **kwargs)
        except Exception as error:
            run.renewals.append(Renewal(due, started - t0, time.monotonic() - started, float("nan"), False,
                                        type(error).__name__))
            raise
        db_now = result.expires_at - dt.timedelta(seconds=kwargs.get("ttl") or ttl)
        run.renewals.append(Renewal(due, started - t0, time.monotonic() - started,
                                    (old_expiry - db_now).total_seconds(), True))
        expires.append(result.expires_at)
        return result

    renewal.renew = timed_renew  # the keep-alive renews through coordination.renewal
    try:
        keeper = execution.KeepAlive(grant, ttl=ttl).start()
        try:
            _body(body, seconds)
        finally:
            keeper.stop()
    finally:
        renewal.renew = real_renew
    run.lost = bool(grant.lost)
    if run.renewals:
        run.first_started = run.renewals[0].started
    try:
        locks.release(grant)
    except Exception:
        run.lost = True
    return run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ttl", type=float, default=1.0)
    parser.add_argument("--seconds", type=float, default=3.5)
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--body", default="sleep", choices=["sleep", "cpu", "cpu-c"])
    parser.add_argument("--load", type=int, default=0, help="busy-loop processes to start")
    parser.add_argument("--json", default="")
    options = parser.parse_args(argv)

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")
    import django

    django.setup()

    total = options.runs * (options.seconds + options.ttl) + 30
    loaders = [
        multiprocessing.Process(target=_busy, args=(time.monotonic() + total,), daemon=True)
        for _ in range(options.load)
    ]
    for loader in loaders:
        loader.start()
    runs: list[Run] = []
    try:
        for number in range(options.runs):
            run = probe(options.ttl, options.seconds, options.body, f"probe:{os.getpid()}:{number}")
            runs.append(run)
            oks = [r for r in run.renewals if r.ok]
            print(
                f"run {number:3d} body={run.body} ttl={run.ttl} lost={run.lost} renewals={len(oks)}"
                f" first_at={run.first_started:.3f}s"
                f" max_late={max((r.started - r.due for r in run.renewals if r.due >= 0), default=0):.3f}s"
                f" max_took={max((r.took for r in run.renewals), default=0):.3f}s"
                f" min_left={min((r.left for r in oks), default=float('nan')):.3f}s",
                flush=True,
            )
    finally:
        for loader in loaders:
            loader.terminate()
    every = [r for run in runs for r in run.renewals]
    oks = [r for r in every if r.ok]
    print(
        f"summary: runs={len(runs)} lost={sum(run.lost for run in runs)} renewals={len(oks)}"
        f" failed={len(every) - len(oks)}"
        f" first_took={max((run.renewals[0].took for run in runs if run.renewals), default=0):.3f}s"
        f" max_took={max((r.took for r in every), default=0):.3f}s"
        f" p50_took={sorted(r.took for r in every)[len(every) // 2] if every else 0:.3f}s"
        f" max_late={max((r.started - r.due for r in every if r.due >= 0), default=0):.3f}s"
        f" min_left={min((r.left for r in oks), default=float('nan')):.3f}s"
    )
    if options.json:
        with open(options.json, "w") as out:
            json.dump([{**asdict(run)} for run in runs], out, indent=1)
    return 1 if any(run.lost for run in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
