"""The acquire function reads the token floor again when it created the key's row.

``coordination_prune`` deletes the Lock rows of keys unused for long, in the
transaction that raises the token floor above their counters. An acquire that
read the floor before that transaction committed, and found the row gone,
must not issue its key a token from the older floor: the re-created function
reads the floor again in that case (rule 3 of docs/rules.md). Backwards:
nothing to undo (the function of 0008 without that read is not kept).
"""

from django.db import migrations


def install_functions(apps, schema_editor):
    from coordination.backends import run_migration_sql

    run_migration_sql(schema_editor, "0011_acquire_rereads_floor")


class Migration(migrations.Migration):

    dependencies = [
        ("coordination", "0010_election_beat"),
    ]

    operations = [
        migrations.RunPython(install_functions, migrations.RunPython.noop, elidable=False),
    ]
