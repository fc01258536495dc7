"""The token floor: one row that no key's next token may be at or below.

Creates the table with its row (floor 0), adds it to the watermark triggers (it
never goes down), and re-creates the grant point's functions (PostgreSQL, frozen SQL) so
that they issue ``max(counter, floor) + 1``. Backwards: the functions as
migration 0006 made them (no floor), then the table goes.
"""

from django.db import migrations, models


def create_row(apps, schema_editor):
    floor = apps.get_model("coordination", "TokenFloor")
    floor.objects.using(schema_editor.connection.alias).get_or_create(pk=1)


def install_triggers(apps, schema_editor):
    from coordination.backends import run_migration_sql

    run_migration_sql(schema_editor, "0008_token_floor.triggers")


def drop_triggers(apps, schema_editor):
    from coordination.backends import run_migration_sql

    run_migration_sql(schema_editor, "0008_token_floor.triggers.backwards")


def install_functions(apps, schema_editor):
    from coordination.backends import run_migration_sql

    run_migration_sql(schema_editor, "0008_token_floor")


def install_functions_without_floor(apps, schema_editor):
    from coordination.backends import run_migration_sql

    run_migration_sql(schema_editor, "0008_token_floor.backwards")


class Migration(migrations.Migration):

    dependencies = [
        ("coordination", "0007_watermark_triggers"),
    ]

    operations = [
        migrations.CreateModel(
            name="TokenFloor",
            fields=[
                ("id", models.PositiveSmallIntegerField(default=1, editable=False, primary_key=True, serialize=False)),
                ("token", models.BigIntegerField(db_default=0, default=0, help_text="No key is issued a token at or below this one.")),
                ("raised_at", models.DateTimeField(blank=True, editable=False, null=True)),
            ],
            options={
                "verbose_name": "token floor",
                "constraints": [
                    models.CheckConstraint(condition=models.Q(("id", 1)), name="coordination_tokenfloor_one_row"),
                    models.CheckConstraint(condition=models.Q(("token__gte", 0)), name="coordination_tokenfloor_token_gte_0"),
                ],
            },
        ),
        migrations.RunPython(create_row, migrations.RunPython.noop, elidable=False),
        migrations.RunPython(install_triggers, drop_triggers, elidable=False),
        migrations.RunPython(install_functions, install_functions_without_floor, elidable=False),
    ]
