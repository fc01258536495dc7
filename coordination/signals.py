"""Signals sent by the grant point and the fences, after the change committed.

``grant=`` is the holder's :class:`~coordination.leases.Lease` (``.key .token
.holder .acquired_at .expires_at``, and ``.ended_at``/``.end_reason`` once
released), except for a revocation, whose ``grant=`` is the revoked
:class:`~coordination.models.Grant` row (the operator holds no lease). Both have
``key``, ``token``, ``holder``, ``acquired_at``, ``expires_at`` and ``ended_at``.
The grant point's signals keep ``sender=Grant``.

- ``lock_acquired(sender=Grant, grant=lease)``
- ``lock_released(sender=Grant, grant=lease or Grant row, reason=GrantEnd)`` (released
  by its holder: the lease; revoked: the Grant row)
- ``lock_lost(sender=Grant, grant=lease, error=...)`` (renew, or a fenced task's
  keep-alive, found the lease gone)
- ``write_accepted(sender=Fence, resource=..., grant=lease, step=...)`` (a fenced write
  applied; sent after the statement, inside the caller's transaction if any)
- ``write_rejected(sender=Rejection, rejection=...)``
- ``task_skipped(sender=task class, task=..., key=..., reason=..., error=...)`` (a fenced
  task did not run its body: ``reason`` is ``"lock_held"``, ``"superseded"``, ``"paused"``
  or ``"completed"``, a ``once`` task id whose body completed before, or ``"duplicate"``, a
  unique job's key held by another execution)
- ``task_rate_limited(sender=execution class, task=..., key=..., countdown=...)`` (a
  fenced execution over its rate limit, deferred by ``countdown`` seconds; ``key`` is
  the rate key counted)
- ``lock_renewed(sender=Grant, grant=lease)`` (renew moved ``grant.expires_at``)
- ``lock_expired(sender=Grant, key=..., token=..., holder=..., acquired_at=..., expired_at=...)``
  (a lease ran out and was recorded as expired: by a late release, or by the next
  acquire taking the lock over)

``lock_acquired`` may also carry ``waited``: seconds from the acquire() call to the
grant. Receivers take ``**kwargs``, so new arguments never break them.
"""

from django.dispatch import Signal

# The grant point's and the fences' signals are sent on every acquire, release
# and accepted write, always with a model class as the sender: their receivers
# are looked up once per sender and kept until one connects or disconnects
# (as Django's own model signals do), not gathered again on every send.
lock_acquired = Signal(use_caching=True)
lock_released = Signal(use_caching=True)
lock_lost = Signal(use_caching=True)
write_accepted = Signal(use_caching=True)
write_rejected = Signal()
task_skipped = Signal()
task_rate_limited = Signal()
lock_renewed = Signal(use_caching=True)
lock_expired = Signal(use_caching=True)
