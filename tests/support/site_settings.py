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
