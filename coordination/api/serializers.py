"""Request and response shapes of the REST API.

Input is strict: a field takes exactly its JSON type (no ``"1"`` for 1, no
``1.5`` or ``true`` for an integer, no ``null`` unless stated), unknown fields
are refused, and every bound is checked before the grant point or a fence is
touched, so a refused request changes nothing.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, cast

from django.db import connections
from django.db.models import QuerySet
from rest_framework import serializers

from ..backends import dialect_of
from ..conf import app_settings
from ..documents import NAME_MAX_LENGTH
from ..exceptions import InvalidInput
from ..leases import Lease
from ..locks import MAX_KEYS_AT_ONCE
from ..models import (
    HOLDER_MAX_LENGTH,
    KEY_MAX_LENGTH,
    MAX_TOKEN,
    Document,
    Fence,
    Grant,
    GrantMode,
    Lock,
    LockState,
    Rejection,
    validate_holder,
    validate_key,
)
from ..semaphores import MAX_PERMITS, permit_slot

LEASE_ID_MAX_LENGTH = 128


# --- strict fields -------------------------------------------------------------


def _type_name(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, str):
        return "string"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, Mapping):
        return "object"
    if isinstance(value, list):
        return "array"
    return type(value).__name__


class StrictIntegerField(serializers.IntegerField):
    """A JSON integer only: not a string, float or boolean."""

    def to_internal_value(self, data: Any) -> int:
        if isinstance(data, bool) or not isinstance(data, int):
            raise serializers.ValidationError(
                f"Must be a JSON integer, not {_type_name(data)}.", code="invalid"
            )
        return int(super().to_internal_value(data))


class StrictSecondsField(serializers.FloatField):
    """A finite JSON number of seconds (integer or float), not a string or boolean."""

    def to_internal_value(self, data: Any) -> float:
        if isinstance(data, bool) or not isinstance(data, int | float):
            raise serializers.ValidationError(
                f"Must be a JSON number of seconds, not {_type_name(data)}.", code="invalid"
            )
        try:
            seconds = float(data)
        except OverflowError:  # an integer too large for a float
            seconds = math.inf
        if not math.isfinite(seconds):
            raise serializers.ValidationError("Must be a finite number.", code="invalid")
        return seconds


class StrictCharField(serializers.CharField):
    """A JSON string only: numbers are not turned into strings."""

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("trim_whitespace", False)
        super().__init__(**kwargs)

    def to_internal_value(self, data: Any) -> str:
        if not isinstance(data, str):
            raise serializers.ValidationError(
                f"Must be a JSON string, not {_type_name(data)}.", code="invalid"
            )
        return str(super().to_internal_value(data))


def _key(value: str) -> str:
    try:
        return validate_key(value)
    except InvalidInput as error:
        raise serializers.ValidationError(error.detail, code="invalid") from None


class StrictSerializer(serializers.Serializer[Any]):
    """Refuses fields it does not declare, instead of silently ignoring them."""

    def to_internal_value(self, data: Any) -> Any:
        unknown = sorted(set(data) - set(self.fields)) if isinstance(data, Mapping) else []
        errors: dict[str, Any] = {}
        try:
            value = super().to_internal_value(data)
        except serializers.ValidationError as error:
            if not unknown:
                raise
            if isinstance(error.detail, Mapping):
                errors.update(error.detail)
        # The declared fields' errors first: an answer that lists only the
        # first fields (api.exceptions.MAX_FIELD_ERRORS) still names them.
        errors.update({name: ["Unknown field."] for name in unknown})
        if errors:
            raise serializers.ValidationError(errors, code="invalid")
        return value


def _token_field(**kwargs: Any) -> StrictIntegerField:
    return StrictIntegerField(min_value=1, max_value=MAX_TOKEN, **kwargs)


DATA_MAX_DEPTH = 100


def data_max_depth() -> int:
    """The levels of arrays and objects a document's data may nest: 100, or fewer
    where the database's JSON holds fewer (31 on MariaDB)."""
    stored = dialect_of(connections[app_settings.DATABASE]).json_max_depth
    return min(DATA_MAX_DEPTH, stored or DATA_MAX_DEPTH)


def _storable_json(value: Any, depth: int = 0, limit: int = 0) -> None:
    """Refuse what a JSON column cannot store: NUL characters, lone surrogates, deep nesting.

    PostgreSQL's jsonb rejects ``\\u0000`` and the driver cannot encode a lone
    surrogate; both would otherwise fail at the database as a server error.
    """
    limit = limit or data_max_depth()
    # ``depth`` counts the arrays and objects around ``value``; an array or
    # object here is one level more.
    if isinstance(value, Mapping | list) and depth >= limit:
        raise serializers.ValidationError(f"Nested deeper than {limit} levels.", code="invalid")
    if isinstance(value, str):
        _storable_text(value)
    elif isinstance(value, Mapping):
        for key, item in value.items():
            _storable_text(str(key))
            _storable_json(item, depth + 1, limit)
    elif isinstance(value, list):
        for item in value:
            _storable_json(item, depth + 1, limit)


