"""Every grant records its mode: exclusive (every grant so far) or shared (readers).

A column with a constant database default: the grant point's SQL functions
keep inserting exclusive grants without naming it, and on PostgreSQL adding it
rewrites no table. Shared grants are made by the ORM code of
``coordination.backends.shared``; no function of 0006 or 0011 changes.
"""

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ("coordination", "0012_failover_guard"),
    ]

    operations = [
        migrations.AddField(
            model_name="grant",
            name="mode",
            field=models.CharField(
                choices=[("exclusive", "exclusive"), ("shared", "shared")],
                db_default="exclusive",
                default="exclusive",
                editable=False,
                max_length=9,
            ),
        ),
    ]
