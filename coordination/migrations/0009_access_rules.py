"""Access rules (docs/access-rules.md) and the permission to re-bind a document.

AccessRule rows name a user or a group, a key pattern and the actions allowed
on those keys; nothing else changes until a rule exists (the "auto" mode of
COORDINATION["ACCESS_RULES"]). Documents gain the ``rebind_document`` permission.
"""

import coordination.models
import django.db.models.deletion
import django.db.models.functions.datetime
from django.conf import settings
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('auth', '0012_alter_user_first_name_max_length'),
        ('coordination', '0008_token_floor'),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        migrations.AlterModelOptions(
            name='document',
            options={'ordering': ['name'], 'permissions': [('write_document', 'Can write documents through the fenced store'), ('rebind_document', 'Can re-bind a document to another lock key')]},
        ),
        migrations.CreateModel(
            name='AccessRule',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('pattern', models.CharField(help_text='billing:7 (that key only), billing:* (every key starting with billing:) or * (every key).', max_length=200, validators=[coordination.models._pattern_field_validator], verbose_name='keys')),
                ('acquire', models.BooleanField(db_default=False, default=False, help_text='Acquire, renew and release the keys.')),
                ('write', models.BooleanField(db_default=False, default=False, help_text='Write documents with grants of the keys (and so bind new documents to them).')),
                ('read', models.BooleanField(db_default=False, default=False, help_text="See the keys' locks, grants, fences, documents and refused writes.")),
                ('revoke', models.BooleanField(db_default=False, default=False, help_text="Revoke the keys' leases and raise their fences in the admin.")),
                ('created_at', models.DateTimeField(db_default=django.db.models.functions.datetime.Now(), editable=False)),
                ('group', models.ForeignKey(blank=True, help_text='Every member of this group.', null=True, on_delete=django.db.models.deletion.CASCADE, related_name='+', to='auth.group')),
                ('user', models.ForeignKey(blank=True, help_text='Who the rule is for: a user, or a group (not both).', null=True, on_delete=django.db.models.deletion.CASCADE, related_name='+', to=settings.AUTH_USER_MODEL)),
            ],
            options={
                'verbose_name': 'access rule',
                'ordering': ['pattern', 'id'],
                'constraints': [models.CheckConstraint(condition=models.Q(models.Q(('group__isnull', True), ('user__isnull', False)), models.Q(('group__isnull', False), ('user__isnull', True)), _connector='OR'), name='coordination_accessrule_user_or_group', violation_error_message='An access rule is for a user or a group: one, not both.'), models.CheckConstraint(condition=models.Q(('acquire', True), ('write', True), ('read', True), ('revoke', True), _connector='OR'), name='coordination_accessrule_some_action', violation_error_message='An access rule allows at least one action.')],
            },
        ),
    ]
