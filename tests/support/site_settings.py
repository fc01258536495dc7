"""The site's settings for the test suite: ``project.settings`` with a test-only secret key.

The site runs with DEBUG off unless ``DJANGO_DEBUG`` turns it on, and then
refuses to start without ``DJANGO_SECRET_KEY``. The suite runs the site as
production would (DEBUG off; pytest-django forces it off in the test process
anyway), so it gives the key here, before the site's settings are read. It
goes into this process's environment, so the ``manage.py``, Celery worker and
other subprocesses the tests start get it too. It signs nothing that outlives
a test run.
"""

import os

os.environ.setdefault("DJANGO_SECRET_KEY", "tests-only-secret-key-not-used-by-any-deployed-site")

from project.settings import *  # noqa: F403
from project.settings import DATABASES

# A leg that shares its database server with another leg running beside it
# (bin/test: the lts leg beside the pg leg) names a test database of its own.
if os.environ.get("COORDINATION_TEST_DATABASE_NAME") and DATABASES["default"]["ENGINE"] != (
    "django.db.backends.sqlite3"
):
    DATABASES["default"].setdefault("TEST", {})["NAME"] = os.environ["COORDINATION_TEST_DATABASE_NAME"]
