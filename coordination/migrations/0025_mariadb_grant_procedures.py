"""The grant point's stored procedures on MariaDB: one call per acquire and release.

``coordination_acquire`` and ``coordination_release`` run the grant's whole
transaction in the server (the row lock, the clock, the token floor, the fair
queue, the lock row and its grant history), deciding with the rule the ORM
transaction applies. On other databases this step runs nothing. A database
that refuses the app the right to create procedures goes on without them
(the grant point must then be ``COORDINATION["GRANT_POINT"] = "orm"``).
Backwards: the procedures are dropped.
"""

from django.db import migrations


def install_procedures(apps, schema_editor):
    from coordination.backends import run_migration_sql

    run_migration_sql(schema_editor, "0025_mariadb_grant_procedures")


def drop_procedures(apps, schema_editor):
    from coordination.backends import run_migration_sql

    run_migration_sql(schema_editor, "0025_mariadb_grant_procedures.backwards")


class Migration(migrations.Migration):

    dependencies = [
        ("coordination", "0024_execution_ttl"),
    ]

    operations = [
        migrations.RunPython(install_procedures, drop_procedures, elidable=False),
    ]
