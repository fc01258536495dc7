"""The release function no longer waits for its WAL flush.

``coordination_release`` sets ``synchronous_commit`` off for its own
transaction (never for a caller's transaction that wrote before it). A release
lost in a crash of the server leaves the lease to run to its expiry; no token,
grant or watermark depends on it, and any grant that found the lock free is
flushed after it (docs/performance.md). Acquires and renews stay durable.
Backwards: nothing to undo (the function of 0012 is not kept).
"""

from django.db import migrations


def install_functions(apps, schema_editor):
    from coordination.backends import run_migration_sql

    run_migration_sql(schema_editor, "0014_release_without_flush_wait")


class Migration(migrations.Migration):

    dependencies = [
        ("coordination", "0013_grant_mode"),
    ]

    operations = [
        migrations.RunPython(install_functions, migrations.RunPython.noop, elidable=False),
    ]
