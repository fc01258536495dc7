"""The lease a holder keeps: what :func:`coordination.locks.acquire` returns.

A :class:`Lease` is a small value the caller holds, apart from the
:class:`~coordination.models.Grant` row that records the same grant in the
audit history. It carries the proof of the grant (``key``, ``token`` and the
secret ``lease_id``), what the holder knows about its lease (``expires_at``,
moved by ``renew``; ``ended_at`` and ``end_reason`` once released) and two
pieces of client state the fences use: the ``lost`` flag and the counter that
numbers the holder's writes under its token.
"""

from __future__ import annotations

import contextvars
import datetime as dt
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Lease", "current_grant", "use_grant"]


@dataclass(slots=True, eq=False, kw_only=True)
class Lease:
    """A granted lease, as its holder keeps it.

    - ``key``, ``token``, ``holder``, ``acquired_at``: fixed by the grant.
    - ``lease_id``: the secret that proves the grant to ``renew``, ``release``
      and the REST fences; only its hash is stored, and ``repr()`` never
      shows it.
    - ``expires_at``: the end of the lease in database time, moved by
      ``locks.renew``.
    - ``ended_at``, ``end_reason``: set by ``locks.release`` (``"released"``,
      or ``"expired"`` when the lease ran out before the release).
    - ``lost``: set by :meth:`mark_lost` (a failed renewal); fenced writes with
      a lost lease are refused with ``LeaseLost`` before they apply.
    - ``mode``: ``"exclusive"`` (every plain grant: a writer) or ``"shared"``
      (a reader, :mod:`coordination.shared`); the Grant row records it too.

    A handle, not a row: two Lease objects are equal only if they are the same
    object. It pickles (for task arguments and result backends).
    """

    key: str
    token: int
    lease_id: str = field(repr=False)
    holder: str
    acquired_at: dt.datetime
    expires_at: dt.datetime
    ended_at: dt.datetime | None = None
    end_reason: str = ""
    lost: bool = False
    steps: int = field(default=0, repr=False)
    """The last step number :meth:`next_step` handed out (0: none yet)."""
    mode: str = "exclusive"

    def __setstate__(self, state: tuple[None, dict[str, Any]]) -> None:
        # Pickled by slot name (Python's default for a class with __slots__). A
        # lease pickled before grants had modes (a task message an older version
        # sent) has no "mode": it was exclusive.
        _, slots = state
        for name, value in {"mode": "exclusive", **slots}.items():
            object.__setattr__(self, name, value)

    def next_step(self) -> int:
        """Number the next fenced write made under this lease: 1, 2, 3...

        Steps only need to increase within one token, so one counter serves every
        resource the holder writes to.
        """
        self.steps += 1
        return self.steps

    def mark_lost(self) -> None:
        """Make later fenced writes with this lease fail with LeaseLost before applying."""
        self.lost = True


# The lease fenced writes use when none is passed: one per execution (thread or
# asyncio task), set by hold(), ahold(), use_grant() and a fenced task.
_current_grant: contextvars.ContextVar[Lease | None] = contextvars.ContextVar(
    "coordination_current_grant", default=None
)


def current_grant() -> Lease | None:
    """The lease of the enclosing ``hold()``, ``use_grant()`` or fenced task, if any."""
    return _current_grant.get()


@contextmanager
def use_grant(grant: Lease) -> Iterator[Lease]:
    """Make ``grant`` the lease fenced writes use when none is passed, within the block."""
    reset = _current_grant.set(grant)
    try:
        yield grant
    finally:
        _current_grant.reset(reset)
