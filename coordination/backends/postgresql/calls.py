"""The grant point's prepared calls, sent on the connection's libpq handle.

Every acquire and release is one call of a prepared statement with a handful
of plain values. psycopg's ``Cursor.execute`` serves any query: it converts
the ``%s`` placeholders, looks the query up in its prepared-statement cache,
picks a dumper per value, and keeps the cache in order afterwards. For two
statements whose shape never changes that was about 50 µs of the 195 µs of
client CPU an acquire + release cost (``docs/performance.md``). This
module does the same work once per connection and statement, and then sends
each call as libpq's ``PQsendQueryPrepared`` with the values in text form:

- The statement is prepared under a name derived from its text
  (``coordination_<hash>``), on its second execution on a connection, as
  ``COORDINATION["PREPARED_STATEMENTS"]`` promises: a connection that runs it
  once prepares nothing. The server infers the parameters' types from the
  function's signature.
- Results load with the cursor's own loaders (the same values the cursor
  returns), and errors are psycopg's, raised from the result as the cursor
  raises them: the caller's handling (Django's error wrapping, a lost
  prepared statement behind a pooling proxy) is unchanged.
- Only calls in autocommit (each its own transaction, as acquire and release
  are) go this way: in a transaction, psycopg sends the ``BEGIN`` before the
  first statement, so those go through the cursor. So do values other than
  ``None``, ``bool``, ``int``, ``float`` and ``str``, a string with a NUL, a
  connection in pipeline mode, and every call when psycopg lacks these
  interfaces (:data:`DIRECT` is False then).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any
from weakref import WeakKeyDictionary

try:
    from psycopg import errors as _errors
    from psycopg import pq as _pq
    from psycopg.adapt import Transformer as _Transformer
    from psycopg.generators import execute as _execute
except ImportError:  # pragma: no cover - no psycopg, or one without these interfaces
    DIRECT = False
else:
    DIRECT = all(
        hasattr(thing, name) for thing, name in (
            (_errors, "error_from_result"), (_Transformer, "from_context"),
            (_Transformer, "load_row"), (_pq.PGconn, "send_query_prepared"),
        )
    )

__all__ = ["DIRECT", "PreparedCalls", "statement_name"]

if DIRECT:
    _TUPLES_OK = _pq.ExecStatus.TUPLES_OK
    _OK = (_pq.ExecStatus.COMMAND_OK, _TUPLES_OK)

_NAMES: dict[str, bytes] = {}


def statement_name(sql: str) -> bytes:
    """The prepared statement's name: the same text always gets the same name,
    and a changed text (another version of the app) a different one."""
    name = _NAMES.get(sql)
    if name is None:
        digest = hashlib.sha256(sql.encode()).hexdigest()[:16]
        name = _NAMES[sql] = f"coordination_{digest}".encode()
    return name


def text_values(params: Sequence[object], encoding: str) -> list[bytes | None] | None:
    """``params`` in PostgreSQL's text form, or None if one needs the cursor's dumpers."""
    values: list[bytes | None] = []
    for value in params:
        kind = type(value)
        if value is None:
            values.append(None)
        elif kind is bool:
            values.append(b"t" if value else b"f")
        elif kind is str:
            if "\x00" in value:  # type: ignore[operator]
                return None  # the cursor's dumper says what is wrong with it
            values.append(value.encode(encoding))  # type: ignore[attr-defined]
        elif kind is int:
            values.append(str(value).encode())
        elif kind is float:
            values.append(repr(value).encode())  # repr round-trips a float
        else:
            return None
    return values


class PreparedCalls:
    """One connection's prepared statements and the transformer that loads their rows.

    Kept per psycopg connection (:meth:`of`) and dropped with it. Every method
    runs on the thread that owns the connection, as Django's connections do.
    """

    _of: WeakKeyDictionary[Any, PreparedCalls] = WeakKeyDictionary()

    def __init__(self, cursor: Any) -> None:
        raw = cursor.connection
        self.raw = raw
        self.cursor = cursor
        self.encoding = raw.info.encoding
        self.transformer = _Transformer.from_context(cursor)
        self.seen: set[str] = set()
        self.prepared: dict[str, bytes] = {}

    @classmethod
    def of(cls, cursor: Any) -> PreparedCalls:
        """The calls of ``cursor``'s connection, their rows loaded as ``cursor`` loads
        them. What the server has prepared belongs to the psycopg connection, which
        outlives Django's connection objects in a pool: it is kept when the cursor
        changes."""
        calls = cls._of.get(cursor.connection)
        if calls is None:
            calls = cls._of[cursor.connection] = cls(cursor)
        elif calls.cursor is not cursor:
            calls.cursor = cursor
            calls.transformer = _Transformer.from_context(cursor)
        return calls

    def run(self, sql: str, params: Sequence[object]) -> tuple[Any, ...] | None:
        """Run ``sql`` (``%s`` placeholders) with ``params``, preparing it from its
        second execution on this connection; its first row, or None.

        Raises psycopg's error for a statement the server refused, as the
        cursor would.
        """
        raw = self.raw
        values = text_values(params, self.encoding)
        name = self.prepared.get(sql)
        if (
            values is None
            or not raw.autocommit  # psycopg opens the transaction before a statement
            or getattr(raw, "_pipeline", None) is not None
            or (name is None and sql not in self.seen)
        ):
            # The first execution, values only the cursor can send, a statement
            # of a transaction: as psycopg sends any statement.
            self.seen.add(sql)
            self.cursor.execute(sql, params, prepare=False)
            return self.cursor.fetchone()  # type: ignore[no-any-return]
        pgconn = raw.pgconn
        with raw.lock:
            if name is None:
                name = statement_name(sql)
                pgconn.send_prepare(name, _placeholders(sql).encode(self.encoding))
                self._check(raw.wait(_execute(pgconn)))
                self.prepared[sql] = name
            pgconn.send_query_prepared(name, values)
            result = self._check(raw.wait(_execute(pgconn)))
        if result.status != _TUPLES_OK or not result.ntuples:
            return None
        transformer = self.transformer
        transformer.set_pgresult(result)
        return transformer.load_row(0, tuple)

    def _check(self, results: list[Any]) -> Any:
        result = results[-1]
        if result.status not in _OK:
            if result.status == _pq.ExecStatus.FATAL_ERROR:
                raise _errors.error_from_result(result, encoding=self.encoding)
            raise _errors.InterfaceError(
                f"unexpected result of the grant point's call: {_pq.ExecStatus(result.status).name}"
            )
        return result


def _placeholders(sql: str) -> str:
    """``%s`` placeholders as PostgreSQL's ``$1, $2, ...`` (the app's SQL has no
    other ``%``)."""
    parts = sql.split("%s")
    return "".join(
        part + (f"${index}" if index < len(parts) else "")
        for index, part in enumerate(parts, start=1)
    )
