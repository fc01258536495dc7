"""The fenced beat scheduler's mechanism: the leader's election, slots claimed once
under its term, due times on one grid. Users name it through
:mod:`coordination.contrib.beat`, whose docstring says how it works."""

from __future__ import annotations

import datetime as dt
import logging
import math
import os
import random
import socket
from collections.abc import Callable
from typing import Any, TypeVar

from celery import current_task
from celery.beat import (  # type: ignore[attr-defined]  # the two private helpers, as Scheduler uses them
    ScheduleEntry,
    Scheduler,
    _evaluate_entry_args,
    _evaluate_entry_kwargs,
)
from celery.schedules import schedule as interval_schedule
from django.db import IntegrityError, close_old_connections, transaction
from django.db.models import Max

from .. import election, fencing
from ..conf import app_settings
from ..exceptions import LeaseLost, LockHeld, StaleToken
from ..models import HOLDER_MAX_LENGTH, BeatSlot, DatabaseNow, slot_identity

logger = logging.getLogger("coordination.beat")

SLOT_HEADER = "coordination_slot"
"""Message header naming the slot a beat message was sent for (``role/entry@due``)."""

_T = TypeVar("_T")


def claim_slot(
    leadership: election.Leadership, *, entry: str, task: str, due_at: dt.datetime
) -> BeatSlot | None:
    """Claim the slot (``entry``, ``due_at``) for ``leadership``'s term; None if it was
    claimed before (by anyone, ever).

    The insert runs inside ``leadership.fence()``: the role's watermark is
    checked and raised in the same transaction, so a claim with a term below it
    raises ``StaleToken`` (a newer leader has claimed) and one by a leadership
    known lost raises ``LeaseLost``, without claiming.
    """
    alias = leadership.using or app_settings.DATABASE
    with leadership.fence():
        try:
            with transaction.atomic(using=alias):
                return BeatSlot.objects.using(alias).create(
                    role=leadership.role, entry=entry, task=task, due_at=due_at,
                    term=leadership.term, claimed_by=leadership.holder,
                )
        except IntegrityError:
            return None


def mark_sent(slot: BeatSlot, task_id: str, *, using: str | None = None) -> None:
    """Record that the broker accepted ``slot``'s message (``task_id``)."""
    alias = using or app_settings.DATABASE
    BeatSlot.objects.using(alias).filter(pk=slot.pk, sent_at__isnull=True).update(
        sent_at=DatabaseNow(), task_id=task_id
    )


def next_due(schedule: Any, after: dt.datetime, now: dt.datetime | None = None) -> dt.datetime:
    """The due time of ``schedule``'s first occurrence after ``after`` (UTC).

    Deterministic for interval schedules (``after + run_every``) and crontabs
    (the next matching minute), so every leader computes the same slots. Other
    schedules (solar, custom) are asked for their remaining time from ``now``,
    rounded to the second.
    """
    if isinstance(schedule, interval_schedule) and not schedule.relative:
        return _utc(after + _run_every(schedule))
    if hasattr(schedule, "remaining_delta"):
        start, delta, _now = schedule.remaining_delta(after)
        return _utc(start + delta)
    current = now or dt.datetime.now(dt.UTC)
    seconds = schedule.remaining_estimate(after).total_seconds()
    return _utc(current + dt.timedelta(seconds=max(0, round(seconds))))


def latest_due(schedule: Any, due: dt.datetime, now: dt.datetime) -> dt.datetime:
    """The last occurrence at or before ``now``, starting from the due ``due``:
    occurrences missed while no beat led collapse into the latest one."""
    if isinstance(schedule, interval_schedule) and not schedule.relative:
        every = _run_every(schedule).total_seconds()
        if every > 0 and now > due:
            skipped = math.floor((now - due).total_seconds() / every)
            return due + dt.timedelta(seconds=skipped * every)
        return due
    for _ in range(10_000):
        following = next_due(schedule, due, now)
        if following > now or following <= due:
            break
        due = following
    return due


def current_slot() -> str | None:
    """The slot the running task's message was sent for by a FencedScheduler, if any."""
    task = current_task
    if task is None:
        return None
    request = task.request
    value = request.get(SLOT_HEADER) or (request.headers or {}).get(SLOT_HEADER)
    return str(value) if value else None


