"""Raising a fence's watermark to the last token its lock issued (after a restore)."""

from __future__ import annotations

import logging
from typing import NamedTuple

from django.db import transaction

from ..conf import app_settings
from ..exceptions import InvalidInput
from ..logfields import LogFields
from ..models import MAX_TOKEN, Fence, Lock, TokenFloor

# The resource side's documented logger, whichever of its modules logs.
logger = logging.getLogger("coordination.fencing")


class WatermarkRaise(NamedTuple):
    """What :func:`raise_fence_to_lock` did to one fence: watermarks as (token, step)."""

    resource: str
    lock_key: str
    before: tuple[int, int]
    after: tuple[int, int]

    @property
    def raised(self) -> bool:
        return self.after > self.before


def raise_fence_to_lock(
    fence: Fence | str, *, step: int = 0, using: str | None = None
) -> WatermarkRaise:
    """Raise a fence's watermark to the last token its lock has issued; never lower it.

    For after a restore from backup (rule 8 of docs/rules.md): a restored watermark can be
    older than tokens already issued and used, and writes of those tokens would
    be accepted again. Afterwards every token below the lock's last one is
    refused as stale. Where the token floor (:class:`~coordination.models.TokenFloor`)
    is above the lock's counter, the floor counts as its last token: no grant
    is issued a token at or below it any more, and a key first granted after
    the lock database's backup has no counter to go by. The last token itself
    still writes steps above ``step`` (default 0: its holder may be mid-work);
    pass ``step=MAX_TOKEN`` to refuse it too, so that only a new grant can
    write. A watermark already at or above (last token, ``step``) is left as it
    is. The fence row is locked while deciding, as for a write. Raises
    ``Fence.DoesNotExist`` for an unknown resource.
    """
    resource = fence if isinstance(fence, str) else fence.resource
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= MAX_TOKEN:
        raise InvalidInput(f"step must be an integer from 0 to {MAX_TOKEN}")
    alias = using or app_settings.DATABASE
    with transaction.atomic(using=alias):
        row = Fence.objects.using(alias).select_for_update().get(resource=resource)
        issued = max(
            Lock.objects.using(alias).filter(key=row.lock_key).values_list("token", flat=True).first()
            or 0,
            TokenFloor.objects.using(alias).value(),
        )
        before = (row.token, row.step)
        after = max(before, (issued, step))
        if after > before:
            # updated_at stays: it is the time of the last accepted write.
            Fence.objects.using(alias).filter(pk=row.pk).update(token=after[0], step=after[1])
    if after > before:
        logger.warning(
            "fence raised %s",
            LogFields(
                resource=row.resource, key=row.lock_key, token_before=before[0],
                step_before=before[1], token=after[0], step=after[1],
            ),
        )
    if not isinstance(fence, str):
        fence.token, fence.step = after
    return WatermarkRaise(row.resource, row.lock_key, before, after)
