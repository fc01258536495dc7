"""Prove in your own test suite that a task is fenced: a pytest plugin.

Opt in from your ``conftest.py`` (it is never loaded on its own, so it cannot
change a test suite that did not ask for it)::

    pytest_plugins = ["coordination.testing"]

and race two runs of a task over one lock::

    def test_settle_is_fenced(fencing_race):
        account = Account.objects.create(balance=10)
        race = fencing_race(settle, args=(account.pk, "5.00"))
        race.assert_fenced()

``fencing_race`` runs the task as holder A on a thread of its own and pauses
it just before its first write under the grant (or where ``pause_at`` says);
ends A's lease, as a long pause would (``end_lease="revoke"``, at once; or
``"expire"``, waiting for the lease to run out by the database clock); runs
the task again as holder B, to its end; then resumes A. The returned
:class:`RaceReport` says which writes each holder made after the pause, which
the database accepted (rows changed) and which were refused, and how each run
ended. ``assert_fenced()`` fails when A's late writes were accepted: a task
that writes with a plain ``update()`` fails it, the same task with
``fenced_update()`` passes (rule 2 of docs/rules.md).

The task may be a Celery task (run in this process with ``task.apply()``), a
``django.tasks`` task (``task.call()``) or any function that takes its own
grant (``coordination.contrib`` fenced tasks, ``locks.hold``). Its body must
be synchronous: the pause is taken on the thread that runs it, before a
statement on that thread's database connection. The fixture uses
pytest-django's ``transactional_db`` (the two holders use connections of
their own, which must see each other's commits).
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import pytest
from django.apps import apps
from django.db import connections

from . import locks
from .conf import app_settings
from .leases import Lease

__all__ = ["HolderRun", "RaceReport", "Write", "fencing_race", "run_fencing_race"]

_WRITE = re.compile(
    r'^\s*(?:UPDATE|INSERT\s+(?:OR\s+\w+\s+|IGNORE\s+)?INTO|DELETE\s+FROM|REPLACE\s+INTO)\s+["`]?([\w.]+)["`]?',
    re.IGNORECASE,
)
_LOCKING = re.compile(r"^\s*BEGIN\b|\bFOR\s+(?:NO\s+KEY\s+)?UPDATE\b", re.IGNORECASE)
_GRANT_POINT_MODELS = ("Lock", "Grant", "Ticket", "TokenFloor")

PausePoint = Callable[[str], bool] | str | None


@dataclass(frozen=True)
class Write:
    """One write statement a holder made to your tables: accepted when it changed rows."""

    table: str
    sql: str
    rows: int
    error: str = ""

    @property
    def accepted(self) -> bool:
        return not self.error and self.rows > 0

    def __str__(self) -> str:
        outcome = f"{self.rows} row(s)" if not self.error else f"failed: {self.error}"
        return f"{self.sql[:160]} ({outcome})"


@dataclass
class HolderRun:
    """How one holder's run went: its grant, writes, result or error."""

    name: str
    grant: Lease | None = None
    paused: bool = False
    result: Any = None
    error: BaseException | None = None
    writes: list[Write] = field(default_factory=list)
    """Writes to your tables (not the app's own) made after the pause; for B, all of them."""

    @property
    def accepted(self) -> list[Write]:
        return [write for write in self.writes if write.accepted]

    @property
    def refused(self) -> list[Write]:
        return [write for write in self.writes if not write.accepted]

    @property
    def token(self) -> int | None:
        return self.grant.token if self.grant else None

    def describe(self) -> str:
        ending = f"raised {self.error!r}" if self.error is not None else f"returned {self.result!r}"
        lines = [f"holder {self.name} (token {self.token}) {ending}"]
        lines += [f"  {'accepted' if w.accepted else 'refused '}: {w}" for w in self.writes]
        return "\n".join(lines)


@dataclass
class RaceReport:
    """What happened when A was paused past its lease and B ran meanwhile."""

    a: HolderRun
    b: HolderRun

    def assert_fenced(self) -> None:
        """Fail unless B's writes were accepted and A's late writes were all refused."""
        if not self.a.paused:
            raise AssertionError(
                f"holder A never reached the pause point, so nothing was raced.\n{self.a.describe()}"
            )
        if self.b.error is not None or not self.b.accepted:
            raise AssertionError(
                "holder B, the new holder, must run to its end and write for the race to prove "
                f"anything.\n{self.b.describe()}"
            )
        if self.a.accepted:
            raise AssertionError(
                "holder A resumed after its lease had ended and holder B had written, and "
                "the database accepted A's late write(s): the task is not fenced. Write with "
                "fenced_update(), fenced_save() or fence() so that the resource refuses A's "
                f"stale token.\n{self.a.describe()}\n{self.b.describe()}"
            )

    def __str__(self) -> str:
        return f"{self.a.describe()}\n{self.b.describe()}"


