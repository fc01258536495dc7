"""Fenced object storage: a Django ``Storage`` over django-storages' S3 backend.

Every write and delete of :class:`FencedS3Storage` carries a grant's token (the
current grant, :func:`coordination.leases.current_grant`, or one passed with
:meth:`FencedS3Storage.under`). The object keeps its watermark in its own
metadata (``x-amz-meta-coordination-token``, ``-step``, ``-key``), and the check
and the write are one conditional request:

1. ``HEAD`` the object: its ETag and watermark (or 404: no object);
2. refuse a (token, step) not above the watermark (``StaleToken``,
   ``DuplicateWrite``, rule 4 of docs/rules.md) or guarded by another key
   (``WrongLock``), recording a :class:`~coordination.models.Rejection`;
3. ``PUT`` with ``If-Match: <that ETag>`` (``If-None-Match: *`` when there was
   none): the store applies it only if nobody wrote in between;
4. on 412 (or 409, a concurrent conditional write) start again from 1.

A delete is the same conditional request writing a small *delete marker* in
the object's place: the watermark has to outlive the data, or a stale holder
could create the object again. The storage hides markers (``exists()`` is
False, ``open()`` raises ``FileNotFoundError``).

The ETag stands for the object's version. S3 computes a plain upload's ETag
from its bytes: a write that brings the object back to bytes it held before,
under a newer token, gives back an ETag a paused holder may have read
(docs/stores-objects.md, "What is not covered").
"""

from __future__ import annotations

import logging
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError
from django.core.files.base import ContentFile, File
from storages.backends.s3 import S3Storage
from storages.utils import ReadBytesWrapper, clean_name, is_seekable

from ..conf import app_settings
from ..exceptions import LeaseLost, WrongLock
from ..fenced.grants import resolve_grant, resolve_step
from ..fenced.rejections import refusal_of, refuse
from ..leases import Lease
from ..models import RejectionReason
from .errors import StoreUnavailable

__all__ = ["MARKER_SIZE", "FencedS3Storage", "Watermark"]

logger = logging.getLogger("coordination.fencing")

TOKEN, STEP, KEY, DELETED = (
    "coordination-token", "coordination-step", "coordination-key", "coordination-deleted"
)
# A delete marker's body is unique per watermark (watermarks only rise), so its
# ETag never comes back; its fixed size lets listdir() find markers without a HEAD each.
_MARKER = "coordination-deleted {token:020d} {step:020d}\n"
MARKER_SIZE = len(_MARKER.format(token=0, step=0))
_LOST_RACE = {"PreconditionFailed", "ConditionalRequestConflict", "412", "409"}
# An If-Match PUT of an object deleted meanwhile (by a plain client): read again.
_GONE = {"NoSuchKey", "404"}


class Watermark:
    """What the store holds for one object: its ETag (None: no object), the
    (token, step) and key of its last fenced write, and whether it is a delete marker."""

    __slots__ = ("deleted", "etag", "key", "step", "token")

    def __init__(self, etag: str | None, metadata: dict[str, str] | None = None) -> None:
        metadata = metadata or {}
        self.etag = etag
        self.token = int(metadata.get(TOKEN, 0) or 0)
        self.step = int(metadata.get(STEP, 0) or 0)
        self.key = metadata.get(KEY, "")
        self.deleted = metadata.get(DELETED) == "1"

    def __repr__(self) -> str:
        return f"Watermark(etag={self.etag!r}, token={self.token}, step={self.step}, deleted={self.deleted})"


