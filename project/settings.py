"""Settings for the runnable site, read from the environment.

- ``DATABASE_URL``: PostgreSQL in production (``postgres://user:pass@host/db``,
  or libpq's multi-host form for a failover cluster:
  ``postgres://user@h1:5432,h2:5432/db?target_session_attrs=read-write``,
  :mod:`project.database_url`). Default: a SQLite file under ``var/`` with IMMEDIATE transactions, so token
  issuance is serialised there too.
- ``CELERY_BROKER_URL``: default is Celery's filesystem transport under ``var/``.
- ``DJANGO_DEBUG``: off unless set to 1/true/yes/on (``bin/run`` sets it for
  the local demo). Production-safe by default: ``gunicorn project.wsgi`` with no
  environment shows no debug pages. Static files (the admin's, the dashboard's,
  the API docs') are served by WhiteNoise from ``STATIC_ROOT`` after
  ``manage.py collectstatic``, with DEBUG off too.
- ``DJANGO_SECRET_KEY``: required when DEBUG is off; with DEBUG on a fixed
  development key is used when it is missing.
- ``DJANGO_ALLOWED_HOSTS``: comma-separated, default ``127.0.0.1,localhost``.
- ``DJANGO_ADMIN_LOGIN_FAILURES`` (5) and ``DJANGO_ADMIN_LOGIN_WINDOW`` (900
  seconds): failed admin logins allowed per client address and per user name
  in that window before the login answers 429 (:mod:`project.login_throttle`).
- ``DJANGO_NUM_PROXIES``: how many trusted reverse proxies stand in front of
  the site (``REST_FRAMEWORK["NUM_PROXIES"]``). Unset, the throttles count
  ``REMOTE_ADDR`` and ignore ``X-Forwarded-For``, which any client can write.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

from django.core.exceptions import ImproperlyConfigured

from project import database_url

BASE_DIR = Path(__file__).resolve().parent.parent
VAR_DIR = Path(os.environ.get("COORDINATION_VAR_DIR", BASE_DIR / "var"))
VAR_DIR.mkdir(parents=True, exist_ok=True)

DEBUG = os.environ.get("DJANGO_DEBUG", "0").strip().lower() in {"1", "true", "yes", "on"}
SECRET_KEY = os.environ.get("DJANGO_SECRET_KEY", "")
if not SECRET_KEY:
    if not DEBUG:
        raise ImproperlyConfigured(
            "DJANGO_SECRET_KEY is not set. The site runs with DEBUG off unless DJANGO_DEBUG=1, "
            "and then it needs a secret key of its own: export DJANGO_SECRET_KEY=<a long random "
            "string> (python -c 'import secrets; print(secrets.token_urlsafe(50))'). For a local "
            "run with debug pages and a development key, use bin/run or DJANGO_DEBUG=1."
        )
    SECRET_KEY = "insecure-development-key-do-not-use-in-production"
ALLOWED_HOSTS = [
    host.strip()
    for host in os.environ.get("DJANGO_ALLOWED_HOSTS", "127.0.0.1,localhost").split(",")
    if host.strip()
]

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "rest_framework.authtoken",
    "drf_spectacular",
    "drf_spectacular_sidecar",
    "coordination",
    "project.demo",  # the demo domain: Account, the deposit task
    "project.lab",  # coordination_demo, coordination_chaos, coordination_bench
]
if importlib.util.find_spec("django_celery_beat") is not None:
    # Optional (requirements/beat.txt): the admin's periodic tasks, sent by
    # coordination.contrib.beat.FencedDatabaseScheduler (coordination_chaos --beat).
    INSTALLED_APPS.append("django_celery_beat")

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    # Static files with DEBUG off, from STATIC_ROOT, before anything that needs a session.
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "project.urls"
WSGI_APPLICATION = "project.wsgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]


def _database_from_environment() -> dict[str, Any]:
    url = os.environ.get("DATABASE_URL", "").strip()
    if url:
        config: dict[str, Any] = database_url.parse(url, conn_max_age=0)
    else:
        config = {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": str(VAR_DIR / "coordination.sqlite3"),
        }
    if config["ENGINE"] == "django.db.backends.sqlite3":
        # IMMEDIATE takes SQLite's write lock at BEGIN, so two grant-point
        # transactions can never both read the same counter: the SQLite twin of
        # PostgreSQL's row lock. WAL keeps readers (admin, API) unblocked.
        config.setdefault("OPTIONS", {}).update(
            {
                "transaction_mode": "IMMEDIATE",
                "timeout": 30,
                "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
            }
        )
        # Tests use a file too: Django's in-memory test database runs in shared
        # cache mode, whose table locks ignore the busy timeout.
        config.setdefault("TEST", {}).setdefault("NAME", str(VAR_DIR / "test.sqlite3"))
    if config["ENGINE"] == "django.db.backends.mysql":
        # Four-byte characters (emoji) in keys and payloads; the app's own tables
        # are made binary after every migrate (coordination.backends.mysql).
        config.setdefault("OPTIONS", {}).setdefault("charset", "utf8mb4")
        config.setdefault("TEST", {}).setdefault("CHARSET", "utf8mb4")
    return config


DATABASES = {"default": _database_from_environment()}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

# Failed admin logins per client address and per user name, in a window of
# seconds, before the login answers 429 (project/login_throttle.py). Counted
# in the default cache: give several server processes a shared one (Redis,
# Memcached, the database cache) so they count together.
ADMIN_LOGIN_FAILURES = int(os.environ.get("DJANGO_ADMIN_LOGIN_FAILURES", "5"))
ADMIN_LOGIN_WINDOW = int(os.environ.get("DJANGO_ADMIN_LOGIN_WINDOW", "900"))

STATIC_URL = "static/"
STATIC_ROOT = VAR_DIR / "static"
STATIC_ROOT.mkdir(exist_ok=True)  # WhiteNoise warns at start about a missing one
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    # collectstatic also writes gzip copies, which WhiteNoise serves to clients that
    # accept them. No manifest: a page never fails on a file not collected yet.
    "staticfiles": {"BACKEND": "whitenoise.storage.CompressedStaticFilesStorage"},
}
LOGIN_URL = "admin:login"

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s %(message)s"}},
    "filters": {"debug_off": {"()": "django.utils.log.RequireDebugFalse"}},
    "handlers": {
        "console": {"class": "logging.StreamHandler", "formatter": "plain"},
        # Django's own console handler prints django.request only with DEBUG on.
        "errors": {
            "class": "logging.StreamHandler", "formatter": "plain", "level": "ERROR",
            "filters": ["debug_off"],
        },
    },
    "loggers": {
        # Every 500 (Django's, and the API's JSON server_error) with its traceback.
        "django.request": {"handlers": ["errors"], "level": "ERROR"},
        "coordination": {
            "handlers": ["console"],
            "level": os.environ.get("COORDINATION_LOG_LEVEL", "INFO"),
        },
    },
}

# --- Celery ---------------------------------------------------------------
_BROKER_DIR = VAR_DIR / "broker"
CELERY_BROKER_URL = os.environ.get("CELERY_BROKER_URL", "filesystem://")
if CELERY_BROKER_URL.startswith("filesystem://"):
    for _sub in ("out", "processed", "control"):
        (_BROKER_DIR / _sub).mkdir(parents=True, exist_ok=True)
    CELERY_BROKER_TRANSPORT_OPTIONS: dict[str, Any] = {
        "data_folder_in": str(_BROKER_DIR / "out"),
        "data_folder_out": str(_BROKER_DIR / "out"),
        "processed_folder": str(_BROKER_DIR / "processed"),
        # Broadcast/control messages too, or kombu writes ./control in the CWD.
        "control_folder": str(_BROKER_DIR / "control"),
        "store_processed": False,
    }
CELERY_RESULT_BACKEND = os.environ.get("CELERY_RESULT_BACKEND") or None
CELERY_TASK_SERIALIZER = "json"
CELERY_ACCEPT_CONTENT = ["json"]
# Celery's Django fixup closes every database connection around every task
# (CONN_MAX_AGE is not consulted); with CELERY_DB_REUSE_MAX=N a worker keeps its
# connections for N tasks. Unset: a new connection (a new server process) per task.
if os.environ.get("CELERY_DB_REUSE_MAX"):
    CELERY_DB_REUSE_MAX = int(os.environ["CELERY_DB_REUSE_MAX"])

# --- REST framework ---------------------------------------------------------
# No SPECTACULAR_SETTINGS and no REST_FRAMEWORK but the proxies: the coordination
# API sets its own authentication, permissions, schema class, renderers and
# error shape per view, and serves its docs' assets from drf_spectacular_sidecar,
# as it must in any site that installs it. NUM_PROXIES is the site's to know: the
# client address of the API's throttles and of the admin login's count.
if os.environ.get("DJANGO_NUM_PROXIES"):
    REST_FRAMEWORK = {"NUM_PROXIES": int(os.environ["DJANGO_NUM_PROXIES"])}

# --- coordination -----------------------------------------------------------
COORDINATION: dict[str, Any] = {
    # Keep a row per accepted fenced write, so the admin timeline can mark them.
    "RECORD_WRITES": True,
}
