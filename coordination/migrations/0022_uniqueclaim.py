"""Unique jobs: the one row per key that says which execution holds it, and until when."""

import django.db.models.functions.datetime
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('coordination', '0021_joboutcome_finished'),
    ]

    operations = [
        migrations.CreateModel(
            name='UniqueClaim',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('key', models.CharField(max_length=200, unique=True)),
                ('task', models.CharField(max_length=255)),
                ('task_id', models.CharField(max_length=255)),
                ('scope', models.CharField(choices=[('queued', 'while queued'), ('running', 'while running'), ('succeeded', 'until it succeeded'), ('seconds', 'for some seconds')], max_length=9)),
                ('holds_until', models.DateTimeField(blank=True, null=True)),
                ('lock_key', models.CharField(blank=True, default='', max_length=200)),
                ('token', models.BigIntegerField(blank=True, null=True)),
                ('claimed_at', models.DateTimeField(db_default=django.db.models.functions.datetime.Now())),
            ],
            options={
                'ordering': ['key'],
            },
        ),
    ]
