"""The rules of names and secrets: lock keys and key patterns, holders, tokens,
and how a lease's secret is stored. Below the models, which validate with them."""

from __future__ import annotations

import hashlib
import hmac
import re

from django.core.exceptions import ValidationError

from .exceptions import InvalidInput

KEY_MAX_LENGTH = 200
HOLDER_MAX_LENGTH = 200
MAX_TOKEN = 2**63 - 1
KEY_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@-]*")
KEY_RULE = (
    f"1 to {KEY_MAX_LENGTH} characters: letters, digits and . _ : @ -, "
    "starting with a letter or digit"
)


def validate_key(key: object, *, what: str = "key") -> str:
    """Return ``key`` if it is a valid lock key or resource name, else raise InvalidInput."""
    if not isinstance(key, str) or not key:
        raise InvalidInput(f"{what} must be a non-empty string ({KEY_RULE})")
    if len(key) > KEY_MAX_LENGTH:
        raise InvalidInput(f"{what} is {len(key)} characters long; at most {KEY_MAX_LENGTH}")
    if not KEY_PATTERN.fullmatch(key):
        raise InvalidInput(f"{what} {key!r} has forbidden characters ({KEY_RULE})")
    return key


PATTERN_WILDCARD = "*"
PATTERN_RULE = (
    "a lock key (that key only), a key's beginning followed by * (billing:* is every key "
    "starting with billing:), or * alone (every key); * only at the end"
)


def validate_key_pattern(pattern: object) -> str:
    """Return ``pattern`` if it is a valid access-rule key pattern, else raise InvalidInput.

    The syntax (docs/access-rules.md): an exact key, a prefix followed by ``*``,
    or ``*`` alone. The prefix follows the key rule; ``*`` appears only last.
    """
    if not isinstance(pattern, str) or not pattern:
        raise InvalidInput(f"a key pattern must be {PATTERN_RULE}")
    if pattern == PATTERN_WILDCARD:
        return pattern
    prefix = pattern.removesuffix(PATTERN_WILDCARD)
    if PATTERN_WILDCARD in prefix:
        raise InvalidInput(f"key pattern {pattern!r}: * may only end a pattern ({PATTERN_RULE})")
    if len(pattern) > KEY_MAX_LENGTH:
        raise InvalidInput(
            f"key pattern is {len(pattern)} characters long; at most {KEY_MAX_LENGTH}"
        )
    if not KEY_PATTERN.fullmatch(prefix):
        raise InvalidInput(
            f"key pattern {pattern!r} has forbidden characters: before the * it follows the "
            f"key rule ({KEY_RULE})"
        )
    return pattern


def key_matches(pattern: str, key: str) -> bool:
    """Whether ``key`` is one of the keys ``pattern`` names; case-sensitive, as keys are."""
    if pattern.endswith(PATTERN_WILDCARD):
        return key.startswith(pattern[:-1])
    return key == pattern


def validate_holder(holder: object) -> str:
    """Return ``holder`` if it is 1..200 printable characters, else raise InvalidInput."""
    if not isinstance(holder, str) or not holder.strip():
        raise InvalidInput("holder must be a non-empty string naming who takes the lock")
    if len(holder) > HOLDER_MAX_LENGTH:
        raise InvalidInput(f"holder is {len(holder)} characters long; at most 200")
    if not holder.isprintable():
        raise InvalidInput("holder must not contain control characters")
    return holder


def _key_field_validator(value: str) -> None:
    try:
        validate_key(value)
    except InvalidInput as error:
        raise ValidationError(str(error), code="invalid") from None


def _pattern_field_validator(value: str) -> None:
    try:
        validate_key_pattern(value)
    except InvalidInput as error:
        raise ValidationError(str(error), code="invalid") from None


def hash_lease_id(lease_id: str) -> str:
    """The stored form of a lease secret: only its SHA-256 is kept."""
    return hashlib.sha256(lease_id.encode()).hexdigest()


def lease_matches(lease_hash: str, lease_id: object) -> bool:
    """Whether ``lease_id`` is the secret behind ``lease_hash``, in constant time."""
    if not isinstance(lease_id, str) or not lease_hash:
        return False
    return hmac.compare_digest(lease_hash, hash_lease_id(lease_id))
