"""Site URLs: the admin and the app's API."""

from django.contrib import admin
from django.urls import include, path

urlpatterns = [
    path("admin/", admin.site.urls),
    path("api/", include("coordination.api.urls")),
]
