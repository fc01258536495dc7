"""The fenced document store: a fencing proxy for downstreams that cannot check tokens.

A document is a JSON value under a name, guarded by the :class:`~coordination.models.Fence`
``document:<name>``. :func:`put_document` checks the grant against that fence and
writes the document in one transaction (rule 10 of docs/rules.md: a downstream that cannot
check tokens itself is put behind this proxy). The first write binds the
document to its grant's lock key; a grant of another key is refused with
``WrongLock``. Only an operator moves it to another key (:func:`rebind_document`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, NamedTuple

from django.db import connections, transaction

from . import fencing
from .backends import dialect_of
from .conf import app_settings
from .exceptions import InvalidInput
from .leases import Lease
from .logfields import LogFields
from .models import KEY_MAX_LENGTH, DatabaseNow, Document, Fence, Lock, validate_key

__all__ = [
    "NAME_MAX_LENGTH", "Rebind", "document_resource", "get_document", "put_document",
    "rebind_document",
]

logger = logging.getLogger("coordination.documents")

RESOURCE_PREFIX = "document:"
# The fence's resource name is "document:<name>" and must itself be a valid key.
NAME_MAX_LENGTH = KEY_MAX_LENGTH - len(RESOURCE_PREFIX)


def document_resource(name: object) -> str:
    """The fence resource guarding document ``name``; raises InvalidInput for a bad name."""
    name = validate_key(name, what="document name")
    if len(name) > NAME_MAX_LENGTH:
        raise InvalidInput(f"document name is {len(name)} characters long; at most {NAME_MAX_LENGTH}")
    return RESOURCE_PREFIX + name


def put_document(
    name: str,
    grant: Lease | None,
    data: Any,
    *,
    step: int | None = None,
    using: str | None = None,
    key_check: Callable[[str], None] | None = None,
) -> Document:
    """Write ``data`` as document ``name`` if ``grant`` passes the document's fence.

    The fence check and the write commit in one transaction, or neither does.
    Raises ``StaleToken`` (a newer token has written), ``DuplicateWrite`` (this
    token already wrote this step; pass increasing ``step`` numbers for several
    writes under one token), ``WrongLock`` (the document is guarded by another
    lock key) or ``LeaseLost``; each refusal is recorded as a Rejection.
    ``key_check(lock_key)`` runs on the key the document is bound to, under the
    fence's row lock and before those checks (see :func:`coordination.fencing.fence`):
    what it raises is raised, nothing is written and nothing recorded.
    Returns the stored document with its fence loaded.
    """
    resource = document_resource(name)
    alias = using or app_settings.DATABASE
    documents = Document.objects.using(alias)
    with fencing.fence(resource, grant, step=step, using=alias, key_check=key_check) as row:
        # The fence row is locked until commit, so writers of one document are
        # serialised here and the create below cannot race another create.
        if not documents.filter(name=name).update(data=data, updated_at=DatabaseNow()):
            documents.create(name=name, fence=row, data=data)
    return documents.select_related("fence").get(name=name)


def get_document(name: str, *, using: str | None = None) -> Document:
    """The document ``name`` with its fence; raises ``Document.DoesNotExist``."""
    document_resource(name)
    alias = using or app_settings.DATABASE
    return Document.objects.using(alias).select_related("fence").get(name=name)


class Rebind(NamedTuple):
    """What :func:`rebind_document` did: the keys, the watermark, the new key's counter."""

    name: str
    before: str
    after: str
    watermark: tuple[int, int]
    counter_before: int
    counter_after: int

    @property
    def counter_raised(self) -> bool:
        return self.counter_after > self.counter_before


def held_below_watermark(lock_key: str, counter: int, holder: str, watermark: int) -> str:
    """Why a re-bind to ``lock_key`` must wait, or "" if it need not."""
    if not holder or counter >= watermark:
        return ""
    return (
        f"lock {lock_key!r} is held by {holder} with token {counter}, below the document's "
        f"watermark {watermark}: re-binding raises its token counter past the watermark, which "
        "would end that lease. Release or revoke it first, then re-bind."
    )


def rebind_document(name: str, lock_key: str, *, using: str | None = None) -> Rebind:
    """Bind document ``name`` to the lock key ``lock_key`` instead of its current key.

    The document's watermark (token, step) stays as it is: it is never lowered
    (rule 8 of docs/rules.md). Tokens compare only within one key (rule 7), so
    the watermark, a token of the old key, is carried over to the new key by
    raising the new key's token counter to at least the watermark's token: the
    new key's next grant gets a higher token and can write at once, and every
    grant of it issued before the re-bind (a token at or below the watermark) is
    refused as stale, as a grant of the old key is refused as ``wrong_lock``
    from now on. A counter only rises; a key the database has not seen gets its
    Lock row here. A lease's identity is its key's counter, so a counter is
    never raised under a lease: when the new key's counter is below the
    watermark and its lock is held (or expired, not released), the re-bind is
    refused until that lease is released or revoked.

    The fence row and the new key's Lock row are locked while it runs, as for a
    write and a grant. Raises ``Document.DoesNotExist``, or ``InvalidInput`` for a
    bad key, the key the document is already bound to, or a held new key whose
    counter would have to rise.
    """
    lock_key = validate_key(lock_key, what="lock key")
    alias = using or app_settings.DATABASE
    fences = Fence.objects.using(alias)
    keys = Lock.objects.using(alias)
    with transaction.atomic(using=alias):
        document = Document.objects.using(alias).get(name=name)
        fence = fences.select_for_update().get(pk=document.fence_id)
        if fence.lock_key == lock_key:
            raise InvalidInput(f"document {name!r} is already bound to lock key {lock_key!r}")
        dialect_of(connections[alias]).create_missing(keys, [Lock(key=lock_key)], "key")
        counter, holder = (
            keys.select_for_update().filter(key=lock_key).values_list("token", "holder").get()
        )
        raised = max(counter, fence.token)
        if raised > counter:
            refusal = held_below_watermark(lock_key, counter, holder, fence.token)
            if refusal:
                raise InvalidInput(refusal)
            keys.filter(key=lock_key, token__lt=raised).update(token=raised)
        fences.filter(pk=fence.pk).update(lock_key=lock_key)
    result = Rebind(name, fence.lock_key, lock_key, (fence.token, fence.step), counter, raised)
    logger.warning(
        "document re-bound %s",
        LogFields(
            name=name, before=result.before, after=result.after, watermark_token=fence.token,
            counter=counter, raised_to=raised,
        ),
    )
    return result
