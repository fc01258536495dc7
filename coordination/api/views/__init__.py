"""REST views, one module per resource: ``locks``, ``lock_sets`` (lock sets and
semaphore permits), ``fences``, ``documents``, ``rejections``, ``job_policies``, ``executions``,
and ``fallback`` for any other path; ``base`` is what they share.

The views are thin shells over :mod:`coordination.locks`,
:mod:`coordination.documents` and the models; see :mod:`.base` for the
policies every view sets. A new endpoint goes in its resource's module (its
URL in :mod:`coordination.api.urls`); the schema lists the views of this
package.
"""

from __future__ import annotations

from .base import APIJSONRenderer, CoordinationListView, CoordinationView, Pagination, operation
from .documents import FENCE_REFUSALS, IDEMPOTENCY_HEADER, IDEMPOTENCY_KEY_MAX_LENGTH, DocumentView
from .executions import StrandedClearView, StrandedListView
from .fallback import no_endpoint
from .fences import FenceDetailView, FenceListView
from .job_policies import (
    JobPolicyDetailView,
    JobPolicyListView,
    JobPolicyPauseView,
    JobPolicyResumeView,
)
from .lock_sets import LockSetAcquireView, PermitAcquireView
from .locks import AcquireView, GrantListView, LockDetailView, LockListView, ReleaseView, RenewView
from .rejections import RejectionListView

__all__ = [
    "FENCE_REFUSALS",
    "IDEMPOTENCY_HEADER",
    "IDEMPOTENCY_KEY_MAX_LENGTH",
    "APIJSONRenderer",
    "AcquireView",
    "CoordinationListView",
    "CoordinationView",
    "DocumentView",
    "FenceDetailView",
    "FenceListView",
    "GrantListView",
    "JobPolicyDetailView",
    "JobPolicyListView",
    "JobPolicyPauseView",
    "JobPolicyResumeView",
    "LockDetailView",
    "LockListView",
    "LockSetAcquireView",
    "Pagination",
    "PermitAcquireView",
    "RejectionListView",
    "ReleaseView",
    "RenewView",
    "StrandedClearView",
    "StrandedListView",
    "no_endpoint",
    "operation",
]
