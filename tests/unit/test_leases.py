"""The lease handle, the grant rule and the GRANT_POINT setting, without a database."""

from __future__ import annotations

import datetime as dt
import pickle
from typing import Any

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.test import override_settings

from coordination.backends import get_backend
from coordination.backends.base import LockSnapshot, grant_refusal, next_token
from coordination.checks import check_settings
from coordination.exceptions import LockHeld, TokenExhausted
from coordination.leases import Lease
from coordination.models import MAX_TOKEN

NOW = dt.datetime(2026, 1, 1, 12, 0, tzinfo=dt.UTC)


def a_lease(**changes: Any) -> Lease:
    values: dict[str, Any] = {
        "key": "account:7", "token": 41, "lease_id": "s3cret-proof", "holder": "worker-a",
        "acquired_at": NOW, "expires_at": NOW + dt.timedelta(seconds=10),
    }
    return Lease(**{**values, **changes})


def test_a_lease_numbers_its_steps_and_can_be_marked_lost() -> None:
    lease = a_lease()

    assert [lease.next_step(), lease.next_step(), lease.next_step()] == [1, 2, 3]
    assert not lease.lost
    lease.mark_lost()
    assert lease.lost


def test_a_lease_keeps_its_secret_out_of_its_repr_and_survives_pickling() -> None:
    lease = a_lease()
    lease.next_step()

    assert "s3cret-proof" not in repr(lease)
    assert "token=41" in repr(lease) and "holder='worker-a'" in repr(lease)
    copy = pickle.loads(pickle.dumps(lease))
    assert (copy.key, copy.token, copy.lease_id, copy.expires_at, copy.steps) == (
        "account:7", 41, "s3cret-proof", lease.expires_at, 1,
    )


def test_a_lease_keeps_its_mode_through_pickling_and_an_older_pickle_is_exclusive() -> None:
    reader = a_lease(mode="shared")
    reader.next_step()
    assert pickle.loads(pickle.dumps(reader)).mode == "shared"

    # A lease pickled before grants had modes: its state names no mode.
    _, slots = reader.__reduce_ex__(2)[2]
    del slots["mode"]
    revived = Lease.__new__(Lease)
    revived.__setstate__((None, slots))
    assert (revived.mode, revived.token, revived.steps, revived.lost) == ("exclusive", 41, 1, False)


def test_a_lease_is_a_handle_with_no_room_for_bolted_on_attributes() -> None:
    lease = a_lease()

    with pytest.raises(AttributeError):
        lease.taken_over = True  # type: ignore[attr-defined]
    assert lease != a_lease()  # two handles are two handles


def snapshot(**changes: Any) -> LockSnapshot:
    values: dict[str, Any] = {
        "key": "k", "token": 5, "holder": "", "lease_hash": "", "expires_at": None,
        "lock_delay": 0.0, "delay_until": None,
    }
    return LockSnapshot(**{**values, **changes})


def seconds(n: float) -> dt.datetime:
    return NOW + dt.timedelta(seconds=n)


@pytest.mark.parametrize(
    ("state", "ahead", "refused_with", "holder_says"),
    [
        (snapshot(), 0, None, None),
        (snapshot(holder="A", lease_hash="h", expires_at=seconds(5)), 0, LockHeld, "A"),
        (snapshot(holder="A", lease_hash="h", expires_at=seconds(-5)), 0, None, None),
        (snapshot(holder="A", lease_hash="h", expires_at=seconds(-5), lock_delay=10), 0, LockHeld,
         "A (lock-delay after expiry)"),
        (snapshot(holder="A", lease_hash="h", expires_at=seconds(-5), lock_delay=3), 0, None, None),
        (snapshot(delay_until=seconds(2)), 0, LockHeld, "lock-delay after an expired or revoked lease"),
        (snapshot(delay_until=seconds(-2)), 0, None, None),
        (snapshot(), 2, LockHeld, "2 fair waiter(s) queued first"),
        (snapshot(token=MAX_TOKEN - 1), 0, None, None),
        (snapshot(token=MAX_TOKEN), 0, TokenExhausted, None),
    ],
    ids=[
        "free", "held", "expired", "lock-delay-running", "lock-delay-over", "delay-until-running",
        "delay-until-over", "tickets-ahead", "last-token-left", "exhausted",
    ],
)
def test_the_grant_rule_says_when_and_why_a_lock_is_not_grantable(
    state: LockSnapshot, ahead: int, refused_with: type[Exception] | None, holder_says: str | None
) -> None:
    refusal = grant_refusal(state, NOW, ahead, 0)

    if refused_with is None:
        assert refusal is None
        return
    assert isinstance(refusal, refused_with)
    if isinstance(refusal, LockHeld):
        assert refusal.holder == holder_says
        assert refusal.retry_after > 0


def test_a_held_lock_says_until_when_and_how_long_to_wait() -> None:
    refusal = grant_refusal(snapshot(holder="A", lease_hash="h", expires_at=seconds(4)), NOW, 0, 0)

    assert isinstance(refusal, LockHeld)
    assert (refusal.expires_at, refusal.retry_after) == (seconds(4), 4.0)


@pytest.mark.parametrize(
    ("token", "floor", "issued"),
    [(0, 0, 1), (5, 0, 6), (5, 4, 6), (5, 5, 6), (5, 6, 7), (0, 1000, 1001), (MAX_TOKEN - 1, 0, MAX_TOKEN),
     (0, MAX_TOKEN - 1, MAX_TOKEN)],
    ids=["new-key", "no-floor", "floor-below", "floor-equal", "floor-above", "new-key-above-floor",
         "last-token", "last-token-of-the-floor"],
)
def test_the_next_token_is_above_the_counter_and_the_floor(token: int, floor: int, issued: int) -> None:
    state = snapshot(token=token)

    assert grant_refusal(state, NOW, 0, floor) is None
    assert next_token(state, floor) == issued


@pytest.mark.parametrize("token", [0, 5, MAX_TOKEN - 1, MAX_TOKEN])
def test_a_floor_at_the_largest_token_leaves_no_token_for_any_key(token: int) -> None:
    refusal = grant_refusal(snapshot(token=token), NOW, 0, MAX_TOKEN)

    assert isinstance(refusal, TokenExhausted)
    assert refusal.code == "token_exhausted"


def test_a_held_lock_is_held_whatever_the_floor() -> None:
    held = snapshot(holder="A", lease_hash="h", expires_at=seconds(4))

    assert isinstance(grant_refusal(held, NOW, 0, MAX_TOKEN), LockHeld)


@pytest.mark.parametrize("value", [None, "auto", "orm"])
def test_grant_point_values_pass_the_check(value: str | None) -> None:
    with override_settings(COORDINATION={"GRANT_POINT": value}):
        assert check_settings() == []


def test_an_unknown_grant_point_is_a_system_check_error_and_refused_at_use() -> None:
    with override_settings(COORDINATION={"GRANT_POINT": "functions"}):
        assert [message.id for message in check_settings()] == ["coordination.E005"]
        with pytest.raises(ImproperlyConfigured, match="GRANT_POINT"):
            get_backend()


def test_the_backend_is_chosen_once_per_alias_and_again_when_settings_change() -> None:
    first = get_backend()
    assert get_backend("default") is first
    with override_settings(COORDINATION={"GRANT_POINT": "orm"}):
        portable = get_backend()
        assert portable is not first
        assert portable.name in {"orm", "sqlite"}
    assert get_backend() is not portable
