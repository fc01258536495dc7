from django.apps import AppConfig


class DemoConfig(AppConfig):
    name = "project.demo"
    label = "demo"
    verbose_name = "Demo bank"
    default_auto_field = "django.db.models.BigAutoField"
