"""Site URLs: the dashboard as the front page, the admin, the app's API and its
Prometheus metrics."""

from django.contrib import admin
from django.urls import include, path, re_path
from django.views.generic import RedirectView

from coordination.api.views import no_endpoint
from coordination.metrics import metrics_view

from .login_throttle import admin_login

urlpatterns = [
    # The address bin/run prints: the dashboard (the admin asks for a login first).
    path("", RedirectView.as_view(pattern_name="admin:coordination_dashboard"), name="home"),
    # Before the admin's own URLs: its login, throttled after repeated failures.
    path("admin/login/", admin_login, name="admin-login"),
    path("admin/", admin.site.urls),
    path("api/", include("coordination.api.urls")),
    # The API's root without its slash: the API's JSON 404, not an HTML redirect.
    re_path(r"^api$", no_endpoint),
    path("metrics", metrics_view, name="metrics"),
]
