"""The site's ASGI entry point (``uvicorn project.asgi:application``), behind the
refusal of request charsets that are no text encoding (``coordination.charsets``)."""

import os

from django.core.asgi import get_asgi_application

from coordination.charsets import guard_asgi

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")

application = guard_asgi(get_asgi_application())