def once_per_slot(operation: Callable[[], _T], *, using: str | None = None) -> _T:
    """Run ``operation`` once per beat slot; a redelivery of the same slot's message
    returns the result stored the first time (:func:`coordination.fencing.idempotent`).

    Outside a beat-sent task (no ``coordination_slot`` header) it just runs.
    The operation's database writes commit with the stored result, so either
    both happen or neither does; effects outside the database need their own
    idempotency (rule 10 of docs/rules.md).
    """
    slot = current_slot()
    if slot is None:
        return operation()
    return fencing.idempotent(f"beat-slot:{slot}"[:255], operation, using=using)


class FencedScheduler(Scheduler):
    """Celery beat scheduler: leader-elected, slots claimed once and fenced by term.

    Reads the schedule from ``beat_schedule`` (as Celery's default scheduler
    does) and keeps its state in the database, not in a shelve file. Settings
    (``COORDINATION``): ``BEAT_ROLE``, ``BEAT_LEASE``, ``BEAT_LOCK_DELAY``.

    A subclass that reads its schedule elsewhere (``FencedDatabaseScheduler``)
    keeps all of this; it may change the schedule between passes (an entry whose
    schedule changed is placed again after its last claimed slot) and refine
    ``_may_fire`` and ``_sent``.
    """

    #: Seconds between a standby's campaigns at most, whatever the leader's lease says.
    standby_poll = 1.0

    def __init__(self, app: Any, *args: Any, **kwargs: Any) -> None:
        self.role = str(app_settings.BEAT_ROLE)
        self.lease = float(app_settings.BEAT_LEASE)
        delay = app_settings.BEAT_LOCK_DELAY
        self.lock_delay = float(app_settings.LOCK_DELAY if delay is None else delay)
        self.candidate = f"beat {socket.gethostname()}:{os.getpid()}"[:HOLDER_MAX_LENGTH]
        self.leadership: election.Leadership | None = None
        self._due: dict[str, dt.datetime] = {}
        #: The schedule each entry's due time was computed with.
        self._planned: dict[str, Any] = {}
        #: Slots this process claimed and sent, claimed and could not send, and
        #: found already claimed: for logs and tests.
        self.sent = self.unsent = self.already_claimed = 0
        super().__init__(app, *args, **kwargs)

    # --- the loop -----------------------------------------------------------------

    def tick(self, *args: Any, **kwargs: Any) -> float:
        """One pass: campaign if not leading, else send what is due. Returns the
        seconds to sleep before the next pass."""
        close_old_connections()
        try:
            if self.leadership is None or self.leadership.lost:
                return self._campaign()
            return self._send_due()
        except (StaleToken, LeaseLost) as deposed:
            self._step_down(deposed)
            return 0.0
        except Exception:
            logger.exception("%s: pass failed; trying again", self.candidate)
            self._reset_connection()
            return min(self.lease / 3, self._longest_sleep())

    def _campaign(self) -> float:
        if self.leadership is not None:
            self._step_down(None)
        try:
            leadership = election.campaign(
                self.role, candidate=self.candidate, ttl=self.lease, lock_delay=self.lock_delay,
            )
        except LockHeld as held:
            # Try again when the leader's lease (or its lock-delay) ends; a short
            # jitter keeps standbys from campaigning in step.
            pause = min(held.retry_after, self.standby_poll, self._longest_sleep())
            return max(pause, 0.02) + random.uniform(0, 0.05)
        self.leadership = leadership
        self._resume_grid()
        logger.warning("%s leads %r, term %d", self.candidate, self.role, leadership.term)
        return 0.0

    def _resume_grid(self) -> None:
        """Start every entry from the last slot claimed in the database: the
        grid every leader shares. An entry never claimed starts from now."""
        self._due, self._planned = {}, {}
        self._plan(self.schedule)

    def _plan(self, entries: dict[str, Any]) -> None:
        """Place ``entries`` on the grid: each one's next due time after the last
        slot claimed for it, by any term (from now if it was never claimed)."""
        if not entries:
            return
        alias = app_settings.DATABASE
        last = dict(
            BeatSlot.objects.using(alias).filter(role=self.role, entry__in=list(entries))
            .values_list("entry").annotate(last=Max("due_at"))
        )
        now = dt.datetime.now(dt.UTC)
        for name, entry in entries.items():
            self._due[name] = next_due(entry.schedule, last.get(name) or now, now)
            self._planned[name] = entry.schedule

    def _send_due(self) -> float:
        leadership = self.leadership
        assert leadership is not None
        schedule = dict(self.schedule)
        # An entry that is new, or whose schedule changed since it was placed (a
        # schedule read from the database is edited at run time), is placed again
        # from the claimed slots, so the next slot follows the new schedule.
        self._plan({name: entry for name, entry in schedule.items()
                    if name not in self._due or self._planned.get(name) != entry.schedule})
        for gone in self._due.keys() - schedule.keys():
            del self._due[gone], self._planned[gone]
        now = dt.datetime.now(dt.UTC)
        pause = min(self._longest_sleep(), self.lease / 3)
        for name, entry in schedule.items():
            due = self._due[name]
            if due <= now:
                due = latest_due(entry.schedule, due, now)
                if self._may_fire(entry, due, now):
                    self._fire(leadership, entry, due)
                self._due[name] = next_due(entry.schedule, due, now)
            pause = min(pause, (self._due[name] - now).total_seconds())
        return max(pause, 0.0)

    def _may_fire(self, entry: ScheduleEntry, due: dt.datetime, now: dt.datetime) -> bool:
        """Whether ``entry``'s slot at ``due`` is to be claimed at all; a slot
        refused here is skipped, not postponed. Every slot of a ``beat_schedule``
        entry is."""
        return True

    def _sent(self, entry: ScheduleEntry, slot: BeatSlot) -> None:
        """Called after the broker accepted ``slot``'s message and it was marked sent."""

    def _fire(self, leadership: election.Leadership, entry: ScheduleEntry, due: dt.datetime) -> None:
        name, task = str(entry.name), str(entry.task)
        slot = claim_slot(leadership, entry=name, task=task, due_at=due)
        if slot is None:
            self.already_claimed += 1
            logger.info("beat: slot %s was claimed before; not sending",
                        slot_identity(self.role, name, due))
            return
        entry.last_run_at = due
        entry.total_run_count += 1
        try:
            result = self._send(entry, slot)
        except Exception:
            self.unsent += 1
            # Never sent again: the message may have left before the error.
            logger.exception("beat: slot %s claimed, not sent: it is lost", slot.identity)
            return
        self.sent += 1
        task_id = str(getattr(result, "id", "") or "")
        mark_sent(slot, task_id)
        logger.info("beat: sent slot %s term %d task %s", slot.identity, leadership.term, task_id)
        self._sent(entry, slot)

    def _send(self, entry: ScheduleEntry, slot: BeatSlot) -> Any:
        options = dict(entry.options or {})
        headers = dict(options.pop("headers", None) or {})
        headers.update(celery_beat_task=True, **{SLOT_HEADER: slot.identity})
        args = _evaluate_entry_args(entry.args)
        kwargs = _evaluate_entry_kwargs(entry.kwargs)
        name = str(entry.task)
        task = self.app.tasks.get(name)
        if task is not None:
            return task.apply_async(args, kwargs, producer=self.producer, headers=headers, **options)
        return self.send_task(name, args, kwargs, producer=self.producer, headers=headers,
                              **options)

    def _longest_sleep(self) -> float:
        return float(self.max_interval or 300)

    # --- leadership ---------------------------------------------------------------

    def _step_down(self, error: BaseException | None) -> None:
        leadership, self.leadership = self.leadership, None
        if leadership is None:
            return
        logger.warning("%s no longer leads %r (term %d): %s", self.candidate, self.role,
                       leadership.term, error or "lease lost")
        leadership.resign()

    def _reset_connection(self) -> None:
        from django.db import connections

        try:
            connections[app_settings.DATABASE].close()
        except Exception:  # a broken connection may fail to close
            logger.debug("closing a broken connection failed", exc_info=True)

    def close(self) -> None:
        """Resign on shutdown, so a standby leads at once instead of after the lease."""
        try:
            if self.leadership is not None:
                self.leadership.resign()
                self.leadership = None
        finally:
            super().close()

    @property
    def info(self) -> str:
        leadership = self.leadership
        state = "standby" if leadership is None or leadership.lost else f"leader, term {leadership.term}"
        return f"    . role -> {self.role} ({state}, lease {self.lease:g} s)"


def _utc(moment: dt.datetime) -> dt.datetime:
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=dt.UTC)
    return moment.astimezone(dt.UTC)


def _run_every(schedule: Any) -> dt.timedelta:
    every: dt.timedelta = schedule.run_every  # not in celery-types' stub of schedule
    return every
