"""Tombstones of deleted fenced rows, and the record of unfenced saves.

``coordination_tombstone`` keeps the watermark of each deleted FencedModel row
(by table and primary key), so that a row inserted again with the same primary
key starts above it. Its triggers are on the FencedModel tables, of the user's
apps too: the ``post_migrate`` receiver installs them with the others
(coordination.watermarks), so this migration only creates the tables.
``coordination_unfencedsave`` records each save of a stale instance that an
operator let through with ``coordination.unfenced()``.
"""

from django.db import migrations, models
from django.db.models.functions import Now


class Migration(migrations.Migration):
    dependencies = [
        ("coordination", "0015_room_for_updates_in_place"),
    ]

    operations = [
        migrations.CreateModel(
            name="Tombstone",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name="ID")),
                ("table_name", models.CharField(max_length=255)),
                ("row_pk", models.CharField(max_length=255)),
                ("fence", models.BigIntegerField()),
                ("fence_step", models.BigIntegerField()),
                ("deleted_at", models.DateTimeField(db_default=Now())),
            ],
            options={
                "ordering": ["-deleted_at", "-id"],
                "constraints": [
                    models.UniqueConstraint(fields=("table_name", "row_pk"), name="coordination_tombstone_row")
                ],
            },
        ),
        migrations.CreateModel(
            name="UnfencedSave",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name="ID")),
                ("resource", models.CharField(max_length=300)),
                ("lock_key", models.CharField(max_length=200)),
                ("token", models.BigIntegerField()),
                ("step", models.BigIntegerField()),
                ("watermark_token", models.BigIntegerField()),
                ("watermark_step", models.BigIntegerField()),
                ("reason", models.TextField()),
                ("by", models.CharField(max_length=200)),
                ("created_at", models.DateTimeField(db_default=Now())),
            ],
            options={
                "ordering": ["-created_at", "-id"],
                "indexes": [models.Index(fields=["created_at"], name="coordination_unfenced_at")],
            },
        ),
    ]
