"""FencedDatabaseScheduler in one process: django-celery-beat's ``PeriodicTask``
rows, edited through the ORM as the admin edits them (``save()`` and its
signals), two schedulers on one Celery app (in-memory broker).

What is checked: the leader follows an edit of the interval and of ``enabled``
at its next passes, and so does the standby that takes over from a deposed
leader; a one-off task is sent once, even across a take-over; the slots stay
on one grid of claimed slots, each claimed once.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from django.conf import settings
from django.test import override_settings
from django_celery_beat.models import IntervalSchedule, PeriodicTask

from coordination import election, locks
from coordination.contrib.beat import SLOT_HEADER, FencedScheduler
from coordination.models import BeatSlot

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.legs("pg", "lts", reason="django-celery-beat on both Django versions; SQLite adds nothing"),
]

ROLE = "beat-db-test"
TASK = "beat-db-test.work"


@pytest.fixture
def app() -> Iterator[Celery]:
    app = Celery("beat-db-test", broker="memory://", set_as_current=False)
    app.conf.beat_schedule = {}
    app.conf.result_expires = None  # no celery.backend_cleanup row
    # TASK is not registered: the scheduler sends it by name, as a beat whose
    # app does not import the task's module does.
    coordination = {**getattr(settings, "COORDINATION", {}), "BEAT_ROLE": ROLE, "BEAT_LEASE": 6.0}
    drain(app)  # the in-memory broker is one per process: earlier tests' messages
    with override_settings(COORDINATION=coordination):
        yield app


def make(app: Celery) -> FencedScheduler:
    from coordination.contrib.beat import FencedDatabaseScheduler

    scheduler: FencedScheduler = FencedDatabaseScheduler(app=app)
    return scheduler


def every(seconds: int) -> IntervalSchedule:
    interval, _ = IntervalSchedule.objects.get_or_create(every=seconds, period=IntervalSchedule.SECONDS)
    return interval


def edit(task: PeriodicTask, **changes: Any) -> None:
    """As the admin's change form does: load the row, change it, save it (its
    signal tells every beat that the schedule changed)."""
    task.refresh_from_db()
    for field, value in changes.items():
        setattr(task, field, value)
    task.save()


def run_for(scheduler: FencedScheduler, seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pause = scheduler.tick()
        time.sleep(min(max(pause, 0.01), 0.1))


def slots(name: str) -> list[BeatSlot]:
    return list(BeatSlot.objects.filter(role=ROLE, entry=name).order_by("due_at"))


def gaps(found: list[BeatSlot]) -> set[float]:
    return {(b.due_at - a.due_at).total_seconds() for a, b in itertools.pairwise(found)}


def drain(app: Celery) -> list[dict[str, Any]]:
    found = []
    with app.connection_for_read() as connection:
        channel = connection.default_channel
        while (message := channel.basic_get("celery", no_ack=True)) is not None:
            found.append(message.headers)
    return found


def depose(leader: FencedScheduler) -> int:
    """As a pause past the lease does: the keep-alive stops, the lease ends."""
    leadership = leader.leadership
    assert leadership is not None and leadership._keeper is not None
    leadership._keeper.stop()
    locks.revoke(election.role_key(ROLE))
    return leadership.term


def test_interval_and_enabled_edited_in_the_admin_are_followed_by_whichever_beat_leads(
    app: Celery,
) -> None:
    task = PeriodicTask.objects.create(name="report", task=TASK, interval=every(1))
    first, second = make(app), make(app)
    try:
        first.tick()
        assert first.leadership is not None
        assert second.tick() > 0 and second.leadership is None
        run_for(first, 2.5)
        before = slots("report")
        assert len(before) >= 2 and gaps(before) == {1.0}, gaps(before)

        edit(task, interval=every(2))
        run_for(first, 4.5)
        after = [slot for slot in slots("report") if slot.due_at > before[-1].due_at]
        assert len(after) >= 2, after
        # On the grid of the claimed slots: the next slot is 2 s after the last one.
        assert gaps([before[-1], *after]) == {2.0}, gaps([before[-1], *after])
        headers = drain(app)
        assert [h[SLOT_HEADER] for h in headers] == [slot.identity for slot in slots("report")]
        assert {h["periodic_task_name"] for h in headers} == {"report"}
        task.refresh_from_db()
        assert task.total_run_count == len(headers) and task.last_run_at == after[-1].due_at

        # The leader is deposed; the standby leads and follows the next edits.
        old_term = depose(first)
        edit(task, interval=every(3))
        run_for(second, 6.5)
        assert second.leadership is not None and second.leadership.term > old_term
        taken_over = [slot for slot in slots("report") if slot.term == second.leadership.term]
        assert len(taken_over) >= 2 and gaps(taken_over) == {3.0}, gaps(taken_over)

        edit(task, enabled=False)
        run_for(second, 0.5)  # the edit reaches the leader at its next pass
        claimed = len(slots("report"))
        run_for(second, 3.5)
        assert len(slots("report")) == claimed, "a disabled task was sent"

        edit(task, enabled=True)
        run_for(second, 2.0)
        assert len(slots("report")) > claimed, "a re-enabled task was not sent"
        dues = [slot.due_at for slot in slots("report")]
        assert len(dues) == len(set(dues))
    finally:
        first.close()
        second.close()


def test_a_one_off_task_is_sent_once_even_across_a_take_over(app: Celery) -> None:
    PeriodicTask.objects.create(name="once", task=TASK, interval=every(1), one_off=True)
    first, second = make(app), make(app)
    try:
        first.tick()
        run_for(first, 2.5)
        assert len(slots("once")) == 1
        assert PeriodicTask.objects.get(name="once").enabled is False
        # As if the leader had died between the send and disabling the row: the
        # claimed slot alone keeps the standby that takes over from sending it again.
        PeriodicTask.objects.filter(name="once").update(enabled=True)
        depose(first)
        run_for(second, 2.5)
        assert second.leadership is not None
        assert len(slots("once")) == 1
        assert [h["periodic_task_name"] for h in drain(app)] == ["once"]
    finally:
        first.close()
        second.close()
