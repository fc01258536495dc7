"""WSGI entry point, behind the refusal of request charsets that are no text
encoding (``coordination.charsets``): Django would fail on them while it builds
the request, before any middleware."""

import os

from django.core.wsgi import get_wsgi_application

from coordination.charsets import guard_wsgi

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")
application = guard_wsgi(get_wsgi_application())
