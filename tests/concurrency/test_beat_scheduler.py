"""FencedScheduler in one process: two schedulers on one Celery app (in-memory
broker), each with its own leadership and keep-alive thread.

What is checked: only the leader sends; a slot is claimed once, ever; a
deposed leader that did not notice (its keep-alive stopped, as a paused
process's is) has its next claim refused by the role's fence and steps down; a
standby takes over after a revoke; messages carry their slot in a header.
"""

from __future__ import annotations

import datetime as dt
import itertools
import time
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from django.conf import settings
from django.test import override_settings

from coordination import election, locks
from coordination.contrib.beat import (
    SLOT_HEADER,
    FencedScheduler,
    claim_slot,
    latest_due,
    next_due,
)
from coordination.models import BeatSlot, Rejection

pytestmark = pytest.mark.django_db(transaction=True)

ROLE = "beat-test"
_apps = itertools.count()


@pytest.fixture
def app() -> Iterator[Celery]:
    app = Celery("beat-test", broker="memory://", set_as_current=False)
    name = f"beat-test.work-{next(_apps)}"  # Celery warns of one name on two callables
    app.conf.beat_schedule = {"every-200ms": {"task": name, "schedule": 0.2, "args": (1,)}}

    @app.task(name=name)
    def work(value: int) -> int:  # pragma: no cover  (never executed here)
        return value

    coordination = {**getattr(settings, "COORDINATION", {}), "BEAT_ROLE": ROLE, "BEAT_LEASE": 6.0}
    with override_settings(COORDINATION=coordination):
        yield app


def make(app: Celery) -> FencedScheduler:
    return FencedScheduler(app=app)


def run_for(scheduler: FencedScheduler, seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pause = scheduler.tick()
        time.sleep(min(max(pause, 0.01), 0.1))


def tick_until(scheduler: FencedScheduler, condition: Any, what: str, timeout: float = 30) -> None:
    """Tick ``scheduler`` as beat does until ``condition()`` holds: a state, not a
    clock window a loaded machine can miss."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s"
        pause = scheduler.tick()
        time.sleep(min(max(pause, 0.01), 0.1))


def claimed(count: int, term: int | None = None) -> Any:
    """A condition: at least ``count`` slots claimed (by ``term``, if given)."""
    slots = BeatSlot.objects.filter(role=ROLE)
    if term is not None:
        slots = slots.filter(term=term)
    return lambda: slots.count() >= count


def drain(app: Celery) -> list[dict[str, Any]]:
    """The headers of every message on the default queue."""
    found = []
    with app.connection_for_read() as connection:
        channel = connection.default_channel
        while (message := channel.basic_get("celery", no_ack=True)) is not None:
            found.append(message.headers)
    return found


def test_only_the_leader_sends_and_each_slot_names_itself_in_a_header(app: Celery) -> None:
    first, second = make(app), make(app)
    try:
        first.tick()
        assert first.leadership is not None
        assert second.tick() > 0 and second.leadership is None
        tick_until(first, claimed(4), "the leader claiming four slots")
        run_for(second, 0.5)  # a standby: sends nothing
        slots = list(BeatSlot.objects.filter(role=ROLE).order_by("due_at"))
        assert len(slots) >= 4
        assert {slot.term for slot in slots} == {first.leadership.term}
        assert all(slot.sent_at is not None and slot.task_id for slot in slots)
        # Due times on one grid, 200 ms apart (a stalled machine skips slots of
        # the grid, never leaves it).
        steps = [(b.due_at - a.due_at) / dt.timedelta(milliseconds=200) for a, b in itertools.pairwise(slots)]
        assert all(step >= 1 and step == round(step) for step in steps), steps
        headers = drain(app)
        assert [h[SLOT_HEADER] for h in headers] == [slot.identity for slot in slots]
        assert second.sent == 0
    finally:
        first.close()
        second.close()


def test_a_deposed_leader_that_did_not_notice_is_refused_and_the_standby_carries_on(
    app: Celery,
) -> None:
    first, second = make(app), make(app)
    try:
        first.tick()
        tick_until(first, claimed(1), "the leader claiming a slot")
        old = first.leadership
        assert old is not None and old._keeper is not None
        # Paused: its keep-alive stops, so it notices nothing; then its lease is
        # revoked (as it would expire) and the standby takes over.
        old._keeper.stop()
        locks.revoke(election.role_key(ROLE))
        tick_until(second, lambda: second.leadership is not None, "the standby taking over")
        assert second.leadership is not None and second.leadership.term > old.term
        # Two slots of the new term: a slot is due for the old leader's schedule
        # too, so its next tick tries to claim one.
        tick_until(second, claimed(2, term=second.leadership.term), "the new term claiming slots")
        assert not old.lost  # it still believes it leads
        claimed_before = BeatSlot.objects.filter(role=ROLE).count()
        first.tick()  # wakes up: its claim is refused by the fence; it steps down
        assert first.leadership is None
        assert BeatSlot.objects.filter(role=ROLE).count() == claimed_before
        assert Rejection.objects.filter(lock_key=election.role_key(ROLE), token=old.term).exists()
        tick_until(second, claimed(3, term=second.leadership.term), "the new term claiming on")
        run_for(first, 0.3)  # now a standby
        terms = list(BeatSlot.objects.filter(role=ROLE).order_by("due_at").values_list("term", flat=True))
        # The new term took over where the old one stopped, on the same grid.
        assert terms == sorted(terms) and terms[-1] == second.leadership.term
        dues = list(BeatSlot.objects.filter(role=ROLE).values_list("entry", "due_at"))
        assert len(dues) == len(set(dues))
    finally:
        first.close()
        second.close()


def test_a_slot_is_claimed_once_ever_even_by_a_later_term(app: Celery) -> None:
    due = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)
    with election.lead(ROLE, candidate="a", ttl=5) as one:
        assert claim_slot(one, entry="e", task="t", due_at=due) is not None
    with election.lead(ROLE, candidate="b", ttl=5) as two:
        assert claim_slot(two, entry="e", task="t", due_at=due) is None
        assert claim_slot(two, entry="e", task="t", due_at=due + dt.timedelta(seconds=1)) is not None
    assert BeatSlot.objects.filter(role=ROLE).count() == 2


def test_a_slot_claimed_and_never_sent_by_an_ended_term_is_lost(app: Celery) -> None:
    due = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)
    with election.lead(ROLE, candidate="a", ttl=5) as one:
        claim_slot(one, entry="e", task="t", due_at=due)
        # Its own live term: in flight, not lost.
        assert not BeatSlot.objects.lost().exists()
    assert BeatSlot.objects.lost().count() == 1


def test_the_grid_is_the_same_for_every_leader_and_missed_slots_collapse() -> None:
    from celery.schedules import crontab, schedule

    every = schedule(dt.timedelta(seconds=5))
    start = dt.datetime(2030, 1, 1, 12, 0, 0, tzinfo=dt.UTC)
    assert next_due(every, start) == start + dt.timedelta(seconds=5)
    later = start + dt.timedelta(seconds=23)
    assert latest_due(every, start + dt.timedelta(seconds=5), later) == start + dt.timedelta(seconds=20)
    hourly = crontab(minute=0)
    assert next_due(hourly, start) == start + dt.timedelta(hours=1)
    assert latest_due(hourly, start + dt.timedelta(hours=1), start + dt.timedelta(hours=3, minutes=5)) == (
        start + dt.timedelta(hours=3)
    )
