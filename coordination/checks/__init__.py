"""System checks, ids ``coordination.E0xx`` (errors) and ``coordination.W0xx`` (warnings).

One module per subsystem: ``settings`` (the COORDINATION dict), ``database``
(the grant point's database), ``fenced_models``, ``api`` (the REST API's apps),
``celery`` and ``deployment`` (``check --deploy``). Importing this package
registers them all (``apps.py``).

Checks that read only settings and code are registered without the ``database``
tag, so plain ``manage.py check``, ``runserver``, ``migrate`` and a fenced Celery
worker's start run them (Django runs database-tagged checks only when asked to
with ``check --database``). Only W004, W005 and W006 read the database.
"""

from .api import API_APPS, API_URLCONF, api_is_mounted, check_api_apps
from .celery import (
    check_celery_broker_client,
    check_celery_fenced_tasks,
    check_celery_visibility_timeout,
)
from .database import (
    TOKEN_WARNING_THRESHOLD,
    check_database,
    check_promotion_guard,
    check_time_zone_support,
    check_token_headroom,
    check_watermark_triggers,
)
from .deployment import check_api_throttle_cache
from .fenced_models import check_fenced_models
from .settings import check_access_rules, check_settings
from .stores import check_fenced_storages

__all__ = [
    "API_APPS", "API_URLCONF", "TOKEN_WARNING_THRESHOLD", "api_is_mounted", "check_access_rules",
    "check_api_apps", "check_api_throttle_cache", "check_celery_broker_client", "check_celery_fenced_tasks",
    "check_celery_visibility_timeout", "check_database", "check_fenced_models",
    "check_fenced_storages", "check_promotion_guard", "check_settings", "check_time_zone_support",
    "check_token_headroom", "check_watermark_triggers",
]
