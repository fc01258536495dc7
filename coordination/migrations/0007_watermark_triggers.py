"""Triggers that refuse to lower a fence's watermark or a lock's token counter.

The FencedModel tables of every app get theirs from the post_migrate receiver
(coordination.watermarks.install_after_migrate), which also reinstalls these
after a later migration rebuilt the table (SQLite).
"""

from django.db import migrations


def _watermarks(apps):
    from coordination.watermarks import Watermark

    return [
        Watermark.of(apps.get_model("coordination", "Lock"), "token"),
        Watermark.of(apps.get_model("coordination", "Fence"), "token", "step"),
    ]


def install_triggers(apps, schema_editor):
    from coordination import watermarks

    watermarks.install(schema_editor.connection, _watermarks(apps))


def drop_triggers(apps, schema_editor):
    from coordination import watermarks

    watermarks.uninstall(schema_editor.connection, _watermarks(apps))


class Migration(migrations.Migration):

    dependencies = [
        ("coordination", "0006_grant_point_functions"),
    ]

    operations = [
        migrations.RunPython(install_triggers, drop_triggers, elidable=False),
    ]
