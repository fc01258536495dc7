"""A Celery beat scheduler for any number of beat processes that never sends a slot twice.

::

    celery -A proj beat -S coordination.contrib.beat.FencedScheduler

or ``beat_scheduler = "coordination.contrib.beat.FencedScheduler"`` in the
Celery configuration. Run it on as many machines as you like:

- **Only the leader sends.** Every beat campaigns for the role
  ``COORDINATION["BEAT_ROLE"]`` (:mod:`coordination.election`); the winner's
  lease (``BEAT_LEASE`` seconds) is kept alive by a thread, and its token is
  its **term**. Standbys try again when the leader's lease ends, so they take
  over within the lease plus ``BEAT_LOCK_DELAY`` after the leader dies or
  pauses.
- **A slot is claimed once, ever, before it is sent.** A slot is one schedule
  entry at one due time, a :class:`~coordination.models.BeatSlot` row whose
  ``(role, entry, due_at)`` is unique. The leader inserts it in a transaction
  fenced by its term (the role's Fence): a claim by a term below the role's
  watermark is refused (``StaleToken``) and that beat steps down. A paused
  leader that resumes, a standby that takes over, a restarted beat: none of
  them can claim, hence send, a slot that was claimed before.
- **Due times are on one grid.** A new leader resumes from the last slot
  claimed in the database, not from its own clock, so every leader computes
  the same due times (interval and crontab schedules; see docs/beat.md for
  other kinds). Occurrences missed while no beat led collapse into one, as
  with Celery's own scheduler.
- **The message names its slot** in the ``coordination_slot`` header
  (:func:`current_slot` in the task), so a task body can make its effect
  idempotent per slot: :func:`once_per_slot`.

The schedule is ``beat_schedule``. For django-celery-beat's periodic tasks,
edited in its admin, run :class:`FencedDatabaseScheduler`
(``-S coordination.contrib.beat.FencedDatabaseScheduler``, the ``beat``
extra): the same mechanism on the ``PeriodicTask`` rows.

At most once, not exactly once: a leader that dies after claiming a slot and
before the broker accepted the message leaves the slot *lost*: claimed, never
marked sent (``BeatSlot.objects.lost()``, the admin's "lost" filter). It is
never sent by anyone else, because nobody can tell whether the message left.
"""

from __future__ import annotations

from django.apps import apps

from .beat_scheduler import (
    SLOT_HEADER,
    FencedScheduler,
    claim_slot,
    current_slot,
    latest_due,  # not public; its tests import it from here
    mark_sent,
    next_due,
    once_per_slot,
)

# The scheduler over django-celery-beat's rows is named here too, where its app is
# installed (the beat extra): importing it imports django_celery_beat's models,
# which needs the app in INSTALLED_APPS and Django set up, as celery beat does
# before it looks the scheduler up.
if apps.ready and apps.is_installed("django_celery_beat"):
    from .beat_database import FencedDatabaseScheduler as FencedDatabaseScheduler

__all__ = [
    "SLOT_HEADER",
    "FencedScheduler",
    "claim_slot",
    "current_slot",
    "latest_due",
    "mark_sent",
    "next_due",
    "once_per_slot",
]
