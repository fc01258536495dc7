import importlib.util

from django.apps import AppConfig


class CoordinationConfig(AppConfig):
    name = "coordination"
    verbose_name = "Coordination"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from . import (
            checks,  # noqa: F401  (registers the system checks)
            history,
            signals,
        )
        from .models import Fence

        signals.write_accepted.connect(
            history.record_accepted_write, sender=Fence, dispatch_uid="coordination.history"
        )
        if importlib.util.find_spec("prometheus_client") is not None:
            from . import metrics  # noqa: F401  (counts the signals)
