"""django-celery-beat's admin-edited schedule, sent by one fenced leader among any number of beats.

::

    celery -A proj beat -S coordination.contrib.beat.FencedDatabaseScheduler

Needs ``django-celery-beat`` installed (the ``beat`` extra; on Django 6.1 see
docs/beat.md for the install) and ``django_celery_beat`` in
``INSTALLED_APPS``. The schedule is django-celery-beat's: the enabled
``PeriodicTask`` rows, edited in its admin, re-read when a row changes (and
every 5 minutes), plus ``beat_schedule`` written into those rows at start, as
its ``DatabaseScheduler`` does. Everything else is :class:`FencedScheduler`'s:

- one leader by fenced election (``BEAT_ROLE``, ``BEAT_LEASE``), the others
  stand by and take over after a paused or killed leader's lease;
- each slot (a periodic task at one due time) claimed once, ever, fenced by
  the leader's term, before it is sent; due times from the grid of claimed
  slots, not from ``PeriodicTask.last_run_at``, so every leader computes the
  same ones, and a deposed leader's writes cannot move them;
- an edit takes effect at the leader's next pass (at most
  ``beat_max_loop_interval``, 5 s by default here): a changed schedule is placed
  again on the grid from the task's last claimed slot, a disabled or deleted
  task is sent no more. A new leader reads every row afresh.

``last_run_at`` and ``total_run_count`` are still written, after each send, for
the admin to show; nothing reads them back to decide a due time. The row's
``start_time``, ``expires`` and ``one_off`` are honoured: a slot before the
start or after the expiry is skipped; a one-off task is claimed once after its
row was last saved (the claimed slots decide, so a take-over cannot send it
again) and is then disabled, as django-celery-beat does.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from django.db.models import F
from django_celery_beat.models import PeriodicTask, PeriodicTasks
from django_celery_beat.schedulers import DatabaseScheduler

from ..conf import app_settings
from ..models import BeatSlot
from .beat_scheduler import FencedScheduler

__all__ = ["FencedDatabaseScheduler"]


class FencedDatabaseScheduler(FencedScheduler, DatabaseScheduler):  # type: ignore[misc]  # untyped base
    """Celery beat scheduler for django-celery-beat's ``PeriodicTask`` rows:
    leader-elected, each slot claimed once and fenced by term.

    The election, the claim and the grid are :class:`FencedScheduler`'s;
    ``DatabaseScheduler`` (next in the method resolution order) supplies the
    schedule: its ``schedule`` property re-reads the rows when
    ``PeriodicTasks`` says they changed. Its own ``tick`` is never used, so
    its due times and ``last_run_at`` bookkeeping play no part.
    """

    def _resume_grid(self) -> None:
        # A standby's rows may be as old as its start: read them all again before
        # placing them (the flag is DatabaseScheduler's own "first read").
        self._initial_read = True
        super()._resume_grid()

    def _may_fire(self, entry: Any, due: dt.datetime, now: dt.datetime) -> bool:
        row: PeriodicTask = entry.model
        if not row.enabled:
            return False
        if row.start_time is not None and due < row.start_time:
            return False
        if row.expires is not None and now >= row.expires:
            return False
        if row.one_off:
            # Once after the row was last saved (saving it again in the admin runs
            # it again): asked of the claimed slots, which every leader shares.
            alias = app_settings.DATABASE
            claimed = BeatSlot.objects.using(alias).filter(
                role=self.role, entry=entry.name, claimed_at__gte=row.date_changed,
            )
            return not claimed.exists()
        return True

    def _sent(self, entry: Any, slot: BeatSlot) -> None:
        row: PeriodicTask = entry.model
        changes: dict[str, Any] = {
            "last_run_at": slot.due_at, "total_run_count": F("total_run_count") + 1,
        }
        if row.one_off:
            changes["enabled"] = False
            row.enabled = False
        # update(), not save(): no signal, so the beats do not re-read every row
        # after each send; date_changed stays the operator's last edit.
        PeriodicTask.objects.filter(pk=row.pk).update(**changes)
        if row.one_off:
            PeriodicTasks.update_changed()  # every beat drops the disabled task

    @property
    def info(self) -> str:
        return f"{super().info}\n    . schedule -> django-celery-beat PeriodicTask rows"
