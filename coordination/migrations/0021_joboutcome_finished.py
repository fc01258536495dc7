"""A job tally's outcome "finished": a redelivery of a ``once`` task id whose body
completed, not run again (a choice only: no change to the column)."""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("coordination", "0020_reportedtask")]

    operations = [
        migrations.AlterField(
            model_name="jobtally",
            name="outcome",
            field=models.CharField(
                choices=[("deferred", "deferred"), ("skipped", "skipped"), ("finished", "finished before")],
                max_length=8,
            ),
        ),
    ]
