"""Rate limits over every worker (a row per rate key, locked by each decision, and
its log of starts), the job policies' rate limit and cap per key, and the
parameters a worker reports of each fenced task. New tables and nullable or
defaulted columns only."""

import django.db.models.deletion
import django.db.models.functions.datetime
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('coordination', '0022_uniqueclaim'),
    ]

    operations = [
        migrations.CreateModel(
            name='RateBucket',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('key', models.CharField(max_length=255, unique=True)),
                ('created_at', models.DateTimeField(db_default=django.db.models.functions.datetime.Now())),
            ],
            options={
                'ordering': ['key'],
            },
        ),
        migrations.CreateModel(
            name='RateStart',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('started_at', models.DateTimeField()),
                ('task', models.CharField(blank=True, default='', max_length=255)),
            ],
            options={
                'ordering': ['started_at', 'id'],
            },
        ),
        migrations.AddField(
            model_name='jobpolicy',
            name='cap_key',
            field=models.CharField(blank=True, db_default='', default='', help_text="What the cap counts per: a template over the task's arguments ({customer_id}); needed with a cap per key.", max_length=200),
        ),
        migrations.AddField(
            model_name='jobpolicy',
            name='key_cap',
            field=models.PositiveIntegerField(blank=True, help_text='At most this many executions at once per cap key, each holding a fenced permit. Empty: no cap per key.', null=True),
        ),
        migrations.AddField(
            model_name='jobpolicy',
            name='rate_key',
            field=models.CharField(blank=True, db_default='', default='', help_text="What the rate limit counts per: a template over the task's arguments ({customer_id}). Empty: one limit for all of the policy's executions.", max_length=200),
        ),
        migrations.AddField(
            model_name='jobpolicy',
            name='rate_limit',
            field=models.PositiveIntegerField(blank=True, help_text='At most this many executions start in any window of the rate period, over all workers, per rate key (deferred past it, never lost). Empty: no limit.', null=True),
        ),
        migrations.AddField(
            model_name='jobpolicy',
            name='rate_period',
            field=models.FloatField(blank=True, help_text="The rate limit's period in seconds (60: per minute).", null=True),
        ),
        migrations.AddField(
            model_name='reportedtask',
            name='parameters',
            field=models.JSONField(blank=True, null=True),
        ),
        migrations.AddConstraint(
            model_name='jobpolicy',
            constraint=models.CheckConstraint(condition=models.Q(models.Q(('rate_key', ''), ('rate_limit__isnull', True), ('rate_period__isnull', True)), models.Q(('rate_limit__gte', 1), ('rate_limit__isnull', False), ('rate_limit__lte', 100000), ('rate_period__gte', 0.1), ('rate_period__isnull', False), ('rate_period__lte', 86400.0)), _connector='OR'), name='coordination_jobpolicy_rate', violation_error_message='a rate limit is from 1 to 100000 starts per 0.1 to 86400 seconds; a rate key needs a limit.'),
        ),
        migrations.AddConstraint(
            model_name='jobpolicy',
            constraint=models.CheckConstraint(condition=models.Q(models.Q(('cap_key', ''), ('key_cap__isnull', True)), models.Q(('key_cap__gte', 1), ('key_cap__isnull', False), ('key_cap__lte', 1000), models.Q(('cap_key', ''), _negated=True)), _connector='OR'), name='coordination_jobpolicy_key_cap', violation_error_message='a cap per key is from 1 to 1000 and needs a cap key, or both are empty.'),
        ),
        migrations.AddField(
            model_name='ratestart',
            name='bucket',
            field=models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='starts', to='coordination.ratebucket'),
        ),
        migrations.AddIndex(
            model_name='ratestart',
            index=models.Index(fields=['bucket', 'started_at'], name='coordination_ratestart_window'),
        ),
        migrations.AddIndex(
            model_name='ratestart',
            index=models.Index(fields=['started_at'], name='coordination_ratestart_age'),
        ),
    ]
