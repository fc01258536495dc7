"""The fenced UPDATE of the common shapes, without the cost of building it per write.

What this module sends is, to the character and parameter, what the one write
path ``rows.filter(Admits(token, step), **binding).update(fence=token,
fence_step=step, **values)`` compiles to; it only skips the work that does not
change from one write of a shape to the next: the queryset clone of
``filter()``, the resolving of the binding's field names, the clone into an
UPDATE query and the compiling of its SET list. That work was about 0.3 ms of
Python per write, two to three times a plain ``update()``.

A shape (model, database, fields set, the lock key's field names) is compiled
once by Django, through that public path: its SET list, the watermark
condition's SQL and the binding's resolved columns are kept. Each write then
has Django compile its WHERE, the caller's conditions followed by the
watermark condition and the binding's lookups, in the one AND node that
``filter()`` would have made of them, so Django's ``WhereNode`` joins and
parenthesises them as it would. A write this module does not cover (joins, a
slice, ordering, annotations, a multi-table child, expressions, model instances
or None as values, a custom placeholder, a key that does not fit its field, a
filter that matches nothing) gets None, and goes through the public path.
``tests/db/test_fenced_statement.py`` compares both, shape by shape, on each
database and Django this app supports.

Private parts of Django used here, and why:

- ``QuerySet._db`` and ``QuerySet._hints``: the write alias, chosen as
  ``update()`` chooses it (``router.db_for_write``).
- ``Query.alias_map``, ``is_sliced``, ``combinator``, ``distinct_fields``,
  ``annotations``, ``order_by``, ``extra`` and ``Query.where`` (its
  ``connector``, ``negated`` and ``children``): to tell a covered shape from
  one that ``update()`` compiles differently (a subquery, an ORDER BY), and to
  take the caller's conditions as ``filter()`` would extend them.
- ``WhereNode`` and ``AND`` (``django.db.models.sql.where``): the node that
  joins the caller's conditions and the fenced ones.
- ``UpdateQuery`` and ``Query.chain()``, ``add_update_values()``: to compile a
  shape's SET list once, as ``update()`` does.
- ``Query.get_compiler()`` and ``SQLCompiler.compile()`` / ``as_sql()``: to
  compile each write's WHERE, and a shape once.
- ``Lookup.lhs`` of the binding's lookups (a ``Col``), ``BuiltinLookup``'s
  ``process_rhs()`` and ``get_rhs_op()``: a binding term is compiled once as
  ``column operator placeholder``; each write builds the lookup of its key's
  value with the lookup's own class and has it prepare that value
  (``process_rhs``), as ``filter()`` would.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from django.core.exceptions import (
    EmptyResultSet,
    FieldDoesNotExist,
    FieldError,
    FullResultSet,
    ValidationError,
)
from django.db import models, router
from django.db.models import Lookup
from django.db.models.lookups import BuiltinLookup
from django.db.models.sql import UpdateQuery
from django.db.models.sql.where import AND, WhereNode

from ..backends import Dialect, dialect_of
from .conditions import Admits


class FencedStatement(NamedTuple):
    """The parts of one shape's fenced UPDATE that no write changes."""

    head: str
    """``UPDATE t SET fence = %s, fence_step = %s, <values> = %s WHERE ``"""
    fields: tuple[models.Field[Any, Any], ...]
    """The fields of the caller's values, in the order of ``head``."""
    admits: str
    """The watermark condition's SQL; its parameters are the token and the step."""
    bound: tuple[tuple[str, type[Lookup[Any]], Any, str, str], ...]
    """(name in the lock key's template, lookup class, resolved column, the value's
    placeholder, the term's SQL) of each binding term, in the order ``filter()``
    adds them."""
    table: str


class _Compiled:
    """A condition already compiled: the watermark condition of one write."""

    contains_aggregate = False
    contains_over_clause = False

    def __init__(self, sql: str, params: tuple[Any, ...]) -> None:
        self.sql, self.params = sql, params

    def as_sql(self, compiler: Any, connection: Any) -> tuple[str, tuple[Any, ...]]:
        return self.sql, self.params


def write_alias(rows: models.QuerySet[Any]) -> str:
    """The database ``rows.update()`` writes to."""
    queryset: Any = rows  # _db and _hints are QuerySet's own, not in the stubs
    return queryset._db or router.db_for_write(rows.model, **queryset._hints)


