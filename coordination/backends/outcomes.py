"""What the grant point's calls return: the grant an acquire made, the lease it
took over, how a release ended a lease; and the record of the fenced execution
an acquire may write with its grant."""

from __future__ import annotations

import datetime as dt
from typing import NamedTuple

from ..leases import Lease
from ..models import HOLDER_MAX_LENGTH, GrantEnd

__all__ = ["Acquired", "Ended", "ExecutionRecord", "TakenOver"]


class TakenOver(NamedTuple):
    """The lease an acquire found expired and closed (unknown fields are None)."""

    token: int | None
    holder: str | None
    acquired_at: dt.datetime | None
    expired_at: dt.datetime | None


class Acquired(NamedTuple):
    """One granted acquire: the holder's lease, and the expired lease it took over."""

    lease: Lease
    taken_over: TakenOver | None


class Ended(NamedTuple):
    """How a release ended a lease. ``expired_at`` is set when the lease had run
    out before the release came (the release then freed the lock as expired)."""

    reason: GrantEnd
    ended_at: dt.datetime
    expired_at: dt.datetime | None


class ExecutionRecord(NamedTuple):
    """A fenced execution's record (an ``Execution`` row) without its grant: which
    task, which message and attempt, which worker. The grant (key, token, lease
    length) and the permit are added where the record is written."""

    task: str
    task_id: str
    attempt: int
    worker: str

    @classmethod
    def of(cls, task: str, task_id: str | None, attempt: int, worker: str) -> ExecutionRecord:
        """The record with each value cut to its column's length (and without NUL
        characters, which no text column takes)."""
        return cls(
            _text(task, 255), _text(task_id or "", 255), attempt, _text(worker, HOLDER_MAX_LENGTH)
        )


def _text(value: str, length: int) -> str:
    return (value.replace("\x00", "") if "\x00" in value else value)[:length]
