"""Signals sent by the grant point and the fences, after the change committed.

- ``lock_acquired(sender=Grant, grant=...)``
- ``lock_released(sender=Grant, grant=..., reason=GrantEnd)`` (released or revoked)
- ``lock_lost(sender=Grant, grant=..., error=...)`` (renew found the lease gone)
- ``write_accepted(sender=Fence, resource=..., grant=..., step=...)`` (a fenced write
  applied; sent after the statement, inside the caller's transaction if any)
- ``write_rejected(sender=Rejection, rejection=...)``
- ``task_skipped(sender=task class, task=..., key=..., reason=..., error=...)`` (a fenced
  task did not run its body: ``reason`` is ``"lock_held"`` or ``"superseded"``)
"""

from django.dispatch import Signal

lock_acquired = Signal()
lock_released = Signal()
lock_lost = Signal()
write_accepted = Signal()
write_rejected = Signal()
task_skipped = Signal()
