"""An execution records its lease's length, so the jobs page can say when a
stranded execution's lease was last renewed."""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("coordination", "0023_limits_and_key_caps")]

    operations = [
        migrations.AddField(
            model_name="execution",
            name="ttl",
            field=models.FloatField(blank=True, null=True),
        ),
    ]
