"""The task a beat chaos run schedules: it records each execution and its slot.

One JSON line per execution in the file named by ``COORDINATION_BEAT_EXECUTIONS``
(appends of one short line are atomic), with the ``coordination_slot`` header
the FencedScheduler put on the message (None under Celery's stock scheduler)
and the worker's clock, which the negative control buckets by interval.
"""

from __future__ import annotations

import json
import os
import time

from celery import shared_task

from coordination.contrib.beat import current_slot


@shared_task(name="coordination_chaos.beat_tick")
def beat_tick() -> str | None:
    slot = current_slot()
    line = json.dumps({"slot": slot, "pid": os.getpid(), "at": time.time()}) + "\n"
    fd = os.open(os.environ["COORDINATION_BEAT_EXECUTIONS"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)
    return slot
