"""The fenced tasks workers report when they start (the jobs page's and the job
policies' list of the site's tasks)."""

import django.db.models.functions.datetime
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("coordination", "0019_outbox")]

    operations = [
        migrations.CreateModel(
            name="ReportedTask",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name="ID")),
                ("task", models.CharField(max_length=255, unique=True)),
                ("reported_at", models.DateTimeField(db_default=django.db.models.functions.datetime.Now())),
            ],
            options={"ordering": ["task"]},
        ),
    ]
