"""Job policies set at run time (paused, max running, ttl and on_busy overrides),
the record of every change to them, and the counts of executions deferred or
skipped, per task. New tables only."""

import coordination.models
import django.db.models.deletion
import django.db.models.functions.datetime
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('coordination', '0016_tombstones_and_unfenced_saves'),
    ]

    operations = [
        migrations.CreateModel(
            name='JobPolicy',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('task', models.CharField(help_text="The task's name (billing.tasks.settle), or a beginning followed by * (billing.* : every task whose name starts with billing.). An exact name wins over a pattern, a longer pattern over a shorter one.", max_length=195, unique=True, validators=[coordination.models._task_field_validator])),
                ('paused', models.BooleanField(db_default=False, default=False, help_text='Executions that start while paused do not run their body.')),
                ('when_paused', models.CharField(choices=[('defer', 'defer: run it after the resume'), ('skip', 'skip: a Skipped result, not run')], db_default='defer', default='defer', help_text='Defer (sent again after a countdown until resumed; never lost) or skip (a Skipped result).', max_length=5)),
                ('defer_seconds', models.FloatField(db_default=10.0, default=10.0, help_text='Countdown of a deferred execution before it asks again, in seconds.')),
                ('max_running', models.PositiveIntegerField(blank=True, help_text='At most this many executions of the task run at once, over all workers and keys, each holding a fenced permit. Empty: no cap.', null=True)),
                ('ttl', models.FloatField(blank=True, help_text="Lease of each execution in seconds, instead of the decorator's. Empty: the decorator's.", null=True)),
                ('on_busy', models.CharField(blank=True, choices=[('retry', 'retry'), ('skip', 'skip'), ('raise', 'raise')], db_default='', default='', help_text="What an execution does when its lock (or every permit) is held, instead of the decorator's. Empty: the decorator's.", max_length=5)),
                ('note', models.CharField(blank=True, db_default='', default='', max_length=200)),
                ('updated_at', models.DateTimeField(auto_now=True, db_default=django.db.models.functions.datetime.Now())),
            ],
            options={
                'verbose_name': 'job policy',
                'verbose_name_plural': 'job policies',
                'ordering': ['task'],
                'permissions': [('pause_jobpolicy', 'Can pause and resume tasks, and revoke their leases')],
                'constraints': [models.CheckConstraint(condition=models.Q(('max_running__isnull', True), models.Q(('max_running__gte', 1), ('max_running__lte', 1000)), _connector='OR'), name='coordination_jobpolicy_max_running', violation_error_message='max running is from 1 to 1000, or empty.'), models.CheckConstraint(condition=models.Q(('ttl__isnull', True), ('ttl__gt', 0), _connector='OR'), name='coordination_jobpolicy_ttl_gt_0', violation_error_message='ttl is more than 0 seconds, or empty.'), models.CheckConstraint(condition=models.Q(('defer_seconds__gte', 0.1), ('defer_seconds__lte', 3600)), name='coordination_jobpolicy_defer_seconds', violation_error_message='the defer countdown is from 0.1 to 3600 seconds.')],
            },
        ),
        migrations.CreateModel(
            name='JobPolicyChange',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('task', models.CharField(max_length=200)),
                ('changed_by', models.CharField(blank=True, default='', max_length=150)),
                ('via', models.CharField(blank=True, default='', max_length=40)),
                ('changed_at', models.DateTimeField(db_default=django.db.models.functions.datetime.Now())),
                ('before', models.JSONField(blank=True, null=True)),
                ('after', models.JSONField(blank=True, null=True)),
                ('policy', models.ForeignKey(blank=True, null=True, on_delete=django.db.models.deletion.SET_NULL, related_name='changes', to='coordination.jobpolicy')),
            ],
            options={
                'verbose_name': 'job policy change',
                'ordering': ['-changed_at', '-id'],
            },
        ),
        migrations.CreateModel(
            name='JobTally',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('task', models.CharField(max_length=200)),
                ('outcome', models.CharField(choices=[('deferred', 'deferred'), ('skipped', 'skipped')], max_length=8)),
                ('count', models.BigIntegerField(db_default=0, default=0)),
                ('last_at', models.DateTimeField(db_default=django.db.models.functions.datetime.Now())),
            ],
            options={
                'ordering': ['task', 'outcome'],
                'constraints': [models.UniqueConstraint(fields=('task', 'outcome'), name='coordination_jobtally_once')],
            },
        ),
    ]
