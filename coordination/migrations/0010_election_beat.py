"""Leader election and the fenced beat: the Role proxy (election locks seen as
offices, for the admin) and the BeatSlot table (one row per schedule entry and
due time, claimed once, ever). Self-contained: nothing but new tables."""

import django.db.models.functions.datetime
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('coordination', '0009_access_rules'),
    ]

    operations = [
        migrations.CreateModel(
            name='Role',
            fields=[
            ],
            options={
                'verbose_name': 'election role',
                'proxy': True,
                'indexes': [],
                'constraints': [],
            },
            bases=('coordination.lock',),
        ),
        migrations.CreateModel(
            name='BeatSlot',
            fields=[
                ('id', models.BigAutoField(
                    auto_created=True, primary_key=True, serialize=False, verbose_name='ID',
                )),
                ('role', models.CharField(max_length=200)),
                ('entry', models.CharField(help_text='Schedule entry name.', max_length=200)),
                ('task', models.CharField(max_length=200)),
                ('due_at', models.DateTimeField(help_text='When the schedule says this occurrence is due.')),
                ('term', models.BigIntegerField(help_text="The claiming leader's term (fencing token).")),
                ('claimed_by', models.CharField(max_length=200)),
                ('claimed_at', models.DateTimeField(db_default=django.db.models.functions.datetime.Now())),
                ('sent_at', models.DateTimeField(blank=True, null=True)),
                ('task_id', models.CharField(blank=True, db_default='', default='', max_length=255)),
            ],
            options={
                'verbose_name': 'beat slot',
                'ordering': ['-due_at', 'entry'],
                'indexes': [models.Index(fields=['claimed_at'], name='coordination_beatslot_claimed')],
                'constraints': [
                    models.UniqueConstraint(
                        fields=('role', 'entry', 'due_at'), name='coordination_beatslot_once',
                    ),
                    models.CheckConstraint(
                        condition=models.Q(('term__gt', 0)), name='coordination_beatslot_term_gt_0',
                    ),
                ],
            },
        ),
    ]
