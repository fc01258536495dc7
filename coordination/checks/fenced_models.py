"""The user's fenced models: E002, W008."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from django.apps import AppConfig, apps
from django.core.checks import CheckMessage, Error, Tags, Warning, register

from ..fenced.keys import PLACEHOLDER
from ..fencing import FencedModel, FencedQuerySet


@register(Tags.models)
def check_fenced_models(
    app_configs: Sequence[AppConfig] | None = None, **kwargs: Any
) -> list[CheckMessage]:
    """E002: every concrete FencedModel declares a usable ``fence_lock`` template;
    W008: its managers make fenced querysets."""
    messages: list[CheckMessage] = []
    for model in apps.get_models():
        if not issubclass(model, FencedModel):
            continue
        messages.extend(_plain_managers(model))
        template = getattr(model, "fence_lock", None)
        if not isinstance(template, str) or not PLACEHOLDER.search(template):
            messages.append(
                Error(
                    f"{model._meta.label} does not declare which lock key guards its rows.",
                    hint=f'Add fence_lock = "{model._meta.model_name}:{{pk}}" to the model.',
                    obj=model,
                    id="coordination.E002",
                )
            )
            continue
        names = {f.name for f in model._meta.get_fields()} | {"pk"}
        for name in PLACEHOLDER.findall(template):
            if name not in names:
                messages.append(
                    Error(
                        f"{model._meta.label}.fence_lock names {name!r}, which is not a field.",
                        obj=model,
                        id="coordination.E002",
                    )
                )
    return messages


def _plain_managers(model: type[FencedModel]) -> list[CheckMessage]:
    """W008: a manager of its own (``objects = OrderManager()``) replaces the one
    FencedModel declares, and its querysets have no ``fenced_update()``."""
    return [
        Warning(
            f"{model._meta.label}.{manager.name} makes plain querysets: "
            f"{model.__name__}.{manager.name}.filter(...).fenced_update() raises AttributeError, "
            "and its update() reports a watermark refusal as a bare IntegrityError, not as "
            "StaleToken or UnfencedWrite.",
            hint=f"Build the manager on FencedQuerySet: {manager.name} = "
            f"{type(manager).__name__}.from_queryset(FencedQuerySet)() "
            "(from coordination.fencing import FencedQuerySet; a queryset class of your own "
            "subclasses FencedQuerySet).",
            obj=model,
            id="coordination.W008",
        )
        for manager in model._meta.managers
        if not issubclass(getattr(manager, "_queryset_class", FencedQuerySet), FencedQuerySet)
    ]
