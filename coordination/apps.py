import importlib.util

from django.apps import AppConfig
from django.db.models.signals import post_migrate


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
        from .backends import triggers
        from .models import Fence

        # After every migrate (and test flush): the watermark triggers of every
        # FencedModel table on that database, the user's apps included.
        post_migrate.connect(
            triggers.install_after_migrate, sender=self,
            dispatch_uid="coordination.watermarks",
        )

        signals.write_accepted.connect(
            history.record_accepted_write, sender=Fence, dispatch_uid="coordination.history"
        )
        if importlib.util.find_spec("prometheus_client") is not None:
            from . import metrics  # noqa: F401  (counts the signals)
            from .stores import outbox_metrics

            outbox_metrics.install()