def _storable_text(text: str) -> None:
    if "\x00" in text:
        raise serializers.ValidationError("Strings must not contain NUL (\\u0000).", code="invalid")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise serializers.ValidationError(
            "Strings must be valid Unicode (no lone surrogates).", code="invalid"
        ) from None


# --- requests ----------------------------------------------------------------------


class AcquireRequest(StrictSerializer):
    """Body of an acquire."""

    holder = StrictCharField(
        min_length=1, max_length=HOLDER_MAX_LENGTH, help_text="Who takes the lock (1 to 200 characters)."
    )

    def get_fields(self) -> dict[str, serializers.Field[Any, Any, Any, Any]]:
        # The bounds are settings, read per request (never at import), so the schema
        # shows the ones in force.
        fields = super().get_fields()
        fields["ttl"] = _ttl_field(help_text="Lease length in seconds (COORDINATION MIN_TTL..MAX_TTL).")
        fields["wait"] = StrictSecondsField(
            required=False,
            default=0.0,
            min_value=0.0,
            max_value=_max_wait(),
            help_text="Seconds to wait for a held lock (default 0: answer at once; "
            "at most COORDINATION API_MAX_WAIT).",
        )
        return fields

    def validate_holder(self, value: str) -> str:
        try:
            return validate_holder(value)
        except InvalidInput as error:
            raise serializers.ValidationError(error.detail, code="invalid") from None

    def validate_ttl(self, value: float) -> float:
        return _ttl(value)


class LockAcquireRequest(AcquireRequest):
    """Body of a lock's acquire: exclusive (a writer, the default) or shared (a reader)."""

    mode = serializers.ChoiceField(
        choices=GrantMode.choices, required=False, default=GrantMode.EXCLUSIVE,
        help_text="`exclusive` (default: one holder, a writer) or `shared` (many readers at "
        "once; every writer granted later holds a greater token).",
    )


class PermitAcquireRequest(AcquireRequest):
    """Body of a semaphore's acquire: one of ``limit`` permits."""

    limit = StrictIntegerField(
        min_value=1, max_value=MAX_PERMITS,
        help_text="How many permits the semaphore has; every caller passes the same limit.",
    )


class LockSetAcquireRequest(AcquireRequest):
    """Body of an all-or-none acquire of several keys."""

    keys = serializers.ListField(
        child=StrictCharField(max_length=KEY_MAX_LENGTH, validators=[_key]),
        min_length=1, max_length=MAX_KEYS_AT_ONCE,
        help_text=f"The lock keys (1 to {MAX_KEYS_AT_ONCE}; duplicates count once).",
    )


def _max_wait() -> float:
    return min(float(app_settings.API_MAX_WAIT), float(app_settings.MAX_WAIT))


def _ttl_field(**kwargs: Any) -> StrictSecondsField:
    return StrictSecondsField(
        min_value=float(app_settings.MIN_TTL), max_value=float(app_settings.MAX_TTL), **kwargs
    )


def _ttl(value: float) -> float:
    if value <= 0:
        raise serializers.ValidationError("Must be more than 0 seconds.", code="min_value")
    return value


class LeaseProof(StrictSerializer):
    """The proof of a grant: its token and the lease_id only the acquirer was given."""

    token = _token_field(help_text="The grant's fencing token.")
    lease_id = StrictCharField(
        min_length=1, max_length=LEASE_ID_MAX_LENGTH, help_text="The secret from the acquire response."
    )


class RenewRequest(LeaseProof):
    """Body of a renew."""

    def get_fields(self) -> dict[str, serializers.Field[Any, Any, Any, Any]]:
        fields = super().get_fields()
        fields["ttl"] = _ttl_field(
            required=False, help_text="New lease length in seconds from now (default: DEFAULT_TTL)."
        )
        return fields

    def validate_ttl(self, value: float) -> float:
        return _ttl(value)


class ReleaseRequest(LeaseProof):
    """Body of a release."""


