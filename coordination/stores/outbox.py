"""The outbox: external calls that cannot check a token, recorded under a fence and
sent by one relay with a stable idempotency key.

A payment API, a webhook, an email server takes no precondition: a paused
holder that wakes up would call it all the same. What can be fenced is the
*decision* to call: :func:`record_call` writes an :class:`OutboxCall` row in
a fenced transaction (:func:`coordination.fencing.fence`), so a stale holder
cannot even record the call. The relay (``manage.py coordination_relay``, one
leader among several machines by a fenced election) then sends each call and
moves it through its states::

    pending -> sending -> sent
                       -> pending (a retryable failure, until max_attempts)
                       -> failed  (a refusal, or max_attempts reached)
    sending, found by a new relay term (the last relay died mid-send):
              -> pending, resent with the same idempotency key (idempotent calls)
              -> needs_reconciliation (the others: an operator decides)

Every attempt carries the call's ``Idempotency-Key``, fixed when it was
recorded: a receiver that keeps the keys applies the call once, however often
the relay sends it. Every relay transition is a fenced write under the relay's
election term, so a deposed relay that wakes up cannot move a call.

:data:`call_state_changed` is sent (after commit) for each transition.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import secrets
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from typing import Any

from django.db import transaction
from django.db.models import Q
from django.dispatch import Signal
from django.utils import timezone

from .. import fencing
from ..conf import app_settings
from ..fenced.grants import resolve_grant
from ..leases import Lease
from ..models import OutboxCall, OutboxState

__all__ = [
    "IDEMPOTENCY_HEADER",
    "Relay",
    "SendOutcome",
    "call_state_changed",
    "mark_reconciled",
    "record_call",
    "retry_call",
    "send_http",
]

logger = logging.getLogger("coordination.outbox")

IDEMPOTENCY_HEADER = "Idempotency-Key"

call_state_changed = Signal()
"""``call_state_changed(sender=OutboxCall, call=..., previous=..., state=...)``, after commit."""

# Statuses a receiver may answer differently on a later attempt.
_RETRYABLE = {408, 409, 425, 429}


def record_call(
    target: str,
    payload: Any = None,
    *,
    resource: str | None = None,
    grant: Lease | None = None,
    kind: str = "http",
    method: str = "POST",
    headers: Mapping[str, str] | None = None,
    idempotent: bool = True,
    max_attempts: int = 5,
    using: str | None = None,
) -> OutboxCall:
    """Record a call for the relay to make, as a fenced write of ``resource`` (default:
    the grant's lock key) with ``grant`` (default: the current grant).

    Raises what :func:`coordination.fencing.fence` raises (``StaleToken`` for a
    stale holder: nothing is recorded). Inside the caller's transaction the record
    commits with it; the relay sends nothing before.
    """
    lease = resolve_grant(grant)
    alias = using or app_settings.DATABASE
    with fencing.fence(resource or lease.key, lease, using=alias) as fence:
        call = OutboxCall.objects.using(alias).create(
            kind=kind, target=target, method=method.upper(), headers=dict(headers or {}),
            payload=payload if payload is not None else {}, idempotent=idempotent,
            idempotency_key=secrets.token_hex(16), resource=fence.resource,
            lock_key=lease.key, token=lease.token, step=fence.step, max_attempts=max_attempts,
        )
        _announce(call, None, alias)
    return call


class SendOutcome:
    """What a sender saw: ``status`` (an HTTP status, or None: no answer) and an error text."""

    __slots__ = ("error", "status")

    def __init__(self, status: int | None, error: str = "") -> None:
        self.status = status
        self.error = error

    @property
    def delivered(self) -> bool:
        return self.status is not None and 200 <= self.status < 300

    @property
    def retryable(self) -> bool:
        return self.status is None or self.status >= 500 or self.status in _RETRYABLE


Sender = Callable[[OutboxCall], SendOutcome]


def send_http(call: OutboxCall, timeout: float = 10.0) -> SendOutcome:
    """Send an ``http`` call: its payload as JSON, its headers and its idempotency key."""
    body = json.dumps(call.payload).encode()
    request = urllib.request.Request(call.target, data=body, method=call.method)
    request.add_header("Content-Type", "application/json")
    for name, value in call.headers.items():
        request.add_header(name, value)
    request.add_header(IDEMPOTENCY_HEADER, call.idempotency_key)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return SendOutcome(response.status)
    except urllib.error.HTTPError as error:
        return SendOutcome(error.code, f"HTTP {error.code}")
    except (urllib.error.URLError, OSError) as error:
        return SendOutcome(None, str(error))


class Relay:
    """Sends recorded calls under a relay term: the lease of the relay's election.

    Every transition is a fenced write of the lease's key, so once a newer term
    has written, this relay's transitions raise ``StaleToken`` (and it must stop).
    """

    def __init__(
        self, lease: Lease, *, senders: Mapping[str, Sender] | None = None,
        retry_delay: float = 5.0, using: str | None = None,
    ) -> None:
        self.lease = lease
        self.senders: dict[str, Sender] = {"http": send_http, **(senders or {})}
        self.retry_delay = retry_delay
        self.using = using or app_settings.DATABASE

    def _calls(self) -> Any:
        return OutboxCall.objects.using(self.using)

    def _move(self, call: OutboxCall, previous: str, state: str, **fields: Any) -> bool:
        """One fenced transition of ``call`` from ``previous``; False if it was not there."""
        with fencing.fence(self.lease.key, self.lease, using=self.using):
            moved = self._calls().filter(pk=call.pk, state=previous).update(
                state=state, relay_term=self.lease.token, updated_at=timezone.now(), **fields
            )
            if moved:
                call.state = state
                for name, value in fields.items():
                    setattr(call, name, value)
                _announce(call, previous, self.using)
        return bool(moved)

    def recover(self) -> int:
        """Calls left in ``sending`` by an earlier term (its relay died between the send
        and its record): idempotent ones go back to ``pending``, to be sent again with
        the same key; the others need an operator. Returns how many were found.

        Run it first in each term: its fenced write raises the role's watermark to
        this term, so a deposed relay's transitions are refused from here on."""
        with fencing.fence(self.lease.key, self.lease, using=self.using):
            pass
        found = 0
        for call in self._calls().filter(state=OutboxState.SENDING).exclude(relay_term=self.lease.token):
            found += 1
            if call.idempotent:
                self._move(call, OutboxState.SENDING, OutboxState.PENDING,
                           last_error="the relay stopped during the send; resent with the same key")
            else:
                self._move(call, OutboxState.SENDING, OutboxState.NEEDS_RECONCILIATION,
                           last_error="the relay stopped during the send; it may have been made")
        return found

    def due(self, limit: int) -> list[OutboxCall]:
        now = timezone.now()
        return list(
            self._calls().filter(state=OutboxState.PENDING)
            .filter(Q(next_attempt_at__isnull=True) | Q(next_attempt_at__lte=now))
            .order_by("id")[:limit]
        )

    def run_once(self, limit: int = 100) -> int:
        """Send the due pending calls (at most ``limit``); returns how many were tried."""
        tried = 0
        for call in self.due(limit):
            if self.send(call):
                tried += 1
        return tried

    def send(self, call: OutboxCall) -> bool:
        """Claim ``call`` (pending -> sending), send it, record the outcome."""
        if not self._move(call, OutboxState.PENDING, OutboxState.SENDING, attempts=call.attempts + 1):
            return False
        sender = self.senders.get(call.kind)
        if sender is None:
            self._move(call, OutboxState.SENDING, OutboxState.FAILED,
                       last_error=f"no sender for kind {call.kind!r}")
            return True
        try:
            outcome = sender(call)
        except Exception as error:  # a sender's bug is the call's failure
            outcome = SendOutcome(None, f"{type(error).__name__}: {error}")
        if outcome.delivered:
            self._move(call, OutboxState.SENDING, OutboxState.SENT, response_status=outcome.status,
                       sent_at=timezone.now(), last_error="")
        elif outcome.retryable and call.attempts < call.max_attempts:
            delay = self.retry_delay * 2 ** (call.attempts - 1)
            self._move(call, OutboxState.SENDING, OutboxState.PENDING,
                       response_status=outcome.status, last_error=outcome.error,
                       next_attempt_at=timezone.now() + dt.timedelta(seconds=delay))
        else:
            self._move(call, OutboxState.SENDING, OutboxState.FAILED,
                       response_status=outcome.status, last_error=outcome.error)
        return True


def retry_call(call: OutboxCall, *, using: str | None = None) -> bool:
    """An operator's retry: a ``failed`` or ``needs_reconciliation`` call goes back to
    ``pending`` (with one more attempt allowed), sent with the same idempotency key."""
    alias = using or app_settings.DATABASE
    previous = call.state
    if previous not in (OutboxState.FAILED, OutboxState.NEEDS_RECONCILIATION):
        return False
    with transaction.atomic(using=alias):
        moved = OutboxCall.objects.using(alias).filter(pk=call.pk, state=previous).update(
            state=OutboxState.PENDING, next_attempt_at=None,
            max_attempts=max(call.max_attempts, call.attempts + 1), updated_at=timezone.now(),
        )
        if moved:
            call.state = OutboxState.PENDING
            _announce(call, previous, alias)
    return bool(moved)


def mark_reconciled(call: OutboxCall, note: str = "", *, using: str | None = None) -> bool:
    """An operator found that a ``needs_reconciliation`` (or ``failed``) call did take
    effect: it is recorded ``sent``, with ``note``, and never sent again."""
    alias = using or app_settings.DATABASE
    previous = call.state
    if previous not in (OutboxState.FAILED, OutboxState.NEEDS_RECONCILIATION):
        return False
    with transaction.atomic(using=alias):
        moved = OutboxCall.objects.using(alias).filter(pk=call.pk, state=previous).update(
            state=OutboxState.SENT, note=note or "marked reconciled", updated_at=timezone.now(),
        )
        if moved:
            call.state = OutboxState.SENT
            _announce(call, previous, alias)
    return bool(moved)


def _announce(call: OutboxCall, previous: str | None, using: str) -> None:
    state = call.state

    def send() -> None:
        logger.info("outbox call %s: %s -> %s", call.pk, previous or "new", state)
        call_state_changed.send(sender=OutboxCall, call=call, previous=previous, state=state)

    transaction.on_commit(send, using=using)
