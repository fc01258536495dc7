"""A site's URLs that include the coordination API one level down (for the system check tests)."""

from django.urls import include, path

urlpatterns = [path("services/", include([path("v1/", include("coordination.api.urls"))]))]
