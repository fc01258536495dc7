"""Documents of the fenced store: read, and the fenced (optionally idempotent) write."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from django.http import Http404
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import serializers
from rest_framework.request import Request
from rest_framework.response import Response

from ... import access, documents, fencing, locks
from ...documents import NAME_MAX_LENGTH
from ...exceptions import (
    DuplicateWrite,
    IdempotencyKeyReused,
    KeyForbidden,
    LeaseLost,
    StaleToken,
    WrongLock,
)
from ...models import Document
from ..serializers import DocumentSerializer, DocumentWrite
from .base import NAME_PARAMETER, CoordinationView, error_responses, operation, path_key, validated

IDEMPOTENCY_HEADER = "Idempotency-Key"
IDEMPOTENCY_KEY_MAX_LENGTH = 128
# What the fence answers a write it refuses; stored as the answer of an idempotent PUT.
FENCE_REFUSALS = (StaleToken, DuplicateWrite, WrongLock, LeaseLost)


@extend_schema(tags=["documents"], parameters=[NAME_PARAMETER])
class DocumentView(CoordinationView):
    """A document of the fenced store."""

    required_permissions = {
        "GET": "coordination.view_document",
        "PUT": "coordination.write_document",
    }

    @operation(
        operation_id="documents_retrieve",
        summary="Read a document",
        responses={200: DocumentSerializer, **error_responses(404)},
    )
    def get(self, request: Request, name: str) -> Response:
        name = path_key(name, "name", max_length=NAME_MAX_LENGTH)
        try:
            document = documents.get_document(name)
        except Document.DoesNotExist:
            raise Http404 from None
        # As for fences: a document bound to a key the user may not read is absent.
        if not access.for_request(request).allows("read", document.fence.lock_key):
            raise Http404
        return Response(DocumentSerializer(document).data)

    @operation(
        operation_id="documents_write",
        summary="Fenced write of a document",
        description=(
            "Writes `data` if the grant (`lock_key`, `token`, proven by `lease_id`) passes the "
            "document's fence; the check and the write are one transaction. Refusals: 409 "
            "`stale_token` (with `current_token`), `duplicate_write` (same token and step; "
            "number several writes with `step`), `wrong_lock`, `lease_lost` (the lease_id does "
            "not match that grant). With an `Idempotency-Key` header a retry returns the "
            "stored response, a refusal included (header `Idempotent-Replayed: true`)."
        ),
        parameters=[
            OpenApiParameter(
                IDEMPOTENCY_HEADER,
                {"type": "string", "minLength": 1, "maxLength": IDEMPOTENCY_KEY_MAX_LENGTH},
                OpenApiParameter.HEADER,
                description="Makes a retried PUT return the stored response instead of writing again.",
            )
        ],
        request=DocumentWrite,
        responses={200: DocumentSerializer, **error_responses(409, 413, 415)},
    )
    def put(self, request: Request, name: str) -> Response:
        name = path_key(name, "name", max_length=NAME_MAX_LENGTH)
        idempotency_key = _idempotency_key(request)
        body = validated(DocumentWrite, request.data)
        # The grant's key is the one a new document is bound to (and the one an
        # existing document must be bound to, which the fence checks).
        rules = access.for_request(request)
        rules.require("write", body["lock_key"])
        grant = locks.grant_from_proof(body["lock_key"], body["token"], body["lease_id"])

        def bound_within_rules(bound: str) -> None:
            # Checked under the fence's row lock, before the fence's own wrong_lock:
            # that would name a key outside the user's rules, and record a rejection
            # carrying its watermark. Read before the lock, the binding could be
            # made by another writer in between (two first writes racing).
            if not rules.allows("write", bound):
                raise KeyForbidden(
                    f"document {name!r} is bound to a lock key your access rules do not allow "
                    "you to write with (docs/access-rules.md)", action="write",
                )

        def write() -> dict[str, Any]:
            document = documents.put_document(
                name, grant, body["data"], step=body.get("step"),
                key_check=bound_within_rules if rules.limited else None,
            )
            return dict(DocumentSerializer(document).data)

        if idempotency_key is None:
            return Response(write())
        ran = False
        fingerprint = _fingerprint(name, body)

        def write_once() -> dict[str, Any]:
            nonlocal ran
            ran = True
            try:
                return {"request": fingerprint, "status": 200, "response": write()}
            except FENCE_REFUSALS as refusal:
                # A refusal is final for this write, so it is the stored answer too:
                # the retry gets it again, and the rejection record commits with it
                # (on SQLite it would otherwise roll back with this transaction).
                return {"request": fingerprint, "status": refusal.status_code, "response": refusal.as_dict()}

        # Scoped per user and document; hashed to fit the record's 255 characters.
        scope = f"{request.user.pk}\0{name}\0{idempotency_key}".encode()
        scoped = f"coordination.api.document:{hashlib.sha256(scope).hexdigest()}"
        stored = fencing.idempotent(scoped, write_once)
        if stored["request"] != fingerprint:
            raise IdempotencyKeyReused()
        headers = {} if ran else {"Idempotent-Replayed": "true"}
        return Response(stored["response"], status=stored["status"], headers=headers)


def _idempotency_key(request: Request) -> str | None:
    value = request.headers.get(IDEMPOTENCY_HEADER)
    if value is None:
        return None
    if not 0 < len(value) <= IDEMPOTENCY_KEY_MAX_LENGTH or not value.isprintable() or not value.isascii():
        raise serializers.ValidationError(
            {IDEMPOTENCY_HEADER: [f"Must be 1 to {IDEMPOTENCY_KEY_MAX_LENGTH} printable ASCII characters."]},
            code="invalid",
        )
    return value


def _fingerprint(name: str, body: dict[str, Any]) -> str:
    canonical = json.dumps({"name": name, **body}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()
