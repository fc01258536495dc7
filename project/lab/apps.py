from django.apps import AppConfig


class LabConfig(AppConfig):
    name = "project.lab"
    label = "lab"
    verbose_name = "Demo, chaos and benchmarks"
