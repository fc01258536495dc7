"""The user's fenced models: E002."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from django.apps import AppConfig, apps
from django.core.checks import CheckMessage, Error, Tags, register

from ..fenced.keys import PLACEHOLDER
from ..fencing import FencedModel


@register(Tags.models)
def check_fenced_models(
    app_configs: Sequence[AppConfig] | None = None, **kwargs: Any
) -> list[CheckMessage]:
    """E002: every concrete FencedModel declares a usable ``fence_lock`` template."""
    messages: list[CheckMessage] = []
    for model in apps.get_models():
        if not issubclass(model, FencedModel):
            continue
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