class _Holder:
    """Runs one holder's call on a thread with its own connection, recording its
    writes and, for A, pausing before the chosen statement."""

    def __init__(
        self, run: HolderRun, call: Callable[[], Any], pause_at: Callable[[str], bool] | None,
        alias: str, timeout: float,
    ) -> None:
        self.run, self.call, self.pause_at, self.alias, self.timeout = run, call, pause_at, alias, timeout
        self.paused = threading.Event()
        self.resume = threading.Event()
        self.done = threading.Event()
        self.recording = pause_at is None
        self.thread = threading.Thread(target=self._main, name=f"fencing-race-{run.name}", daemon=True)

    def _wrapper(
        self, execute: Callable[..., Any], sql: str, params: Any, many: bool, context: Mapping[str, Any]
    ) -> Any:
        if (
            self.pause_at is not None and not self.run.paused
            and locks.current_grant() is not None and self.pause_at(sql)
        ):
            self.run.paused = True
            self.run.grant = locks.current_grant()
            self.paused.set()
            if not self.resume.wait(self.timeout):
                raise TimeoutError("fencing_race: holder A was never resumed")
            self.recording = True
        if self.run.grant is None and locks.current_grant() is not None:
            self.run.grant = locks.current_grant()
        match = _WRITE.match(sql)
        if not (self.recording and match and match.group(1) not in _app_tables()):
            return execute(sql, params, many, context)
        try:
            result = execute(sql, params, many, context)
        except Exception as error:
            self.run.writes.append(Write(match.group(1), sql, 0, f"{type(error).__name__}: {error}"))
            raise
        self.run.writes.append(Write(match.group(1), sql, max(context["cursor"].rowcount, 0)))
        return result

    def _main(self) -> None:
        connection = connections[self.alias]
        try:
            with connection.execute_wrapper(self._wrapper):
                self.run.result = self.call()
        except BaseException as error:
            self.run.error = error
        finally:
            connections.close_all()
            self.done.set()
            self.paused.set()  # a run that ended without pausing wakes the controller too

    def start(self) -> None:
        self.thread.start()

    def join(self) -> None:
        if not self.done.wait(self.timeout):
            raise AssertionError(f"fencing_race: holder {self.run.name} did not finish in {self.timeout} s")
        self.thread.join(self.timeout)


_tables: frozenset[str] | None = None


def _app_tables() -> frozenset[str]:
    """The tables of the coordination app: its writes are not the task's."""
    global _tables
    if _tables is None:
        _tables = frozenset(
            model._meta.db_table for model in apps.get_app_config("coordination").get_models()
        )
    return _tables


def _grant_point_tables() -> frozenset[str]:
    config = apps.get_app_config("coordination")
    return frozenset(config.get_model(name)._meta.db_table for name in _GRANT_POINT_MODELS)


def _pause_rule(pause_at: PausePoint) -> Callable[[str], bool]:
    if callable(pause_at):
        return pause_at
    if isinstance(pause_at, str):
        needle = pause_at.lower()
        return lambda sql: needle in sql.lower()
    grant_point = _grant_point_tables()

    def first_write(sql: str) -> bool:
        # Before the first write, or before a statement that would take locks (a
        # transaction's BEGIN on SQLite, SELECT ... FOR UPDATE), so that the paused
        # holder holds no lock that would stop the other one.
        match = _WRITE.match(sql)
        if match is not None:
            return match.group(1) not in grant_point
        return bool(_LOCKING.search(sql))

    return first_write


def _caller(task: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Callable[[], Any]:
    if hasattr(task, "apply") and hasattr(task, "delay"):  # a Celery task
        def celery() -> Any:
            outcome = task.apply(args=tuple(args), kwargs=dict(kwargs))
            return outcome.get(propagate=True, disable_sync_subtasks=False)

        return celery
    if hasattr(task, "call") and hasattr(task, "enqueue"):  # a django.tasks Task
        return lambda: task.call(*args, **kwargs)
    if callable(task):
        return lambda: task(*args, **kwargs)
    raise TypeError(f"fencing_race needs a Celery task, a django.tasks task or a function, not {task!r}")


def run_fencing_race(
    task: Any,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    *,
    b_args: Sequence[Any] | None = None,
    b_kwargs: Mapping[str, Any] | None = None,
    pause_at: PausePoint = None,
    end_lease: Literal["revoke", "expire"] = "revoke",
    timeout: float = 60.0,
    using: str | None = None,
) -> RaceReport:
    """Race two runs of ``task`` over its lock: A paused past its lease, B meanwhile.

    ``args``/``kwargs`` are A's (and B's, unless ``b_args``/``b_kwargs`` are
    given). ``pause_at``: None (before A's first write to a table outside the
    grant point's own, or a statement that takes locks, made under its grant),
    a substring of the SQL to pause before, or a predicate over the SQL.
    ``end_lease``: ``"revoke"`` ends A's lease at once, as an operator's
    take-over does; ``"expire"`` waits until it expires by the database clock
    (for tasks without a keep-alive: a keep-alive thread, unlike a paused
    process, would keep renewing it). Each step waits at most ``timeout``
    seconds.
    """
    alias = using or app_settings.DATABASE
    b_args = args if b_args is None else b_args
    b_kwargs = (kwargs or {}) if b_kwargs is None else b_kwargs
    report = RaceReport(HolderRun("A"), HolderRun("B"))
    a = _Holder(report.a, _caller(task, args, kwargs or {}), _pause_rule(pause_at), alias, timeout)
    a.start()
    try:
        if not a.paused.wait(timeout):
            raise AssertionError(f"fencing_race: holder A neither paused nor finished in {timeout} s")
        if report.a.paused:
            grant = report.a.grant
            assert grant is not None
            if end_lease == "revoke":
                locks.revoke(grant.key, using=alias)
            else:
                _wait_for_expiry(grant, alias, timeout)
            b = _Holder(report.b, _caller(task, b_args, b_kwargs), None, alias, timeout)
            b.start()
            b.join()
    finally:
        a.resume.set()
        a.join()
    return report


def _wait_for_expiry(grant: Lease, alias: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while locks.database_now(alias) <= grant.expires_at:
        if time.monotonic() > deadline:
            raise AssertionError(f"fencing_race: A's lease never expired within {timeout} s")
        time.sleep(0.02)


@pytest.fixture
def fencing_race(transactional_db: None) -> Iterator[Callable[..., RaceReport]]:
    """:func:`run_fencing_race`, on a transactional test database."""
    yield run_fencing_race
