"""Settings of the processes a beat chaos run starts (``celery beat`` and ``celery worker``).

The controller's own settings (``COORDINATION_BEAT_BASE_SETTINGS``), pointed at
the controller's database and at the run's broker, queue, role and schedule:
one entry, ``chaos-tick``, every ``COORDINATION_BEAT_INTERVAL`` seconds.
"""

import importlib
import json
import os

_base = importlib.import_module(os.environ.get("COORDINATION_BEAT_BASE_SETTINGS", "project.settings"))
globals().update({name: value for name, value in vars(_base).items() if name.isupper()})

DATABASES = {"default": json.loads(os.environ["COORDINATION_BEAT_DATABASE"])}
CELERY_BROKER_URL = os.environ["COORDINATION_BEAT_BROKER"]
CELERY_BROKER_TRANSPORT_OPTIONS = {"global_keyprefix": os.environ.get("COORDINATION_BEAT_PREFIX", "")}
CELERY_RESULT_BACKEND = None
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_WORKER_HIJACK_ROOT_LOGGER = False
CELERY_BEAT_SCHEDULE = {
    "chaos-tick": {
        "task": "coordination_chaos.beat_tick",
        "schedule": float(os.environ.get("COORDINATION_BEAT_INTERVAL", "1")),
        "options": {"queue": os.environ["COORDINATION_BEAT_QUEUE"]},
    }
}
if os.environ.get("COORDINATION_BEAT_SCHEDULE_FROM") == "database":
    # The schedule is the run's PeriodicTask row; no beat_schedule entry and no
    # celery.backend_cleanup row (written by the database schedulers at start).
    CELERY_BEAT_SCHEDULE = {}
    CELERY_RESULT_EXPIRES = None
CELERY_IMPORTS = ["project.lab.chaos.beat_tasks"]
COORDINATION = {
    **globals().get("COORDINATION", {}),
    "BEAT_ROLE": os.environ["COORDINATION_BEAT_ROLE"],
    "BEAT_LEASE": float(os.environ.get("COORDINATION_BEAT_LEASE", "5")),
    "BEAT_LOCK_DELAY": float(os.environ.get("COORDINATION_BEAT_LOCK_DELAY", "0")),
}
