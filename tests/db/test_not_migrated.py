"""A site that forgot ``migrate`` (or upgraded the package without it): the grant
point's call fails on a missing table, and the answer names the fix instead of a
missing table's error, or a "retry" as for a lost connection."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from django.db import DatabaseError, connection
from django.db.migrations.recorder import MigrationRecorder

from coordination import locks
from coordination.exceptions import GrantPointUnavailable, NotMigrated
from coordination.models import Lock
from tests.support.api_support import client_with

pytestmark = pytest.mark.django_db(transaction=True)

TABLE = Lock._meta.db_table


def _rename(old: str, new: str) -> None:
    with connection.cursor() as cursor:
        cursor.execute(
            f"ALTER TABLE {connection.ops.quote_name(old)} RENAME TO {connection.ops.quote_name(new)}"
        )


@pytest.fixture
def lock_table_gone() -> Iterator[None]:
    """The lock table missing, as before ``migrate`` made it; put back afterwards."""
    _rename(TABLE, f"{TABLE}_gone")
    try:
        yield
    finally:
        _rename(f"{TABLE}_gone", TABLE)


@pytest.fixture
def last_migration_unrecorded() -> Iterator[str]:
    """The app's last applied migration unrecorded, as on a site upgraded without ``migrate``."""
    recorder = MigrationRecorder(connection)
    last = recorder.migration_qs.filter(app="coordination").order_by("-id").first()
    assert last is not None
    last.delete()
    try:
        yield last.name
    finally:
        recorder.record_applied("coordination", last.name)


def test_an_acquire_on_an_unmigrated_database_says_to_run_migrate(
    lock_table_gone: None, last_migration_unrecorded: str
) -> None:
    with pytest.raises(NotMigrated) as raised:
        locks.acquire("account:1", holder="worker", ttl=5)

    assert not isinstance(raised.value, GrantPointUnavailable)  # nothing to retry
    assert "run python manage.py migrate" in str(raised.value)
    assert last_migration_unrecorded in str(raised.value)
    assert isinstance(raised.value.__cause__, DatabaseError)


def test_the_api_answers_503_not_migrated(lock_table_gone: None, last_migration_unrecorded: str) -> None:
    api = client_with("acquire_lock")

    response = api.post("/api/locks/account:1/acquire", {"holder": "worker", "ttl": 5}, format="json")

    assert response.status_code == 503
    assert response.json()["code"] == "not_migrated"
    assert "manage.py migrate" in response.json()["detail"]


def test_a_missing_table_with_every_migration_recorded_is_the_databases_own_error(
    lock_table_gone: None,
) -> None:
    """Migrations applied and the table gone anyway (dropped by hand): not this
    answer's case; the database's error is not hidden (on SQLite, where any
    error may be a lost file, inside the grant point's "unavailable")."""
    with pytest.raises((DatabaseError, GrantPointUnavailable)) as raised:
        locks.acquire("account:1", holder="worker", ttl=5)
    assert not isinstance(raised.value, NotMigrated)
    assert TABLE in str(raised.value)
