"""Leave a fifth of each page of the lock and fence tables free.

Their rows are written on every acquire and release (a lock) and every
accepted write (a fence), and no index covers a column those writes change:
with room on the page, PostgreSQL keeps each new row version in place and
touches no index (a HOT update). At the default fillfactor a full page sends
every update to another page and into each index, which is what made a cycle
on a table of a million locks slower than on a small one (docs/performance.md).
A storage parameter only: nothing is rewritten, and reads and writes go on
during the ALTER. PostgreSQL only; backwards: the default fillfactor again.
"""

from django.db import migrations


def leave_room(apps, schema_editor):
    from coordination.backends import run_migration_sql

    run_migration_sql(schema_editor, "0015_room_for_updates_in_place")


def fill_pages(apps, schema_editor):
    from coordination.backends import run_migration_sql

    run_migration_sql(schema_editor, "0015_room_for_updates_in_place.backwards")


class Migration(migrations.Migration):

    dependencies = [
        ("coordination", "0014_release_without_flush_wait"),
    ]

    operations = [
        migrations.RunPython(leave_room, fill_pages, elidable=False),
    ]
