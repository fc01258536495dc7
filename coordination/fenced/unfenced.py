"""The audited escape hatch for saves of stale instances (operators, data migrations)."""

from __future__ import annotations

import getpass
import logging
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import NamedTuple

from ..exceptions import InvalidInput
from ..logfields import LogFields

# The resource side's documented logger, whichever of its modules logs.
logger = logging.getLogger("coordination.fencing")


class Override(NamedTuple):
    reason: str
    by: str


# The unfenced() block the current thread or task is in, if any.
active_override: ContextVar[Override | None] = ContextVar("coordination_unfenced", default=None)


@contextmanager
def unfenced(*, reason: str, by: str | None = None) -> Iterator[None]:
    """Let saves of stale FencedModel instances through, for operators and data migrations.

    By default a ``save()`` of an instance loaded before the row's watermark
    rose is refused (``StaleInstance``). Inside this block it writes the
    instance's values over the newer ones instead, and each save it lets
    through is audited: a WARNING on the ``coordination.fencing`` logger
    (resource, both watermarks, ``reason``, ``by``) and an
    :class:`~coordination.models.UnfencedSave` row, written in the same
    transaction as the save. Entering the block is logged at WARNING too.

    It never lowers a watermark: ``save()`` does not write it, and the
    database refuses any UPDATE that would, whatever runs it. It does not
    lift ``fence_strict`` either: such a model's rows are written under a
    grant only. Saves of instances that are not stale, inserts and other
    write paths behave as outside the block.

    ``reason`` says why (required, not blank); ``by`` who (default: the OS
    user, host and process id). Scoped to the current thread or asyncio task.
    """
    if not isinstance(reason, str) or not reason.strip():
        raise InvalidInput("unfenced() needs a reason: say why stale instances may be saved")
    who = by if by else _process_identity()
    logger.warning(
        "unfenced block entered %s", LogFields(reason=reason, by=who),
        extra={"coordination": {"event": "unfenced", "reason": reason, "by": who}},
    )
    token = active_override.set(Override(reason, who))
    try:
        yield
    finally:
        active_override.reset(token)


def _process_identity() -> str:
    try:
        user = getpass.getuser()
    except (OSError, KeyError):  # no name for the uid (a container's)
        user = f"uid {os.getuid()}"
    return f"{user}@{socket.gethostname()} pid {os.getpid()}"
