"""Settings of the ``celery worker`` processes a jobs chaos run starts.

The controller's own settings (``COORDINATION_JOBS_BASE_SETTINGS``), pointed at
the controller's database and at the run's broker and queue. Workers
acknowledge late and requeue a task whose process died, and Redis hands an
unacknowledged message to another worker after ``COORDINATION_JOBS_VISIBILITY``
seconds: the redeliveries the run provokes.
"""

import importlib
import json
import os

_base = importlib.import_module(os.environ.get("COORDINATION_JOBS_BASE_SETTINGS", "project.settings"))
globals().update({name: value for name, value in vars(_base).items() if name.isupper()})

DATABASES = {"default": json.loads(os.environ["COORDINATION_JOBS_DATABASE"])}
CELERY_BROKER_URL = os.environ["COORDINATION_JOBS_BROKER"]
CELERY_BROKER_TRANSPORT_OPTIONS = {
    "global_keyprefix": os.environ.get("COORDINATION_JOBS_PREFIX", ""),
    "visibility_timeout": float(os.environ.get("COORDINATION_JOBS_VISIBILITY", "6")),
    "unacked_restore_interval": 1,
    "unacked_restore_throttle": 1,
    "unacked_mutex_expire": 3,
}
CELERY_RESULT_BACKEND = None
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_WORKER_HIJACK_ROOT_LOGGER = False
CELERY_IMPORTS = ["project.lab.chaos.jobs_tasks"]
