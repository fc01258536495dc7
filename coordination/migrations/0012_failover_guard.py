"""The promotion guard: no token is issued twice after a failover to a replica.

Adds the timeline the grant point last granted on to the token floor's row,
and re-creates the grant point's functions (PostgreSQL) so that the acquire
first runs ``coordination_failover_guard``: the first grant on a new timeline
(a promoted replica) raises the token floor past every token the old primary
can have issued, revokes every lease and closes every Fence watermark, before
it issues anything (rule 8 of docs/rules.md; docs/high-availability.md). The
current timeline is recorded now, so the guard fires only on a later promotion.
Backwards: the functions as migration 0011 made them, then the column goes.
"""

from django.db import migrations, models


def install_guard(apps, schema_editor):
    # Also records the current timeline, where the functions were created.
    from coordination.backends import run_migration_sql

    run_migration_sql(schema_editor, "0012_failover_guard")


def install_without_guard(apps, schema_editor):
    from coordination.backends import run_migration_sql

    run_migration_sql(schema_editor, "0012_failover_guard.backwards")


class Migration(migrations.Migration):

    dependencies = [
        ("coordination", "0011_acquire_rereads_floor"),
    ]

    operations = [
        migrations.AddField(
            model_name="tokenfloor",
            name="timeline",
            field=models.IntegerField(blank=True, editable=False, null=True),
        ),
        migrations.RunPython(install_guard, install_without_guard, elidable=False),
    ]
