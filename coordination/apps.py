from django.apps import AppConfig


class CoordinationConfig(AppConfig):
    name = "coordination"
    verbose_name = "Coordination"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from . import checks  # noqa: F401  (registers the system checks)