class FencedS3Storage(S3Storage):  # type: ignore[misc]  # django-storages is untyped
    """An ``S3Storage`` whose ``save()`` and ``delete()`` are fenced.

    Options (``STORAGES[...]["OPTIONS"]``) besides S3Storage's own:

    - ``conditional_writes`` (default True): the store supports ``If-Match`` and
      ``If-None-Match`` on PUT and ``If-Match`` on DELETE. Set it to False for a
      store that does not, and the system check refuses to start
      (``coordination.E101``) instead of leaving writes unfenced.
    - ``probe_at_check``: True, the system check also writes a probe object
      and makes sure the store refuses a failed precondition (a few requests
      per check run); left out, only ``manage.py check --deploy`` does; False,
      never.
    - ``max_attempts`` (default 20): conditional writes lost to a concurrent
      writer before giving up with ``StoreUnavailable``.
    - ``using``: the database alias the rejections are recorded in (default
      ``COORDINATION["DATABASE"]``).

    ``file_overwrite`` is forced on: a fenced name is a resource, written again
    in place, not renamed on collision.
    """

    file_overwrite = True

    def __init__(self, grant: Lease | None = None, **settings: Any) -> None:
        super().__init__(**settings)
        self.grant = grant

    def get_default_settings(self) -> dict[str, Any]:
        defaults: dict[str, Any] = super().get_default_settings()
        defaults.update(
            conditional_writes=True, probe_at_check=False, max_attempts=20, using=None
        )
        defaults["file_overwrite"] = True
        return defaults

    # -- grants --------------------------------------------------------------

    def under(self, grant: Lease) -> FencedS3Storage:
        """The same storage, writing with ``grant`` instead of the current grant."""
        clone: FencedS3Storage = self.__class__.__new__(self.__class__)
        clone.__dict__.update(self.__dict__)
        clone.grant = grant
        return clone

    def resource(self, name: str) -> str:
        """The resource name rejections record for object ``name``."""
        return f"s3:{self.bucket_name}/{self._key(name)}"

    def _key(self, name: str) -> str:
        key: str = self._normalize_name(clean_name(name))
        return key

    @property
    def _client(self) -> Any:
        return self.connection.meta.client

    # -- reading the watermark -----------------------------------------------

    def watermark(self, name: str) -> Watermark:
        """The object's ETag and watermark, read with one HEAD."""
        return self._head(self._key(name))

    def _head(self, key: str) -> Watermark:
        try:
            found = self._client.head_object(Bucket=self.bucket_name, Key=key)
        except ClientError as error:
            if _status(error) == 404:
                return Watermark(None)
            raise self._unavailable(error) from error
        except BotoCoreError as error:
            raise self._unavailable(error) from error
        metadata = {name.lower(): value for name, value in found.get("Metadata", {}).items()}
        return Watermark(found["ETag"], metadata)

    # -- fenced writes -------------------------------------------------------

    def _save(self, name: str, content: File[Any]) -> str:
        cleaned = clean_name(name)
        key = self._key(cleaned)
        params = self._get_write_parameters(key, content)
        if is_seekable(content):
            content.seek(0)
        body = ReadBytesWrapper(content).read()
        self._fenced_put(key, body, params, None, None)
        return str(cleaned)

    def save_fenced(
        self, name: str, content: bytes | File[Any], *, grant: Lease | None = None,
        step: int | None = None,
    ) -> Watermark:
        """Write ``content`` at ``name`` (exactly that name) with ``grant`` (default: the
        storage's, then the current grant) and ``step`` (default: the lease's next);
        returns the watermark written."""
        key = self._key(name)
        file = ContentFile(content) if isinstance(content, bytes) else content
        params = self._get_write_parameters(key, file)
        file.seek(0)
        return self._fenced_put(key, ReadBytesWrapper(file).read(), params, grant, step)

    def delete(self, name: str, *, grant: Lease | None = None, step: int | None = None) -> None:
        """Delete ``name`` under a fence: a delete marker takes its place and keeps
        its watermark, so only a newer (token, step) may write it again."""
        key = self._key(name)
        self._fenced_put(key, None, {}, grant, step)

    def _fenced_put(
        self, key: str, body: bytes | None, params: dict[str, Any],
        grant: Lease | None, step: int | None,
    ) -> Watermark:
        lease = resolve_grant(grant if grant is not None else self.grant)
        number = resolve_step(lease, step)
        resource = f"s3:{self.bucket_name}/{key}"
        using = self.using or app_settings.DATABASE
        if lease.lost:
            refuse(LeaseLost(), resource=resource, grant=lease, step=number,
                   reason=RejectionReason.LEASE_LOST, using=using)
        metadata = {**params.pop("Metadata", {}), TOKEN: str(lease.token), STEP: str(number),
                    KEY: lease.key}
        if body is None:
            metadata[DELETED] = "1"
            body = _MARKER.format(token=lease.token, step=number).encode()
            params = {"ContentType": "application/octet-stream"}
        for _ in range(self.max_attempts):
            current = self._head(key)
            if current.etag is not None:
                if current.key and current.key != lease.key:
                    refuse(WrongLock(f"{resource} is guarded by lock {current.key!r}, "
                                     f"not {lease.key!r}"),
                           resource=resource, grant=lease, step=number,
                           reason=RejectionReason.WRONG_LOCK,
                           watermark=(current.token, current.step), using=using)
                refused = refusal_of(resource, lease.token, number, current.token, current.step)
                if refused is not None:
                    refuse(refused[1], resource=resource, grant=lease, step=number,
                           reason=refused[0], watermark=(current.token, current.step), using=using)
                condition = {"IfMatch": current.etag}
            else:
                condition = {"IfNoneMatch": "*"}
            try:
                written = self._client.put_object(
                    Bucket=self.bucket_name, Key=key, Body=body, Metadata=metadata,
                    **condition, **params,
                )
            except ClientError as error:
                if _code(error) in _LOST_RACE | _GONE:
                    continue  # another writer came between the HEAD and the PUT: read again
                raise self._unavailable(error) from error
            except BotoCoreError as error:
                raise self._unavailable(error) from error
            return Watermark(written.get("ETag"), metadata)
        raise StoreUnavailable(resource, f"lost {self.max_attempts} conditional writes in a row")

    # -- reads that hide delete markers ----------------------------------------

    def exists(self, name: str) -> bool:
        found = self._head(self._key(name))
        return found.etag is not None and not found.deleted

    def _open(self, name: str, mode: str = "rb") -> Any:
        if self._head(self._key(name)).deleted:
            raise FileNotFoundError(f"File does not exist: {name}")
        return super()._open(name, mode)

    def size(self, name: str) -> int:
        if self._head(self._key(name)).deleted:
            raise FileNotFoundError(f"File does not exist: {name}")
        return int(super().size(name))

    def listdir(self, name: str) -> tuple[list[str], list[str]]:
        directories, files = super().listdir(name)
        prefix = self._key(name)
        prefix = f"{prefix}/" if prefix and not prefix.endswith("/") else prefix
        sizes = self._sizes(prefix)
        kept = [
            file for file in files
            if sizes.get(prefix + file) != MARKER_SIZE or not self._head(prefix + file).deleted
        ]
        return directories, kept

    def _sizes(self, prefix: str) -> dict[str, int]:
        sizes: dict[str, int] = {}
        pages = self._client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket_name, Delimiter="/", Prefix=prefix
        )
        for page in pages:
            for entry in page.get("Contents", ()):
                sizes[entry["Key"]] = int(entry["Size"])
        return sizes

    # -- the system check's probe -----------------------------------------------

    def probe_conditional_writes(self) -> str | None:
        """Write a probe object and check that the store refuses a failed precondition;
        None if it does, else what it did. Deletes the probe."""
        key = self._key(".coordination-probe")
        client = self._client
        try:
            client.put_object(Bucket=self.bucket_name, Key=key, Body=b"probe")
            try:
                client.put_object(Bucket=self.bucket_name, Key=key, Body=b"again", IfNoneMatch="*")
            except ClientError as error:
                if _code(error) not in _LOST_RACE:
                    return f"If-None-Match: * answered {_code(error)}"
            else:
                return "a PUT with If-None-Match: * replaced an existing object"
            try:
                client.put_object(Bucket=self.bucket_name, Key=key, Body=b"again",
                                  IfMatch='"00000000000000000000000000000000"')
            except ClientError as error:
                if _code(error) not in _LOST_RACE:
                    return f"If-Match answered {_code(error)}"
            else:
                return "a PUT with a wrong If-Match ETag was applied"
            client.delete_object(Bucket=self.bucket_name, Key=key)
        except (ClientError, BotoCoreError) as error:
            return f"the probe failed: {error}"
        return None

    def _unavailable(self, error: Exception) -> StoreUnavailable:
        return StoreUnavailable(f"s3:{self.bucket_name}", str(error))


def _code(error: ClientError) -> str:
    return str(error.response.get("Error", {}).get("Code", ""))


def _status(error: ClientError) -> int:
    return int(error.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0))
