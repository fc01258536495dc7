"""The holder string of a fenced task's execution, written and read in one place.

A Celery (or ``django.tasks``) task holds its lock as
``app.tasks.deposit[<task id>]#<attempt> on <host>:<pid>``: the task id alone
is not a holder identity (retries and broker redeliveries share it), so the
attempt and the process tell the executions apart. :func:`task_holder` writes
it (``coordination.contrib.execution.holder_name``), :func:`parse_task_holder`
reads it back (the dashboard's lane labels). Nothing of the package is
imported here, so any layer may use it.
"""

from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass

__all__ = ["TaskHolder", "parse_task_holder", "task_holder", "this_process"]

# The inverse of task_holder(); the attempt is optional and the rest free, so a
# holder truncated to the column's length still reads.
_TASK_HOLDER = re.compile(
    r"^(?P<task>(?:[\w.]*\.)?[\w-]+)\[(?P<task_id>[^\]]*)\](?:#(?P<attempt>\d+))?(?P<rest>.*)$"
)


_this_process: tuple[int, str] = (0, "")


def this_process() -> str:
    """This process, as holders name it: ``<host>:<pid>`` (the host's name looked
    up once per process: a forked child, with a pid of its own, looks again)."""
    global _this_process
    pid = os.getpid()
    if _this_process[0] != pid:
        _this_process = (pid, f"{socket.gethostname()}:{pid}")
    return _this_process[1]


def task_holder(task_name: str, task_id: str | None, attempt: int, *, max_length: int) -> str:
    """The holder of one attempt of a task in this process, cut to ``max_length``
    characters (the last one then ``~``)."""
    name = f"{task_name}[{task_id or 'direct'}]#{attempt} on {this_process()}"
    if len(name) > max_length:
        name = name[: max_length - 1] + "~"
    return name


@dataclass(frozen=True)
class TaskHolder:
    """A task holder read back: the task's name, id and attempt, and the rest
    (``" on <host>:<pid>"``, as written or cut)."""

    task: str
    task_id: str
    attempt: int | None
    rest: str

    @property
    def short_name(self) -> str:
        """The task's name without its module path (``deposit``)."""
        return self.task.rpartition(".")[2]


def parse_task_holder(holder: str) -> TaskHolder | None:
    """``holder`` read as :func:`task_holder` writes it; None for any other holder."""
    match = _TASK_HOLDER.match(holder)
    if match is None:
        return None
    attempt = match["attempt"]
    return TaskHolder(
        task=match["task"], task_id=match["task_id"],
        attempt=int(attempt) if attempt is not None else None, rest=match["rest"],
    )
