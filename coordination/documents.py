"""The fenced document store: a fencing proxy for downstreams that cannot check tokens.

A document is a JSON value under a name, guarded by the :class:`~coordination.models.Fence`
``document:<name>``. :func:`put_document` checks the grant against that fence and
writes the document in one transaction (rule 10 of docs/rules.md: a downstream that cannot
check tokens itself is put behind this proxy). The first write decides which lock
key guards the document; a grant of another key is refused with ``WrongLock``.
"""

from __future__ import annotations

from typing import Any

from . import fencing
from .conf import app_settings
from .exceptions import InvalidInput
from .leases import Lease
from .models import KEY_MAX_LENGTH, DatabaseNow, Document, validate_key

__all__ = ["NAME_MAX_LENGTH", "document_resource", "get_document", "put_document"]

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
) -> Document:
    """Write ``data`` as document ``name`` if ``grant`` passes the document's fence.

    The fence check and the write commit in one transaction, or neither does.
    Raises ``StaleToken`` (a newer token has written), ``DuplicateWrite`` (this
    token already wrote this step; pass increasing ``step`` numbers for several
    writes under one token), ``WrongLock`` (the document is guarded by another
    lock key) or ``LeaseLost``; each refusal is recorded as a Rejection.
    Returns the stored document with its fence loaded.
    """
    resource = document_resource(name)
    alias = using or app_settings.DATABASE
    documents = Document.objects.using(alias)
    with fencing.fence(resource, grant, step=step, using=alias) as row:
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
