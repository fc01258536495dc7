"""Fenced Celery tasks: in process, on a worker, and apply_async."""

from __future__ import annotations

import contextlib
import logging
import os
import random
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from django.db import connections

from .common import BenchConfig, _percentile_ms, fenced_model
from .systems import redis_available


def celery_suite(config: BenchConfig, alias: str, progress: Callable[[str], None]) -> dict[str, Any]:
    """A fenced Celery task against the same task unfenced: through a real broker
    and worker (``end_to_end``), and in process by ``apply()`` (``in_process``)."""
    try:
        import celery  # noqa: F401

        from coordination.contrib import celery as contrib_celery  # noqa: F401
    except ImportError:
        return {"skipped": "Celery or coordination.contrib.celery is not available"}
    if fenced_model() is None:
        return {"skipped": "no FencedModel to write (project.demo is not installed)"}
    why_not = redis_available(config.redis_url)
    if why_not:
        end_to_end: dict[str, Any] = {"skipped": why_not}
        persistent: dict[str, Any] = {"skipped": why_not}
        working: dict[str, Any] = {"skipped": why_not}
    else:
        end_to_end = celery_worker_suite(config, alias, progress)
        persistent = celery_worker_suite(config, alias, progress, reuse_connections=True)
        working = celery_worker_suite(
            config, alias, progress, reuse_connections=True, work_ms=config.celery_work_ms
        )
    return {
        "end_to_end": end_to_end,
        "end_to_end_persistent": persistent,
        "end_to_end_persistent_working": working,
        "in_process": celery_apply_suite(config, alias, progress),
    }


