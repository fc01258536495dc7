"""The history of a chaos run: one JSON object per line.

Every operation is two events sharing an ``id``: ``invoke`` (written and flushed
before the call) and ``complete`` (after it, with ``outcome`` ``ok``, ``refused``
with a ``reason``, or ``unknown`` when the connection died mid-call). An
``invoke`` without a ``complete`` (the worker was killed) is unknown too.

Times: ``mono`` is ``time.monotonic()``, one system-wide clock on Linux, so it
orders events of different worker processes on one machine. Lease facts come
from the database clock (``acquired_at``, ``expires_at``, ``ended_at``,
``db_time``), as ISO 8601 strings.

Other event types: ``run`` (the configuration), ``fault`` (kind, target,
``mono``), ``observe`` (a counter or watermark sampled during the run),
``grant_row`` and ``final`` / ``stored`` (the database state read after the run).
"""

from __future__ import annotations

import datetime as dt
import json
import os
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO, Any

Event = dict[str, Any]

__all__ = ["Event", "HistoryWriter", "iso", "merge", "read_events"]


def iso(moment: dt.datetime | None) -> str | None:
    """A database timestamp as the history stores it."""
    return None if moment is None else moment.isoformat()


class HistoryWriter:
    """Appends events to one file, flushing each line.

    A flushed line is in the kernel's page cache, so it survives the writer
    being SIGKILLed: the history of a killed worker ends at its last invocation.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._file: IO[str] = open(self.path, "a", encoding="utf-8")  # noqa: SIM115

    def write(self, event: Event) -> Event:
        event.setdefault("mono", time.monotonic())
        self._file.write(json.dumps(event, separators=(",", ":"), default=str) + "\n")
        self._file.flush()
        return event

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> HistoryWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_events(path: str | os.PathLike[str]) -> Iterator[Event]:
    """The events of one history file; a line cut short by a kill is skipped."""
    with open(path, encoding="utf-8") as lines:
        for line in lines:
            line = line.strip()
            if not line:
                continue
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(event, dict):
                yield event


def merge(paths: Iterable[str | os.PathLike[str]], target: str | os.PathLike[str]) -> list[Event]:
    """Merge history files into ``target``, ordered by ``mono``; returns the events."""
    events = [event for path in paths for event in read_events(path)]
    events.sort(key=lambda event: float(event.get("mono", 0.0)))
    with open(target, "w", encoding="utf-8") as out:
        for event in events:
            out.write(json.dumps(event, separators=(",", ":"), default=str) + "\n")
    return events
