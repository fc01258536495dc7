"""MariaDB's grant point procedures, leaner: fewer statements and smaller rows.

``coordination_acquire`` reads the key's row, the token floor and the fair
queue with one locking statement, and both procedures return only what the
caller reads (the grant's token and times, or a refusal's reasons): the same
decision, the same writes and errors as the procedures of 0025, in fewer
statements per call. On other databases this step runs nothing. A database
that refuses the app the right to create procedures goes on without them.
Backwards: the procedures of 0025 again.
"""

from django.db import migrations


def install_procedures(apps, schema_editor):
    from coordination.backends import run_migration_sql

    run_migration_sql(schema_editor, "0027_mariadb_leaner_grant_procedures")


def restore_procedures(apps, schema_editor):
    from coordination.backends import run_migration_sql

    run_migration_sql(schema_editor, "0027_mariadb_leaner_grant_procedures.backwards")


class Migration(migrations.Migration):

    dependencies = [
        ("coordination", "0026_execution_cap_permit"),
    ]

    operations = [
        migrations.RunPython(install_procedures, restore_procedures, elidable=False),
    ]
