"""The demo's Celery task: the seed's read-modify-write on an account, from a worker.

``coordination_demo`` sends it to two workers on their own queues and pauses the
first one with SIGSTOP; see that command. The task reports what it did as JSON
lines to ``report_to`` (a file the command reads), with database times.

With the same grant it then writes the run's other downstreams
(:mod:`project.demo.downstreams`): an S3 object and a Redis key where those
stores are configured, and an outbox call; each store checks the token itself.
"""

from __future__ import annotations

import json
import os
import time
from decimal import Decimal
from pathlib import Path
from typing import Any

from coordination import locks
from coordination.contrib.celery import fenced_task
from coordination.exceptions import CoordinationError

from .downstreams import Downstreams
from .models import Account

DEMO_QUEUE_PREFIX = "coordination-demo"  # each run adds its own id: concurrent demos never mix
# Long enough for B's whole task (acquire, read, write, release) on a loaded
# machine: a plain lease with no keep-alive must outlast its holder's work.
DEMO_TTL = 3.0


@fenced_task(lock="account:{account_id}", ttl=DEMO_TTL, keepalive=False, on_busy="raise", bind=True)
def deposit(
    self: Any,
    account_id: int,
    amount: str,
    *,
    worker: str,
    report_to: str,
    resume_file: str = "",
    fencing: bool = True,
    stores: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Read the balance, add ``amount``, write it back with this execution's token.

    Like the seed's client, it holds a plain lease (no keep-alive), so a pause
    longer than the lease lets another worker take the lock. If ``resume_file``
    is given it waits for that file after reading, which is where the demo
    pauses it. With ``fencing=False`` the write is a plain UPDATE. After the row,
    whatever its outcome, the same balance goes to every downstream of ``stores``
    (:class:`~project.demo.downstreams.Downstreams`) with the same grant.
    """
    grant = self.grant
    account = Account.objects.get(pk=account_id)
    _report(
        report_to, worker, "acquired", token=grant.token, pid=os.getpid(),
        expires_at=grant.expires_at.isoformat(), read=str(account.balance),
    )
    if resume_file:
        deadline = time.monotonic() + 120
        while not Path(resume_file).exists() and time.monotonic() < deadline:
            time.sleep(0.02)
    new_balance = account.balance + Decimal(amount)
    try:
        if fencing:
            Account.objects.filter(pk=account_id).fenced_update(balance=new_balance)
        else:
            Account.objects.filter(pk=account_id).update(balance=new_balance)
    except CoordinationError as refused:
        _report(
            report_to, worker, "rejected", token=grant.token, balance=str(new_balance),
            code=refused.code, detail=refused.detail,
        )
        result = {"written": False, "token": grant.token, "code": refused.code}
    else:
        _report(report_to, worker, "written", token=grant.token, balance=str(new_balance))
        result = {"written": True, "token": grant.token, "balance": str(new_balance)}
    outcomes = Downstreams(stores or {}, account_id).write_all(grant, str(new_balance), fencing=fencing)
    _report(report_to, worker, "downstreams", token=grant.token, balance=str(new_balance), stores=outcomes)
    return {**result, "downstreams": outcomes}


def _report(path: str, worker: str, event: str, **fields: Any) -> None:
    line = {"worker": worker, "event": event, "at": locks.database_now().isoformat(), **fields}
    with open(path, "a", encoding="utf-8") as out:
        out.write(json.dumps(line) + "\n")
