"""Triggers that refuse to lower a fence's watermark or a lock's token counter
(the database's frozen SQL; none where its backend has no triggers, and then
the ``post_migrate`` receiver raises ``WatermarksNotEnforced``).

The FencedModel tables of every app get theirs from the post_migrate receiver
(coordination.backends.triggers.install_after_migrate), which also reinstalls these
after a later migration rebuilt the table (SQLite).
"""

from django.db import migrations


def install_triggers(apps, schema_editor):
    from coordination.backends import run_migration_sql

    run_migration_sql(schema_editor, "0007_watermark_triggers")


def drop_triggers(apps, schema_editor):
    from coordination.backends import run_migration_sql

    run_migration_sql(schema_editor, "0007_watermark_triggers.backwards")


class Migration(migrations.Migration):

    dependencies = [
        ("coordination", "0006_grant_point_functions"),
    ]

    operations = [
        migrations.RunPython(install_triggers, drop_triggers, elidable=False),
    ]
