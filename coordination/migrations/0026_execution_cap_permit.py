"""An execution records the permit of its policy's cap per key too, so pausing and
revoking it, or clearing it when stranded, ends and fences out every lease it holds."""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("coordination", "0025_mariadb_grant_procedures")]

    operations = [
        migrations.AddField(
            model_name="execution",
            name="cap_permit_key",
            field=models.CharField(blank=True, default="", max_length=200),
        ),
        migrations.AddField(
            model_name="execution",
            name="cap_permit_token",
            field=models.BigIntegerField(blank=True, null=True),
        ),
    ]
