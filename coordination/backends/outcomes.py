"""What the grant point's calls return: the grant an acquire made, the lease it
took over, how a release ended a lease."""

from __future__ import annotations

import datetime as dt
from typing import NamedTuple

from ..leases import Lease
from ..models import GrantEnd

__all__ = ["Acquired", "Ended", "TakenOver"]


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
