"""Access rules without a database: the key pattern syntax, matching, the mode setting's check."""

from __future__ import annotations

import pytest
from django.test import override_settings

from coordination import checks
from coordination.access import UNRESTRICTED, Access
from coordination.exceptions import InvalidInput, KeyForbidden
from coordination.models import key_matches, validate_key_pattern


@pytest.mark.parametrize("pattern", ["*", "billing:*", "billing:7", "b*", "a.b_c@d-e:*", "x" * 200])
def test_valid_patterns_are_kept_as_written(pattern: str) -> None:
    assert validate_key_pattern(pattern) == pattern


@pytest.mark.parametrize(
    "pattern",
    [
        "", None, 7, ["billing:*"],
        "**", "billing:**", "*billing", "bil*ling:", "billing:*:7",  # * only once, only last
        ":billing*", "-x", "billing 7", "billing/7", "billing%", "billing?", "bílling:*",
        "x" * 201,
    ],
)
def test_invalid_patterns_are_refused(pattern: object) -> None:
    with pytest.raises(InvalidInput):
        validate_key_pattern(pattern)


@pytest.mark.parametrize(
    ("pattern", "key", "matches"),
    [
        ("billing:*", "billing:7", True),
        ("billing:*", "billing:", True),
        ("billing:*", "billing", False),
        ("billing:*", "billing-archive:7", False),
        ("billing:*", "Billing:7", False),  # keys are case-sensitive, and so are patterns
        ("billing:*", "account:1", False),
        ("billing:7", "billing:7", True),
        ("billing:7", "billing:70", False),
        ("*", "anything:at-all", True),
    ],
)
def test_a_pattern_names_its_key_or_its_prefix(pattern: str, key: str, matches: bool) -> None:
    assert key_matches(pattern, key) is matches


BILLING = Access({"acquire": ("billing:*",), "write": ("billing:*",), "read": ("billing:*", "shared:1"),
                  "revoke": ()})


def test_access_allows_each_action_only_on_its_own_patterns() -> None:
    assert BILLING.allows("acquire", "billing:1")
    assert not BILLING.allows("acquire", "shared:1")
    assert BILLING.allows("read", "shared:1")
    assert not BILLING.allows("revoke", "billing:1")
    assert not BILLING.allows("write", "account:1")
    assert UNRESTRICTED.allows("revoke", "account:1") and not UNRESTRICTED.limited
    assert BILLING.limited


def test_a_refusal_names_the_action_and_the_key() -> None:
    with pytest.raises(KeyForbidden) as refused:
        BILLING.require("acquire", "account:1")
    assert refused.value.as_dict() == {
        "code": "key_forbidden", "detail": refused.value.detail, "action": "acquire", "key": "account:1",
    }
    assert refused.value.status_code == 403
    BILLING.require("acquire", "billing:9")  # allowed: no error


def test_an_unknown_action_is_a_programming_error() -> None:
    with pytest.raises(ValueError, match="unknown access action"):
        BILLING.allows("delete", "billing:1")


@pytest.mark.parametrize("mode", ["auto", "enforce", "off"])
def test_the_known_modes_pass_the_check(mode: str) -> None:
    with override_settings(COORDINATION={"ACCESS_RULES": mode}):
        assert checks.check_access_rules() == []


@pytest.mark.parametrize("mode", ["on", "", None, True, "AUTO"])
def test_an_unknown_mode_is_error_e030(mode: object) -> None:
    with override_settings(COORDINATION={"ACCESS_RULES": mode}):
        (error,) = checks.check_access_rules()
    assert error.id == "coordination.E030" and "docs/access-rules.md" in str(error.hint)