def celery_worker_suite(
    config: BenchConfig,
    alias: str,
    progress: Callable[[str], None],
    *,
    reuse_connections: bool = False,
    work_ms: float = 0,
) -> dict[str, Any]:
    """Fenced and unfenced tasks through Redis and one real ``celery worker`` (solo pool).

    ``work_ms``: the body's own work before its one-row write (a sleep).

    The tasks are ``project.lab.bench_tasks``; the worker writes the bench tables
    (their settings travel in an environment variable). Rounds of
    ``celery_rounds // 20`` tasks of each variant one at a time, shuffled task
    by task (latency, send to completion after the task returned), then a burst
    of twice as many of each variant in turn (throughput, first send to last
    completion). The worker is killed on every exit.

    Connections: by default the worker runs as Celery's Django fixup makes it,
    closing every connection around every task, so each task opens a new one
    (a new PostgreSQL server process, whose first call of the grant point's
    functions also loads and plans them: the fenced task pays that too). With
    ``reuse_connections`` the worker keeps its connection (``CELERY_DB_REUSE_MAX``),
    as a worker behind a pool or with connection reuse does: what fencing
    itself adds to a task.
    """
    import json
    import subprocess
    import sys
    import tempfile
    import uuid

    import redis
    from celery import Celery
    from django.conf import settings

    from .. import bench_tasks

    url = str(config.redis_url)
    run = uuid.uuid4().hex[:10]
    queue = f"coordination-bench-{run}"
    report = f"coordination-bench-report-{run}"
    client = redis.Redis.from_url(url)
    model: Any = fenced_model()
    row = model._default_manager.using(alias).create(owner="celery-worker-bench")
    env = {
        **os.environ,
        "CELERY_BROKER_URL": url,
        bench_tasks.DATABASE_ENV: json.dumps(connections.databases[alias], default=str),
        bench_tasks.REPORT_ENV: url,
    }
    env.pop("CELERY_RESULT_BACKEND", None)
    env.pop("CELERY_DB_REUSE_MAX", None)
    if reuse_connections:
        env["CELERY_DB_REUSE_MAX"] = "1000000"
    producer = Celery("coordination-bench", broker=url, set_as_current=False)
    producer.conf.task_serializer = "json"
    # Closed (and so deleted) in the finally below, after the worker is gone.
    log = tempfile.NamedTemporaryFile(  # noqa: SIM115
        prefix="coordination-bench-worker-", suffix=".log"
    )
    progress(
        "celery tasks through Redis and a worker, fenced and unfenced, "
        + ("connections kept" if reuse_connections else "a new connection per task")
        + (f", a {work_ms:g} ms body" if work_ms else ", a one-row body")
    )
    def stop(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)  # runs the finally below, which stops the worker

    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, stop) if main else None
    worker = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "project", "worker", "--pool=solo",
         "--concurrency=1", "-Q", queue, "-I", "project.lab.bench_tasks",
         "-n", f"bench-{run}@%h", "--without-gossip", "--without-mingle",
         "--without-heartbeat", "--loglevel=WARNING"],
        cwd=str(settings.BASE_DIR), env=env, stdout=log, stderr=subprocess.STDOUT,
    )
    names = {
        "fenced": bench_tasks.FENCED, "unfenced": bench_tasks.UNFENCED,
        "fenced_once": bench_tasks.FENCED_ONCE,
    }
    amount = 0

    def send(name: str) -> None:
        nonlocal amount
        amount += 1
        producer.send_task(
            names[name], args=(row.pk, amount), queue=queue,
            kwargs={"sent_at": time.time(), "report": report, "work_ms": work_ms},
        )

    def collect(count: int, timeout: float) -> list[tuple[float, float]]:
        done: list[tuple[float, float]] = []
        deadline = time.monotonic() + timeout
        while len(done) < count:
            left = deadline - time.monotonic()
            # One second at a time: redis-py's default socket timeout (5 s) would
            # cut a longer BLPOP short while a worker on a busy machine starts.
            popped = client.blpop([report], timeout=1) if left > 0 else None
            if popped is None:
                if worker.poll() is not None:
                    raise RuntimeError(f"bench worker exited ({worker.returncode}): {_tail(log.name)}")
                if time.monotonic() >= deadline:
                    raise RuntimeError(f"bench tasks did not complete: {_tail(log.name)}")
                continue
            _name, sent_at, done_at, state = json.loads(popped[1])
            if state != "SUCCESS":
                raise RuntimeError(f"bench task {_name} ended {state}: {_tail(log.name)}")
            done.append((sent_at, done_at))
        return done

    latency: dict[str, list[float]] = {name: [] for name in names}
    burst_tasks: dict[str, int] = dict.fromkeys(names, 0)
    burst_seconds: dict[str, float] = dict.fromkeys(names, 0.0)
    block = max(2, config.celery_rounds // 20)
    try:
        for name in names:  # warm-up, and waits for the worker to consume
            send(name)
            collect(1, 120)
        for _ in range(max(1, config.celery_rounds // 40)):
            # One at a time, shuffled task by task: a load that comes and goes
            # falls on every variant alike.
            order = [name for name in names for _ in range(block)]
            random.shuffle(order)
            for name in order:
                send(name)
                sent_at, done_at = collect(1, 60)[0]
                latency[name].append(done_at - sent_at)
            for name in random.sample(list(names), len(names)):
                began = time.time()
                for _ in range(2 * block):
                    send(name)
                finished = collect(2 * block, 120)
                burst_tasks[name] += 2 * block
                burst_seconds[name] += max(done_at for _, done_at in finished) - began
        # The worker wrote the bench tables, not the site's: the last write is here.
        row.refresh_from_db(using=alias)
        if int(row.balance) != amount:
            raise RuntimeError(f"bench worker wrote elsewhere: balance {row.balance}, sent {amount}")
    finally:
        if main:
            signal.signal(signal.SIGTERM, previous)
        worker.terminate()
        try:
            worker.wait(15)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait()
        log.close()
        with contextlib.suppress(Exception):
            client.delete(
                report, queue, f"_kombu.binding.{queue}", f"_kombu.binding_permanent.{queue}"
            )
        with contextlib.suppress(Exception):
            producer.close()
    result: dict[str, Any] = {
        "how": "Redis broker, one celery worker (solo pool); the same lock key and row for all; "
        + ("connection kept across tasks" if reuse_connections else "a new connection per task")
        + (f"; the body works {work_ms:g} ms before its write" if work_ms else "; a one-row body"),
        "work_ms": work_ms,
    }
    for name, values in latency.items():
        values.sort()
        result[name] = {
            "tasks": len(values),
            "p50_ms": _percentile_ms(values, 0.5),
            "p99_ms": _percentile_ms(values, 0.99),
            "burst_tasks": burst_tasks[name],
            "tasks_per_s": round(burst_tasks[name] / burst_seconds[name], 1)
            if burst_seconds[name] > 0 else None,
        }
    result["fenced_over_unfenced"] = round(
        (result["fenced"]["p50_ms"] or 0) / (result["unfenced"]["p50_ms"] or 1), 3
    )
    unfenced_rate = result["unfenced"]["tasks_per_s"]
    result["fenced_over_unfenced_throughput"] = (
        round((result["fenced"]["tasks_per_s"] or 0) / unfenced_rate, 3) if unfenced_rate else None
    )
    result["once_over_fenced"] = round(
        (result["fenced_once"]["p50_ms"] or 0) / (result["fenced"]["p50_ms"] or 1), 3
    )
    return result


def _tail(path: str) -> str:
    with contextlib.suppress(OSError), open(path, errors="replace") as log:
        return log.read()[-2000:]
    return ""


def celery_apply_suite(
    config: BenchConfig, alias: str, progress: Callable[[str], None]
) -> dict[str, Any]:
    """A fenced Celery task against the same task unfenced, run by ``apply()``.

    In-process (Celery's task machinery, no broker, no worker): what the fencing
    adds to each execution (acquire, keep-alive, fenced write, release) next to
    the same body writing with a plain update, shuffled task by task, and the
    p50 of each part of both (``fenced_steps_us``, ``unfenced_steps_us``).
    ``fenced_once`` is the fenced task with ``once=True`` (each call a new task
    id: the body runs in one transaction with its record), ``once_repeat`` the
    same task applied again with a task id that completed (the stored result,
    no body, no grant).
    """
    try:
        from celery import shared_task

        from coordination.contrib.celery import fenced_task
    except ImportError:
        return {"skipped": "Celery or coordination.contrib.celery is not available"}
    model: Any = fenced_model()
    if model is None:
        return {"skipped": "no FencedModel to write (project.demo is not installed)"}
    logging.getLogger("coordination").setLevel(logging.WARNING)
    logging.getLogger("coordination.tasks").setLevel(logging.WARNING)
    rows = model._default_manager.using(alias)
    row = rows.create(owner="celery-bench")

    @fenced_task(lock="account:{account_id}", ttl=30, name="coordination.bench.fenced_settle")
    def fenced_settle(account_id: int, amount: int) -> None:
        rows.filter(pk=account_id).fenced_update(balance=amount)

    @fenced_task(lock="account:{account_id}", ttl=30, once=True, name="coordination.bench.once_settle")
    def once_settle(account_id: int, amount: int) -> None:
        rows.filter(pk=account_id).fenced_update(balance=amount)

    @shared_task(name="coordination.bench.plain_settle")
    def plain_settle(account_id: int, amount: int) -> None:
        with _timed("body"):
            rows.filter(pk=account_id).update(balance=amount)

    tasks = {"fenced": fenced_settle, "unfenced": plain_settle, "fenced_once": once_settle}
    timings: dict[str, list[float]] = {name: [] for name in [*tasks, "once_repeat"]}
    steps: dict[str, dict[str, list[float]]] = {"fenced": {}, "unfenced": {}}
    progress("celery tasks in process (apply()), fenced, fenced with once and unfenced")
    done = once_settle.apply(args=(row.pk, 0)).id
    amount = 0
    with _timed_steps() as taken:
        for _ in range(max(1, config.celery_rounds // 20)):
            # Shuffled task by task: a load that comes and goes falls on all alike.
            order = [name for name in timings for _ in range(20)]
            random.shuffle(order)
            for name in order:
                taken.clear()
                began = time.perf_counter()
                if name == "once_repeat":
                    once_settle.apply(args=(row.pk, 0), task_id=done)
                    timings[name].append(time.perf_counter() - began)
                    continue
                amount += 1
                outcome = tasks[name].apply(args=(row.pk, amount))
                took = time.perf_counter() - began
                timings[name].append(took)
                if outcome.failed():
                    raise RuntimeError(f"bench task {name} failed: {outcome.result!r}")
                if name in steps:
                    taken["rest"] = took - sum(taken.values())
                    for step, seconds in taken.items():
                        steps[name].setdefault(step, []).append(seconds)
    result: dict[str, Any] = {"how": "task.apply() in process: no broker, no worker"}
    # Where each task's time goes, p50 of each part in µs: the fenced execution's
    # steps (acquire, body, release, keep-alive, policy and limits) and the rest
    # (Celery's apply() and the execution's own Python); the unfenced task's body
    # and the rest.
    for name, parts in steps.items():
        result[f"{name}_steps_us"] = {
            step: round(1e6 * sorted(values)[len(values) // 2]) for step, values in parts.items()
        }
    for name, values in timings.items():
        values.sort()
        result[name] = {
            "tasks": len(values),
            "p50_ms": _percentile_ms(values, 0.5),
            "p99_ms": _percentile_ms(values, 0.99),
        }
    result["fenced_over_unfenced"] = round(
        (result["fenced"]["p50_ms"] or 0) / (result["unfenced"]["p50_ms"] or 1), 3
    )
    result["once_over_fenced"] = round(
        (result["fenced_once"]["p50_ms"] or 0) / (result["fenced"]["p50_ms"] or 1), 3
    )
    return result


_taken: dict[str, float] | None = None


@contextlib.contextmanager
def _timed(step: str) -> Iterator[None]:
    began = time.perf_counter()
    try:
        yield
    finally:
        if _taken is not None:
            _taken[step] = _taken.get(step, 0.0) + time.perf_counter() - began


@contextlib.contextmanager
def _timed_steps() -> Iterator[dict[str, float]]:
    """Time each step of every fenced execution run meanwhile on this thread (the
    thread driver's step, ``FencedExecution._do``), summed per kind of step into
    the dict yielded: ``acquire``, ``body``, ``release``, ``keep-alive`` (its start
    and stop), ``record`` (where the record is written after the grant: not on
    PostgreSQL), ``policy and limits`` (the policy read, the cap and rate checks)."""
    global _taken
    from coordination.contrib import execution, execution_steps

    kinds = {
        execution_steps.Acquire: "acquire", execution_steps.Body: "body",
        execution_steps.Release: "release", execution_steps.StartKeepAlive: "keep-alive",
        execution_steps.StopKeepAlive: "keep-alive", execution_steps.Call: "policy and limits",
    }
    taken: dict[str, float] = {}
    do = execution.FencedExecution._do

    def timed_do(self: Any, step: Any) -> Any:
        kind = kinds.get(type(step), "other")
        if isinstance(step, execution_steps.Call) and step.func.__name__ == "_record":
            kind = "record"
        with _timed(kind):
            return do(self, step)

    execution.FencedExecution._do = timed_do  # type: ignore[method-assign]
    _taken = taken
    try:
        yield taken
    finally:
        execution.FencedExecution._do = do  # type: ignore[method-assign]
        _taken = None