def fenced_sql(
    rows: models.QuerySet[Any], alias: str, token: int, step: int,
    binding: Mapping[str, str], values: Mapping[str, Any],
) -> tuple[str, list[Any]] | None:
    """The SQL and parameters of ``rows.filter(Admits(token, step), **binding)
    .update(fence=token, fence_step=step, **values)`` on ``alias``, or None for a
    write this module does not cover (nothing is compiled then)."""
    from django.db import connections

    connection = connections[alias]
    key = (rows.model, alias, dialect_of(connection), tuple(values), tuple(binding))
    try:
        statement = _STATEMENTS[key]
    except KeyError:
        statement = _statement(*key, binding, values)
    query: Any = rows.query
    where = query.where
    if (
        statement is None
        or (query.alias_map and (len(query.alias_map) > 1 or statement.table not in query.alias_map))
        or query.is_sliced or query.combinator or query.distinct_fields or query.annotations
        or query.order_by or query.extra or where.connector != AND or where.negated
    ):
        return None
    params: list[Any] = [token, step]
    for field, value in zip(statement.fields, values.values(), strict=True):
        if (
            value is None or hasattr(value, "resolve_expression")
            or hasattr(value, "prepare_database_save")
        ):
            return None
        value = field.get_db_prep_save(value, connection=connection)
        if value is None or hasattr(value, "as_sql"):
            return None
        params.append(value)
    compiler = query.get_compiler(alias)
    children: list[Any] = [*where.children, _Compiled(statement.admits, (token, step))]
    try:
        for name, lookup_class, column, value_sql, term_sql in statement.bound:
            # The lookup prepares the key's value, and may refuse it, as filter()'s would.
            lookup = lookup_class(column, binding[name])
            if isinstance(lookup.rhs, bool):
                return None  # Exact may compile a boolean to the bare column
            rhs_sql, rhs_params = lookup.process_rhs(compiler, connection)
            if rhs_sql != value_sql:
                return None
            children.append(_Compiled(term_sql, tuple(rhs_params)))
        sql, where_params = compiler.compile(WhereNode(children, AND))
    except (ValueError, ValidationError, FieldError, EmptyResultSet, FullResultSet):
        return None
    return statement.head + sql, [*params, *where_params]


# Compiled shapes: a handful per model in practice; emptied if it ever grows past this.
_STATEMENTS: dict[tuple[Any, ...], FencedStatement | None] = {}
_MAX_STATEMENTS = 256


def _statement(
    model: type[models.Model], alias: str, dialect: Dialect, names: tuple[str, ...],
    keys: tuple[str, ...], binding: Mapping[str, str], values: Mapping[str, Any],
) -> FencedStatement | None:
    """The fixed parts of fenced writes of ``names`` to ``model`` on ``alias`` under
    a lock key binding of the fields ``keys``, compiled by Django's ``filter()``
    and ``update()`` with this write's ``binding`` and ``values`` (any plain value
    of a field compiles to the same placeholder), and kept; None (kept too) if
    the shape needs ``update()`` itself: a field in a parent table (a
    multi-table child: a second UPDATE), a generated or non-concrete field, one
    with its own placeholder, a binding through a relation. None and not kept
    if this write's values are not plain ones. ``dialect`` is in the key because
    the alias's connection may be replaced."""
    key = (model, alias, dialect, names, keys)
    if any(
        value is None or hasattr(value, "resolve_expression")
        or hasattr(value, "prepare_database_save") for value in values.values()
    ):
        return None
    try:
        statement = _compile_statement(model, alias, binding, values)
    except (ValueError, TypeError, ValidationError, FieldError, EmptyResultSet):
        return None  # this write's key or values do not fit; update() will say so
    if len(_STATEMENTS) >= _MAX_STATEMENTS:
        _STATEMENTS.clear()
    _STATEMENTS[key] = statement
    return statement


def _compile_statement(
    model: type[models.Model], alias: str, binding: Mapping[str, str], values: Mapping[str, Any]
) -> FencedStatement | None:
    meta = model._meta
    if meta.parents or meta.proxy:
        return None
    names = tuple(values)
    fields = []
    for name in ("fence", "fence_step", *names):
        try:
            field = meta.get_field(name)
        except FieldDoesNotExist:
            return None
        if (
            name == "pk" or not isinstance(field, models.Field) or not field.concrete
            or field.column is None or field.many_to_many or getattr(field, "generated", False)
            or field.model is not model
            or getattr(field, "get_placeholder_sql", None) is not None
            or getattr(field, "get_placeholder", None) is not None
        ):
            return None
        fields.append(field)
    admitted: Any = model._base_manager.db_manager(alias).filter(Admits(1, 1), **binding)
    query = admitted.query
    conditions = query.where.children
    table = meta.db_table
    if (
        len(query.alias_map) != 1 or table not in query.alias_map
        or len(conditions) != 1 + len(binding) or type(conditions[0]) is not Admits
    ):
        return None
    update = query.chain(UpdateQuery)
    update.add_update_values({"fence": 1, "fence_step": 1, **values})
    compiler = update.get_compiler(alias)
    connection = compiler.connection
    bound = []
    for name, lookup in zip(sorted(binding), conditions[1:], strict=True):
        if (
            not isinstance(lookup, BuiltinLookup) or getattr(lookup.lhs, "alias", None) != table
            or isinstance(lookup.rhs, bool)
        ):
            return None
        # A term is its column, its operator and its value's placeholder; only the
        # value changes from one write to the next.
        column_sql, column_params = compiler.compile(lookup.lhs)
        value_sql, value_params = lookup.process_rhs(compiler, connection)
        term_sql, term_params = compiler.compile(lookup)
        if (
            column_params or term_sql != f"{column_sql} {lookup.get_rhs_op(connection, value_sql)}"
            or list(term_params) != list(value_params)
        ):
            return None
        bound.append((name, type(lookup), lookup.lhs, value_sql, term_sql))
    sql, params = compiler.as_sql()
    where, where_params = compiler.compile(update.where)
    admits, _admits_params = compiler.compile(conditions[0])
    # One placeholder per field set (no NULL, no expression), then the WHERE.
    if not sql.endswith(f" WHERE {where}") or len(params) != len(fields) + len(where_params):
        return None
    return FencedStatement(
        head=sql[: len(sql) - len(where)], fields=tuple(fields[2:]), admits=admits,
        bound=tuple(bound), table=table,
    )


__all__: Sequence[str] = ["FencedStatement", "fenced_sql", "write_alias"]