class DocumentWrite(LeaseProof):
    """Body of a fenced document write."""

    lock_key = StrictCharField(
        max_length=KEY_MAX_LENGTH, validators=[_key], help_text="The lock key whose grant writes."
    )
    step = _token_field(
        required=False,
        help_text="Numbers several writes under one token (1, 2, 3...); default 1.",
    )
    # The contract names this field "data"; DRF's metaclass moves declared fields off
    # the class, so it does not really shadow Serializer.data as mypy believes.
    data = serializers.JSONField(  # type: ignore[assignment]
        allow_null=True, help_text="Any JSON value.", validators=[_storable_json]
    )


class RejectionFilter(serializers.Serializer[Any]):
    """Query parameters of the rejection list (other parameters, like ``page``, pass)."""

    resource = serializers.CharField(
        required=False, max_length=KEY_MAX_LENGTH + 100, help_text="Exact resource name."
    )
    lock_key = serializers.CharField(required=False, max_length=KEY_MAX_LENGTH, help_text="Exact lock key.")
    since = serializers.DateTimeField(
        required=False, help_text="Only refusals at or after this time (ISO 8601)."
    )


# --- responses ---------------------------------------------------------------------


class GrantSerializer(serializers.ModelSerializer[Grant]):
    """A grant: a Grant row of the history, or the Lease renew and release return
    (both have these attributes; ``Grant.key`` is its lock's key)."""

    key = serializers.CharField()

    class Meta:
        model = Grant
        fields = [
            "key", "token", "mode", "holder", "acquired_at", "expires_at", "ended_at", "end_reason",
        ]

    def __init__(
        self, instance: Grant | Lease | QuerySet[Grant] | None = None, **kwargs: Any
    ) -> None:
        # A Lease has every field read here: it serializes as its Grant row would.
        super().__init__(cast(Any, instance), **kwargs)


class AcquiredGrantSerializer(GrantSerializer):
    lease_id = serializers.CharField(
        help_text="The secret that renew, release and fenced writes need. Returned only here."
    )

    class Meta(GrantSerializer.Meta):
        fields = ["key", "token", "mode", "lease_id", "holder", "acquired_at", "expires_at"]


class AcquiredPermitSerializer(AcquiredGrantSerializer):
    """A permit: the acquired lease of one slot's key (``<name>@<slot>``)."""

    slot = serializers.SerializerMethodField(help_text="The slot granted, 1 to limit.")

    class Meta(AcquiredGrantSerializer.Meta):
        fields = [*AcquiredGrantSerializer.Meta.fields, "slot"]

    def get_slot(self, permit: Lease) -> int:
        return permit_slot(permit)


class AcquiredSetSerializer(serializers.Serializer[Any]):
    """The grants of an all-or-none acquire, in sorted key order."""

    grants = AcquiredGrantSerializer(many=True)


class LockSerializer(serializers.ModelSerializer[Lock]):
    token = serializers.IntegerField(help_text="The last token issued for this key (0: never granted).")
    state = serializers.ChoiceField(choices=LockState.choices, help_text="By the database clock.")
    holder = serializers.SerializerMethodField()

    class Meta:
        model = Lock
        fields = ["key", "token", "state", "holder", "expires_at"]

    def get_holder(self, lock: Lock) -> str | None:
        return lock.holder or None


class FenceSerializer(serializers.ModelSerializer[Fence]):
    class Meta:
        model = Fence
        fields = ["resource", "lock_key", "token", "step", "updated_at"]


class DocumentSerializer(serializers.ModelSerializer[Document]):
    name = serializers.CharField(max_length=NAME_MAX_LENGTH)
    lock_key = serializers.CharField(source="fence.lock_key")
    token = serializers.IntegerField(source="fence.token")
    step = serializers.IntegerField(source="fence.step")

    class Meta:
        model = Document
        fields = ["name", "lock_key", "token", "step", "data", "updated_at"]


class RejectionSerializer(serializers.ModelSerializer[Rejection]):
    class Meta:
        model = Rejection
        fields = [
            "resource", "lock_key", "token", "step", "watermark_token", "watermark_step",
            "reason", "holder", "created_at",
        ]


class ErrorSerializer(serializers.Serializer[Any]):
    """Every refusal: a stable ``code``, a ``detail`` for people, and extra fields per code."""

    code = serializers.CharField()
    detail = serializers.CharField()

    def get_fields(self) -> dict[str, serializers.Field[Any, Any, Any, Any]]:
        fields = super().get_fields()
        # Declared here: as a class attribute it would shadow Serializer.errors for mypy.
        fields["errors"] = serializers.DictField(
            required=False,
            help_text="Messages per field (code 'invalid'): at most 20 fields, declared ones first.",
        )
        fields["errors_omitted"] = serializers.IntegerField(
            required=False, help_text="How many more fields had errors than `errors` lists."
        )
        return fields
