"""An execution records the permit of its policy's cap per key too, so pausing and
revoking it, or clearing it when stranded, ends and fences out every lease it holds."""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("coordination", "0025_mariadb_grant_procedures")]

    operations = [
        migrations.AddField("execution", "cap_permit_key", models.CharField(max_length=200, blank=True, default="")),
        migrations.AddField("execution", "cap_permit_token", models.BigIntegerField(null=True, blank=True)),
    ]
