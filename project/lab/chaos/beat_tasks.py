"""The task a beat chaos run schedules: it records each execution and its slot.

One JSON line per execution in the file named by ``COORDINATION_BEAT_EXECUTIONS``
(appends of one short line are atomic), with the ``coordination_slot`` header
the FencedScheduler put on the message (None under Celery's stock scheduler)
and the worker's clock, which the negative control buckets by interval.

In the beat processes, ``COORDINATION_BEAT_PUBLISH_DELAY`` seconds are spent
between a slot's claim and its publication, so that the chaos run's kills of
the leader sometimes land in that window and leave lost slots to account for
(in production the window is a few milliseconds).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from celery import shared_task
from celery.signals import before_task_publish

from coordination.contrib.beat import SLOT_HEADER, current_slot


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


@before_task_publish.connect(dispatch_uid="coordination_chaos.widen_claim_to_send")
def widen_claim_to_send_window(sender: Any = None, headers: Any = None, **kwargs: Any) -> None:
    delay = float(os.environ.get("COORDINATION_BEAT_PUBLISH_DELAY") or 0)
    if delay > 0 and isinstance(headers, dict) and headers.get(SLOT_HEADER):
        time.sleep(delay)
