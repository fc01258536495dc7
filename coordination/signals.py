"""Signals sent by the grant point and the fences, after the change committed.

- ``lock_acquired(sender=Grant, grant=...)``
- ``lock_released(sender=Grant, grant=..., reason=GrantEnd)`` (released or revoked)
- ``lock_lost(sender=Grant, grant=..., error=...)`` (renew found the lease gone)
- ``write_accepted(sender=Fence, resource=..., grant=..., step=...)`` (a fenced write
  applied; sent after the statement, inside the caller's transaction if any)
- ``write_rejected(sender=Rejection, rejection=...)``
- ``task_skipped(sender=task class, task=..., key=..., reason=..., error=...)`` (a fenced
  task did not run its body: ``reason`` is ``"lock_held"`` or ``"superseded"``)
- ``lock_renewed(sender=Grant, grant=...)`` (renew moved ``grant.expires_at``)
- ``lock_expired(sender=Grant, key=..., token=..., holder=..., acquired_at=..., expired_at=...)``
  (a lease ran out and was recorded as expired: by a late release, or by the next
  acquire taking the lock over)

``lock_acquired`` may also carry ``waited``: seconds from the acquire() call to the
grant. Receivers take ``**kwargs``, so new arguments never break them.
"""

from django.dispatch import Signal

lock_acquired = Signal()
lock_released = Signal()
lock_lost = Signal()
write_accepted = Signal()
write_rejected = Signal()
task_skipped = Signal()
lock_renewed = Signal()
lock_expired = Signal()
