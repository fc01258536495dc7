"""The grant point's PL/pgSQL functions (PostgreSQL only) and Lock.wake_until."""

from django.db import migrations, models


def install_functions(apps, schema_editor):
    if schema_editor.connection.vendor != "postgresql":
        return
    from coordination.backends import postgresql

    postgresql.install_if_permitted(
        schema_editor.connection,
        lock=apps.get_model("coordination", "Lock"),
        grant=apps.get_model("coordination", "Grant"),
        ticket=apps.get_model("coordination", "Ticket"),
        floor=None,  # the token floor's table comes with migration 0008
    )


def drop_functions(apps, schema_editor):
    if schema_editor.connection.vendor != "postgresql":
        return
    from coordination.backends import postgresql

    postgresql.drop(schema_editor.connection)


class Migration(migrations.Migration):

    dependencies = [
        ('coordination', '0005_lock_delay_and_fair_queue'),
    ]

    operations = [
        migrations.AddField(
            model_name='lock',
            name='wake_until',
            field=models.DateTimeField(blank=True, editable=False, null=True),
        ),
        migrations.RunPython(install_functions, drop_functions, elidable=False),
    ]
