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


def _install(apps, schema_editor, *, guard):
    if schema_editor.connection.vendor != "postgresql":
        return
    from coordination.backends import postgresql

    installed = postgresql.install_if_permitted(
        schema_editor.connection,
        lock=apps.get_model("coordination", "Lock"),
        grant=apps.get_model("coordination", "Grant"),
        ticket=apps.get_model("coordination", "Ticket"),
        floor=apps.get_model("coordination", "TokenFloor"),
        guard=guard,
    )
    if installed and guard:
        floor = apps.get_model("coordination", "TokenFloor")
        with schema_editor.connection.cursor() as cursor:
            # On a standby (never: migrations write) this would raise, as it should.
            cursor.execute(
                f"UPDATE {schema_editor.quote_name(floor._meta.db_table)} SET timeline = "
                "('x' || left(pg_walfile_name(pg_current_wal_lsn()), 8))::bit(32)::integer "
                "WHERE id = 1"
            )


def install_guard(apps, schema_editor):
    _install(apps, schema_editor, guard=True)


def install_without_guard(apps, schema_editor):
    _install(apps, schema_editor, guard=False)


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
