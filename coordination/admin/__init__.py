"""The operator's view: locks, grants, fences and refused writes, and a dashboard.

Everything here is read-only history except the operator actions, each with a
permission of its own, a confirmation page and an admin log entry:

- revoke a lock (``coordination.revoke_lock``): :func:`coordination.locks.revoke`;
- raise a fence to its lock's last token (``coordination.raise_fence``):
  :func:`coordination.fencing.raise_fence_to_lock`, for after a restore;
- re-bind a document to another lock key (``coordination.rebind_document``):
  :func:`coordination.documents.rebind_document`;
- retry an outbox call or mark it reconciled (``coordination.relay_outboxcall``):
  :func:`coordination.stores.outbox.retry_call`, :func:`~coordination.stores.outbox.mark_reconciled`.

Access rules (:mod:`coordination.access`, edited here as AccessRule rows) limit
what a user sees and does to the keys their rules allow: every list of per-key
rows leaves out the others, the dashboard too, and revoking or raising needs
the ``revoke`` action on the key.

Leader election has two read-only lists: the roles (their leader, term and
history of terms) and the beat slots of ``FencedScheduler`` (claimed, sent, lost).

Job policies (:mod:`coordination.jobs`) are edited here, every change recorded;
pausing and resuming a task needs ``coordination.pause_jobpolicy``, and the
jobs page shows each fenced task's running executions with its buttons.

The package by concern: ``base`` (what every admin shares), ``actions`` (the
operator actions' one runner: confirmation, access rules, log, message),
``fenced`` (the admin for users' models), ``pages`` (dashboard and jobs page),
then one module per area: ``locks`` (locks and grants), ``fences``, ``writes``,
``documents``, ``rules``, ``election``, ``jobs``, ``outbox``, ``tokens``. A new admin page
goes in the module of its area, a new operator action is an ``OperatorAction``.

Lock and fence rows are never deleted (rule 8 of docs/rules.md): their counters and
watermarks are what keeps old tokens refused. States and times are decided with
the database clock.
"""

from __future__ import annotations

from django.apps import apps as django_apps
from django.contrib import admin

# Importing the area modules registers their admins on admin.site (autodiscovery
# imports this package only), in the order admin.py registered them before it
# became a package, so the site's URLs and checks come in the same order.
# isort: off
from . import locks, fences, writes, documents, rules, election, jobs, outbox  # noqa: F401
# isort: on
from .actions import Done, OperatorAction, OperatorActionsMixin, operate
from .base import HistoryAdmin
from .documents import DocumentAdmin, RebindForm
from .election import BeatSlotAdmin, BeatSlotStateFilter, RoleAdmin
from .fenced import WATERMARK_FIELD, FencedModelAdmin
from .fenced import _UniqueWithinRules as _UniqueWithinRules  # tests use it
from .fences import FenceAdmin
from .jobs import JobPolicyAdmin, JobPolicyForm
from .locks import GrantAdmin, GrantEndFilter, LockAdmin, LockStateFilter
from .outbox import OutboxCallAdmin
from .pages import DASHBOARD_REFRESH_SECONDS
from .rules import AccessRuleAdmin
from .tokens import replace_token_admin
from .writes import AcceptedWriteAdmin, IdempotencyRecordAdmin, RejectionAdmin, UnfencedSaveAdmin

__all__ = [
    "DASHBOARD_REFRESH_SECONDS",
    "WATERMARK_FIELD",
    "AcceptedWriteAdmin",
    "AccessRuleAdmin",
    "BeatSlotAdmin",
    "BeatSlotStateFilter",
    "DocumentAdmin",
    "Done",
    "FenceAdmin",
    "FencedModelAdmin",
    "GrantAdmin",
    "GrantEndFilter",
    "HistoryAdmin",
    "IdempotencyRecordAdmin",
    "JobPolicyAdmin",
    "JobPolicyForm",
    "LockAdmin",
    "LockStateFilter",
    "OperatorAction",
    "OperatorActionsMixin",
    "OutboxCallAdmin",
    "RebindForm",
    "RejectionAdmin",
    "RoleAdmin",
    "UnfencedSaveAdmin",
    "operate",
]

if django_apps.is_installed("rest_framework.authtoken"):
    replace_token_admin(admin.site)
