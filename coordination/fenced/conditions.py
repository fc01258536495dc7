"""The watermark rule as the conditions of a fenced UPDATE.

``(fence, fence_step) < (token, step)`` for a fenced write (strictly below:
rule 4 of docs/rules.md), ``<= (carried)`` for a plain ``save()``: one row
comparison each, a :class:`~django.db.models.Lookup` that ``filter()``
takes, so Django compiles the UPDATE around it (its columns resolved as
``F()`` resolves them) on each Django this app supports. Every fenced
write of a row (``fenced_update``, ``fenced_save``, a plain ``save()``) is
narrowed here and nowhere else.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from django.core.exceptions import FieldError, ValidationError
from django.db import models
from django.db.models import F, Func, Lookup


def admitted_rows(
    rows: models.QuerySet[Any], token: int, step: int, binding: Mapping[str, str]
) -> tuple[models.QuerySet[Any], bool]:
    """``rows`` narrowed to those ``(token, step)`` may write: bound to the lock key
    and below the watermark (:class:`Admits`), and whether the key's values fit
    the fields they bind (if not, no row is admitted)."""
    try:
        return rows.filter(Admits(token, step), **binding), True
    except (ValueError, ValidationError, FieldError):
        return rows.none(), False


class _Watermark(Func):
    """A fenced row's watermark, ``(fence, fence_step)``, as one row value."""

    template = "(%(expressions)s)"
    output_field = models.BigIntegerField()

    def __init__(self) -> None:
        super().__init__(F("fence"), F("fence_step"))


class WatermarkCondition(Lookup):
    """A condition on a fenced row's watermark, ``(fence, fence_step) <op> (token,
    step)``: the watermark rule as one row comparison. A lookup passed to
    ``filter()``: its columns resolve as ``F()`` does (a multi-table child's
    through the join to its parent's row), and Django compiles the statement
    around it, on each Django this app supports.
    """

    operator: ClassVar[str]
    prepare_rhs = False

    def __init__(self, token: int, step: int) -> None:
        super().__init__(_Watermark(), (token, step))

    def as_sql(self, compiler: Any, connection: Any) -> tuple[str, tuple[Any, ...]]:
        watermark, params = compiler.compile(self.lhs)
        return f"{watermark} {self.operator} (%s, %s)", (*params, *self.rhs)


class Admits(WatermarkCondition):
    """The rows a fenced write may change: ``(fence, fence_step) < (token, step)``
    (fence < token OR fence = token AND fence_step < step), strictly below."""

    operator = "<"


class NotAbove(WatermarkCondition):
    """The rows a plain ``save()`` may write: ``(fence, fence_step) <= (token, step)``,
    the watermark the instance carries."""

    operator = "<="
