"""URLs of the REST API; the project mounts them with ``path("api/", include("coordination.api.urls"))``.

Paths have no trailing slash except the collections (``locks/``, ``fences/``,
``rejections/``), as the API contract lists them.
"""

from __future__ import annotations

from django.urls import path, re_path

from . import views
from .schema import DocsView, RedocView, SchemaView, docs_page

app_name = "coordination_api"

urlpatterns = [
    path("locks/", views.LockListView.as_view(), name="lock-list"),
    path("lock-sets/acquire", views.LockSetAcquireView.as_view(), name="lock-set-acquire"),
    path("semaphores/<str:name>/acquire", views.PermitAcquireView.as_view(), name="permit-acquire"),
    path("locks/<str:key>", views.LockDetailView.as_view(), name="lock-detail"),
    path("locks/<str:key>/acquire", views.AcquireView.as_view(), name="lock-acquire"),
    path("locks/<str:key>/renew", views.RenewView.as_view(), name="lock-renew"),
    path("locks/<str:key>/release", views.ReleaseView.as_view(), name="lock-release"),
    path("locks/<str:key>/grants", views.GrantListView.as_view(), name="lock-grants"),
    path("fences/", views.FenceListView.as_view(), name="fence-list"),
    path("fences/<str:resource>", views.FenceDetailView.as_view(), name="fence-detail"),
    path("documents/<str:name>", views.DocumentView.as_view(), name="document"),
    path("rejections/", views.RejectionListView.as_view(), name="rejection-list"),
    path("job-policies/", views.JobPolicyListView.as_view(), name="job-policy-list"),
    path("job-policies/<str:task>", views.JobPolicyDetailView.as_view(), name="job-policy-detail"),
    path("job-policies/<str:task>/pause", views.JobPolicyPauseView.as_view(), name="job-policy-pause"),
    path("job-policies/<str:task>/resume", views.JobPolicyResumeView.as_view(), name="job-policy-resume"),
    path("executions/stranded/", views.StrandedListView.as_view(), name="stranded-list"),
    path("executions/stranded/<int:id>/clear", views.StrandedClearView.as_view(), name="stranded-clear"),
    path("schema/", SchemaView.as_view(), name="schema"),
    # The interactive docs are for people in a browser: log in first. Their JavaScript
    # and CSS come from drf-spectacular-sidecar (the [api-docs] extra), served locally.
    path("docs/", docs_page(DocsView.as_view()), name="docs"),
    path("docs/redoc/", docs_page(RedocView.as_view()), name="redoc"),
    re_path(r"^(?P<rest>.*)$", views.no_endpoint, name="no-endpoint"),
]
