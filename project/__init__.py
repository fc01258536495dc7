"""The runnable site: settings, URLs, the Celery app and the demo domain app."""

from .celery import app as celery_app

__all__ = ["celery_app"]
