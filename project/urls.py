"""Site URLs: the admin, the app's API and its Prometheus metrics."""

from django.contrib import admin
from django.urls import include, path

from coordination.metrics import metrics_view

urlpatterns = [
    path("admin/", admin.site.urls),
    path("api/", include("coordination.api.urls")),
    path("metrics", metrics_view, name="metrics"),
]
