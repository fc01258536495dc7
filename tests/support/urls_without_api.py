"""A site's URLs that do not include the coordination API (for the system check tests)."""

from django.contrib import admin
from django.urls import path

urlpatterns = [path("admin/", admin.site.urls)]
