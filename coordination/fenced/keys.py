"""Which lock key guards which rows of a fenced model (its ``fence_lock`` template)."""

from __future__ import annotations

import re
from functools import cache

from django.db import models
from django.db.models import Value
from django.db.models.expressions import Expression
from django.db.models.functions import Cast, Concat

from ..exceptions import CoordinationError

PLACEHOLDER = re.compile(r"\{(\w+)\}")


def lock_binding(model: type[models.Model], key: str) -> dict[str, str] | None:
    """The field lookups of the rows that lock ``key`` guards, or None if it guards none."""
    match = _template_pattern(_fence_lock(model)).fullmatch(key)
    return None if match is None else match.groupdict()


def lock_key_expression(model: type[models.Model]) -> Expression:
    """The lock key guarding each row of ``model``, computed by the database.

    ``fence_lock = "account:{pk}"`` gives ``'account:' || CAST(id AS text)``,
    so rows can be filtered by key (the admin's access rules) in the query.
    """
    parts: list[Expression] = []
    template, position = _fence_lock(model), 0
    for placeholder in PLACEHOLDER.finditer(template):
        if placeholder.start() > position:
            parts.append(Value(template[position : placeholder.start()]))
        parts.append(Cast(placeholder.group(1), models.CharField()))
        position = placeholder.end()
    if position < len(template):
        parts.append(Value(template[position:]))
    if len(parts) == 1:
        return parts[0]
    return Concat(*parts, output_field=models.CharField())


def lock_key_of(row: models.Model) -> str:
    """The lock key guarding ``row`` (its model's ``fence_lock`` filled in)."""
    return PLACEHOLDER.sub(lambda name: str(getattr(row, name.group(1))), _fence_lock(type(row)))


def _fence_lock(model: type[models.Model]) -> str:
    template = getattr(model, "fence_lock", None)
    if not isinstance(template, str):
        raise CoordinationError(
            f"{model._meta.label} must declare fence_lock, e.g. "
            f'fence_lock = "{model._meta.model_name}:{{pk}}"'
        )
    return template


@cache
def _template_pattern(template: str) -> re.Pattern[str]:
    parts: list[str] = []
    position = 0
    for placeholder in PLACEHOLDER.finditer(template):
        parts.append(re.escape(template[position : placeholder.start()]))
        parts.append(f"(?P<{placeholder.group(1)}>[^:]+)")
        position = placeholder.end()
    parts.append(re.escape(template[position:]))
    return re.compile("".join(parts))
