"""The grant point's functions (PostgreSQL: frozen SQL) and Lock.wake_until."""

from django.db import migrations, models


def install_functions(apps, schema_editor):
    from coordination.backends import run_migration_sql

    run_migration_sql(schema_editor, "0006_grant_point_functions")


def drop_functions(apps, schema_editor):
    from coordination.backends import run_migration_sql

    run_migration_sql(schema_editor, "0006_grant_point_functions.backwards")


class Migration(migrations.Migration):

    dependencies = [
        ('coordination', '0005_lock_delay_and_fair_queue'),
    ]

    operations = [
        migrations.AddField(
            model_name='lock',
            name='wake_until',
            field=models.DateTimeField(blank=True, editable=False, null=True),
        ),
        migrations.RunPython(install_functions, drop_functions, elidable=False),
    ]
