"""The outbox relay as a real process, killed between the send and its record.

The receiver holds the first request of a call unanswered; meanwhile the test
kills the relay with SIGKILL, so the call stays ``sending`` with the request
made. A second relay, elected once the first one's term has run out, resends it
with the same idempotency key: the receiver applies one effect per key.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from coordination import locks
from coordination.models import OutboxCall, OutboxState
from coordination.stores.outbox import record_call
from tests.support.celery_workers import REPO, worker_environment
from tests.support.outbox_receiver import receiver

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(180)]


def relay(candidate: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "django", "coordination_relay", "--once", "--ttl", "1",
         "--wait", "60", "--candidate", candidate],
        cwd=REPO, env=worker_environment(None), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True,
    )


def test_a_relay_killed_mid_send_resends_with_the_same_key() -> None:
    grant = locks.acquire("payouts:1", holder="task", ttl=60)
    with receiver() as hook:
        calls = [record_call(hook.url, {"payout": n}, grant=grant) for n in range(3)]
        hook.hold = True
        first = relay("first")
        try:
            assert hook.received.wait(60), first.stderr.read() if first.poll() is not None else "no request"
            os.killpg(first.pid, signal.SIGKILL)  # the request is made; its record is not
        finally:
            first.wait(30)
        hook.release.set()
        held = OutboxCall.objects.get(pk=calls[0].pk)
        assert held.state == OutboxState.SENDING
        hook.hold = False
        second = relay("second")
        out, err = second.communicate(timeout=120)
        assert second.returncode == 0, err
        assert "recovered 1 call(s)" in out
        states = dict(OutboxCall.objects.values_list("idempotency_key", "state"))
        assert set(states.values()) == {OutboxState.SENT}
        keys = [call.idempotency_key for call in calls]
        assert sorted(hook.effects) == sorted(keys)  # one effect per key
        assert hook.keys().count(keys[0]) == 2  # sent twice, with the same key
        assert all(hook.keys().count(key) == 1 for key in keys[1:])
