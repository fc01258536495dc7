"""In the task: the slot header a FencedScheduler puts on its messages, and one
effect per slot (``once_per_slot``, ``fenced_task(once_per_slot=True)``) when the
same slot's message is delivered twice. Tasks run in this process (``apply()``
with the header a beat would send)."""

from __future__ import annotations

import pytest
from celery import Celery

from coordination.contrib.beat import SLOT_HEADER, current_slot, once_per_slot
from coordination.contrib.celery import fenced_task
from coordination.models import IdempotencyRecord

pytestmark = pytest.mark.django_db(transaction=True)

app = Celery("slot-task-test", set_as_current=False)
runs: list[str | None] = []


@app.task(name="slot-task-test.plain")
def plain() -> int:
    runs.append(current_slot())
    return once_per_slot(lambda: len(runs))


@fenced_task(lock="report:{day}", ttl=5, once_per_slot=True, app=app, name="slot-task-test.fenced")
def fenced(day: str) -> int:
    runs.append(current_slot())
    return len(runs)


SLOT = "celery-beat/nightly@2030-01-01T03:00:00.000Z"


def test_the_slot_header_reaches_the_task_and_a_redelivery_returns_the_first_result() -> None:
    runs.clear()
    first = plain.apply(headers={SLOT_HEADER: SLOT}).get()
    again = plain.apply(headers={SLOT_HEADER: SLOT}).get()
    other = plain.apply(headers={SLOT_HEADER: SLOT + "x"}).get()
    assert runs == [SLOT, SLOT, SLOT + "x"]
    assert (first, again, other) == (1, 1, 3)
    assert IdempotencyRecord.objects.filter(key=f"beat-slot:{SLOT}").exists()


def test_without_a_slot_the_operation_just_runs() -> None:
    runs.clear()
    assert plain.apply().get() == 1
    assert plain.apply().get() == 2
    assert runs == [None, None]


def test_a_fenced_task_with_once_per_slot_runs_its_body_once_per_slot() -> None:
    runs.clear()
    first = fenced.apply(args=("mon",), headers={SLOT_HEADER: SLOT}).get()
    redelivered = fenced.apply(args=("mon",), headers={SLOT_HEADER: SLOT}).get()
    assert (first, redelivered) == (1, 1)
    assert runs == [SLOT]
    assert fenced.apply(args=("mon",)).get() == 2  # no slot: runs
