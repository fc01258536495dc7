"""The site's settings for ``coordination_asgi_bench``'s uvicorn server: the
bench's async views as the URLs, no middleware, and persistent connections for
the async API's threads (``COORDINATION_BENCH_CONN_MAX_AGE`` seconds, default
60). ``COORDINATION_BENCH_ASYNC_THREADS`` sets ``COORDINATION["ASYNC_THREADS"]``."""

import os

from project.settings import *  # noqa: F403
from project.settings import COORDINATION, DATABASES

ROOT_URLCONF = "project.lab.asgi_bench"
DEBUG = False
ALLOWED_HOSTS = ["127.0.0.1", "localhost"]
DATABASES["default"]["CONN_MAX_AGE"] = int(os.environ.get("COORDINATION_BENCH_CONN_MAX_AGE", "60"))
# Django's sync middleware would hop to a thread per middleware per request: the
# bench measures the grant point's calls on the loop, not that hop.
MIDDLEWARE = []
if os.environ.get("COORDINATION_BENCH_ASYNC_THREADS"):
    COORDINATION = {**COORDINATION, "ASYNC_THREADS": int(os.environ["COORDINATION_BENCH_ASYNC_THREADS"])}
