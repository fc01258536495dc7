"""Settings of the real ``celery worker`` processes that the worker tests start.

The site's settings, pointed at the pytest test database (its name comes from
the test process, which created it) and at the broker the test chose. Workers
acknowledge late and requeue a task whose process died, as production setups
that rely on redelivery do.
"""

import os

from project.settings import *  # noqa: F403
from project.settings import DATABASES

DATABASES["default"]["NAME"] = os.environ["COORDINATION_TEST_WORKER_DATABASE"]
if DATABASES["default"]["ENGINE"] == "django.db.backends.postgresql" and os.environ.get(
    "COORDINATION_TEST_WORKER_SESSION"
):
    # The test waits for these sessions to end once it has killed the worker.
    DATABASES["default"].setdefault("OPTIONS", {})["application_name"] = os.environ[
        "COORDINATION_TEST_WORKER_SESSION"
    ]

if os.environ.get("COORDINATION_TEST_WORKER_BROKER"):
    CELERY_BROKER_URL = os.environ["COORDINATION_TEST_WORKER_BROKER"]
    CELERY_BROKER_TRANSPORT_OPTIONS = {
        # Redelivery tests shorten the visibility timeout; the sweep that gives an
        # unacknowledged message to another worker then runs every second.
        "visibility_timeout": float(os.environ.get("COORDINATION_TEST_VISIBILITY_TIMEOUT", "3600")),
        "unacked_restore_interval": 1,
        "unacked_restore_throttle": 1,
        # A worker stopped or killed inside a restore sweep holds Redis's sweep mutex
        # until it expires: keep that short so other workers' sweeps resume soon.
        "unacked_mutex_expire": 3,
        # Keys of their own: other test runs on the same Redis never see our queues,
        # unacknowledged messages or sweep mutex.
        "global_keyprefix": os.environ.get("COORDINATION_TEST_REDIS_PREFIX", ""),
    }

CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_WORKER_HIJACK_ROOT_LOGGER = False
CELERY_IMPORTS = [
    "tests.support.celery_worker_tasks", "tests.support.job_policy_tasks", "tests.support.once_tasks",
    "tests.support.unique_tasks",
    "tests.support.rate_limit_tasks",
]
