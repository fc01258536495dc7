"""The resource side: fences that refuse late writers where the side effect happens.

A resource keeps a watermark, the highest (token, step) it has accepted, and
checks a write against it in the same atomic statement or transaction as the
write itself (rule 4 of docs/rules.md):

- token below the watermark: refused as stale (``StaleToken``);
- token above it: accepted, and the watermark rises;
- the same token: accepted only for a later step of the same grant (a holder
  numbering its writes 1, 2, 3...); the same or an earlier step is a
  duplicate (``DuplicateWrite``). Same-token retries that must return the
  first result go through :func:`idempotent`.

Three ways to fence a resource:

- :class:`FencedModel` rows are their own fences: ``fenced_update`` is one
  conditional ``UPDATE ... WHERE fence < :token OR (fence = :token AND
  fence_step < :step)``.
- :func:`fence` locks named :class:`~coordination.models.Fence` rows in the
  caller's transaction, for side effects that are not one row update.
- The REST document store, built on :func:`fence`.

Every refusal is recorded as a :class:`~coordination.models.Rejection`.

This module names the public API; the code is in ``coordination/fenced/``,
one module per concern.
"""

from __future__ import annotations

from .fenced.fences import afence, fence
from .fenced.grants import Grants
from .fenced.idempotency import idempotent
from .fenced.keys import lock_binding as lock_binding
from .fenced.keys import lock_key_expression, lock_key_of
from .fenced.models import FencedModel
from .fenced.queryset import FencedQuerySet
from .fenced.raising import WatermarkRaise, raise_fence_to_lock
from .fenced.rejections import record_rejection
from .fenced.unfenced import unfenced
from .watermarks import WatermarkField

__all__ = [
    "FencedModel",
    "FencedQuerySet",
    "Grants",
    "WatermarkField",
    "WatermarkRaise",
    "afence",
    "fence",
    "idempotent",
    "lock_key_expression",
    "lock_key_of",
    "raise_fence_to_lock",
    "record_rejection",
    "unfenced",
]
