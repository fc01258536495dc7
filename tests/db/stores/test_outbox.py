"""The outbox in one process: recording under a fence, the relay's states, the operator."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from coordination import locks
from coordination.exceptions import StaleToken
from coordination.models import OutboxCall, OutboxState, Rejection
from coordination.stores.outbox import (
    Relay,
    SendOutcome,
    call_state_changed,
    mark_reconciled,
    record_call,
    retry_call,
)
from tests.support.outbox_receiver import Receiver, receiver

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def hook() -> Iterator[Receiver]:
    with receiver() as found:
        yield found


@pytest.fixture
def states() -> Iterator[list[tuple[int, str | None, str]]]:
    seen: list[tuple[int, str | None, str]] = []

    def record(sender: Any, call: OutboxCall, previous: str | None, state: str, **kwargs: Any) -> None:
        seen.append((call.pk, previous, state))

    call_state_changed.connect(record)
    yield seen
    call_state_changed.disconnect(record)


def relay_lease(holder: str = "relay") -> locks.Lease:
    return locks.acquire("election:coordination-relay", holder=holder, ttl=30)


def test_a_stale_holder_cannot_record_a_call(hook: Receiver) -> None:
    old = locks.acquire("payments:1", holder="A", ttl=0.5)
    locks.release(old)
    new = locks.acquire("payments:1", holder="B", ttl=30)
    record_call(hook.url, {"amount": 5}, grant=new)
    with pytest.raises(StaleToken):
        record_call(hook.url, {"amount": 5}, grant=old)
    assert OutboxCall.objects.count() == 1
    assert Rejection.objects.get().token == old.token


def test_relay_sends_each_call_with_its_key(hook: Receiver, states: list[Any]) -> None:
    grant = locks.acquire("payments:2", holder="task", ttl=30)
    calls = [record_call(hook.url, {"n": n}, grant=grant) for n in range(3)]
    assert Relay(relay_lease()).run_once() == 3
    assert hook.keys() == [call.idempotency_key for call in calls]
    for call in calls:
        call.refresh_from_db()
        assert (call.state, call.attempts, call.response_status) == (OutboxState.SENT, 1, 200)
    assert [state for _, _, state in states] == ["pending"] * 3 + ["sending", "sent"] * 3


def test_retryable_failure_then_failed_then_operator_retry(hook: Receiver) -> None:
    grant = locks.acquire("payments:3", holder="task", ttl=30)
    call = record_call(hook.url, {"n": 1}, grant=grant, max_attempts=2)
    relay = Relay(relay_lease(), retry_delay=0)
    hook.status = 503
    relay.run_once()
    call.refresh_from_db()
    assert (call.state, call.attempts) == (OutboxState.PENDING, 1)
    relay.run_once()
    call.refresh_from_db()
    assert (call.state, call.attempts, call.response_status) == (OutboxState.FAILED, 2, 503)
    assert retry_call(call)
    hook.status = 200
    relay.run_once()
    call.refresh_from_db()
    assert call.state == OutboxState.SENT
    assert set(hook.keys()) == {call.idempotency_key} and len(hook.keys()) == 3


def test_a_refusal_fails_at_once(hook: Receiver) -> None:
    call = record_call(hook.url, {}, grant=locks.acquire("payments:4", holder="t", ttl=30))
    hook.status = 422
    Relay(relay_lease(), retry_delay=0).run_once()
    call.refresh_from_db()
    assert (call.state, call.attempts) == (OutboxState.FAILED, 1)


def test_a_new_term_recovers_calls_left_in_sending(hook: Receiver) -> None:
    grant = locks.acquire("mail:1", holder="task", ttl=30)
    resent = record_call(hook.url, {"n": 1}, grant=grant)
    unsafe = record_call(hook.url, {"n": 2}, grant=grant, kind="email", idempotent=False)
    first = relay_lease("first")
    OutboxCall.objects.update(state=OutboxState.SENDING, relay_term=first.token)  # it died mid-send
    locks.release(first)
    relay = Relay(relay_lease("second"))
    assert relay.recover() == 2
    resent.refresh_from_db()
    unsafe.refresh_from_db()
    assert resent.state == OutboxState.PENDING
    assert unsafe.state == OutboxState.NEEDS_RECONCILIATION
    relay.run_once()
    assert hook.keys() == [resent.idempotency_key]
    assert mark_reconciled(unsafe, "the mail server's log has it")
    unsafe.refresh_from_db()
    assert (unsafe.state, unsafe.note) == (OutboxState.SENT, "the mail server's log has it")
    assert not retry_call(unsafe)  # sent is final


def test_a_deposed_relay_cannot_move_a_call(hook: Receiver) -> None:
    call = record_call(hook.url, {}, grant=locks.acquire("payments:5", holder="t", ttl=30))
    old = locks.acquire("election:coordination-relay", holder="old", ttl=0.3)
    old_relay = Relay(old)
    locks.release(old)
    new_relay = Relay(relay_lease("new"))
    new_relay.recover()  # the new term writes the role's fence
    with pytest.raises(StaleToken):
        old_relay.run_once()
    call.refresh_from_db()
    assert call.state == OutboxState.PENDING and hook.keys() == []


def test_a_custom_sender_and_an_unknown_kind(hook: Receiver) -> None:
    grant = locks.acquire("payments:6", holder="t", ttl=30)
    mail = record_call("mailto:ops@example.com", {"subject": "x"}, grant=grant, kind="email")
    other = record_call("x", {}, grant=grant, kind="sms")
    sent: list[str] = []

    def send_mail(call: OutboxCall) -> SendOutcome:
        sent.append(call.idempotency_key)
        return SendOutcome(250 - 50)

    Relay(relay_lease(), senders={"email": send_mail}).run_once()
    mail.refresh_from_db()
    other.refresh_from_db()
    assert (mail.state, sent) == (OutboxState.SENT, [mail.idempotency_key])
    assert other.state == OutboxState.FAILED and "no sender" in other.last_error
