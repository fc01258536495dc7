"""Rate limits' rows: one per rate key (locked by each decision) and its log of starts."""

from __future__ import annotations

import string
from collections.abc import Mapping
from typing import Any

from django.db import models
from django.db.models.functions import Now

from ..exceptions import InvalidInput


def template_fields(template: str) -> list[str]:
    """The argument names a key template (``"customer:{customer_id}"``) uses, in
    order; ``InvalidInput`` for a template that does not parse or names none by
    name (``{}`` or ``{0}``: a policy's template is over named arguments)."""
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as error:
        raise InvalidInput(f"key template {template!r} is not a valid template: {error}") from None
    names = []
    for _text, field, _spec, _conversion in parsed:
        if field is None:
            continue
        name = field.split(".", 1)[0].split("[", 1)[0]
        if not name.isidentifier():
            raise InvalidInput(
                f"key template {template!r} has {{{field}}}: name an argument, as {{customer_id}}"
            )
        names.append(name)
    return names


def render_template(template: str, arguments: Mapping[str, Any], *, what: str = "key template") -> str:
    """``template`` formatted with one call's ``arguments`` (by name); InvalidInput
    naming the missing argument."""
    try:
        return template.format(**arguments)
    except (KeyError, IndexError, AttributeError) as error:
        raise InvalidInput(f"{what} {template!r} names {error}, which this call does not have") from None


# MariaDB's bound on a unique text column; longer rate keys end in a digest.
RATE_BUCKET_MAX_LENGTH = 255


class RateBucket(models.Model):
    """One rate key (the policy's or task's name and the rendered template): the row
    each decision locks, so that the decisions of one key happen one at a time."""

    key = models.CharField(max_length=RATE_BUCKET_MAX_LENGTH, unique=True)
    created_at = models.DateTimeField(db_default=Now())

    class Meta:
        ordering = ["key"]

    def __str__(self) -> str:
        return self.key


class RateStart(models.Model):
    """One execution that started under a rate limit, at the database time its start
    was decided (the time every window is counted with)."""

    bucket = models.ForeignKey(RateBucket, on_delete=models.CASCADE, related_name="starts")
    started_at = models.DateTimeField()
    task = models.CharField(max_length=255, blank=True, default="")

    class Meta:
        ordering = ["started_at", "id"]
        indexes = [
            models.Index(fields=["bucket", "started_at"], name="coordination_ratestart_window"),
            models.Index(fields=["started_at"], name="coordination_ratestart_age"),
        ]

    def __str__(self) -> str:
        return f"{self.bucket_id} at {self.started_at}"
