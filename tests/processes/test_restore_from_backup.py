"""A restore from a backup taken before a key's first grant, as an operator does it.

The backup is real (``pg_dump``; on SQLite the backup API), the restore is real
(``pg_restore`` into a new database; on SQLite a copy of the backup file), and the
restore guard runs as its command, ``manage.py coordination_restore_guard``, in a
process of its own against the restored database. Then key K, which the backup
never saw, is granted there, and a paused worker still holding one of K's tokens
from before the restore tries its late write.

Without the token floor the restored database has no row for K: its counter starts
again at 1 and reissues tokens its fence already accepted, and the restored fence
(back at 0) takes the paused worker's late write. The negative control shows both,
on a second restore guarded with the counters alone.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import shutil
import sqlite3
import subprocess
import sys
import urllib.parse
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.db import connection

from coordination import fencing, locks
from coordination.models import Fence
from tests.support.legs import missing_service

REPO = Path(__file__).resolve().parents[2]
BUMP = 1000  # more than K (or any key) can have been granted since the backup
KEY, RESOURCE = "report:k", "report-k"

pytestmark = pytest.mark.django_db(transaction=True)

# Run in the restored database by ``manage.py shell``: the paused worker's late
# write first (the dangerous order), then a new grant of K and its write.
AFTER_RESTORE = """
import json, pickle
from coordination import fencing, locks
from coordination.exceptions import CoordinationError
paused = pickle.loads(bytes.fromhex({paused!r}))
seen = {{}}
try:
    with fencing.fence({resource!r}, paused):
        pass
    seen["late_write"] = "accepted"
except CoordinationError as refused:
    seen["late_write"] = refused.code
fresh = locks.acquire({key!r}, holder="after-restore", ttl=30)
seen["fresh_token"] = fresh.token
try:
    with fencing.fence({resource!r}, fresh) as row:
        seen["fresh_write"] = "accepted"
except CoordinationError as refused:
    seen["fresh_write"] = refused.code
print("RESULT " + json.dumps(seen))
"""

# The guard as it was before the token floor: every lock row's counter, no floor.
GUARD_WITHOUT_FLOOR = f"""
from coordination import restore
report = restore.RestoreReport(applied=True)
restore._bump_counters(
    {BUMP}, apply=True, alias="default", batch_size=1000, report=report,
    say=print, progress=print,
)
restore.raise_fences(apply=True, report=report)
"""


# --- backup and restore, per database ---------------------------------------------


def postgres_binary(name: str) -> str:
    """The client binary of the server's major version (PostgreSQL 15 here)."""
    major = connection.pg_version // 10000  # type: ignore[attr-defined]
    for candidate in (f"/usr/lib/postgresql/{major}/bin/{name}", shutil.which(name)):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    missing_service(f"{name} (PostgreSQL {major} client) is not installed")


def libpq_environment(database: str) -> dict[str, str]:
    settings = connection.settings_dict
    return {
        "PGHOST": str(settings["HOST"] or "127.0.0.1"),
        "PGPORT": str(settings["PORT"] or 5432),
        "PGUSER": str(settings["USER"] or ""),
        "PGPASSWORD": str(settings["PASSWORD"] or ""),
        "PGDATABASE": database,
    }


def database_url(database: str) -> str:
    if connection.vendor == "sqlite":
        return f"sqlite:///{database}"
    env = libpq_environment(database)
    user = urllib.parse.quote(env["PGUSER"])
    password = f":{urllib.parse.quote(env['PGPASSWORD'])}" if env["PGPASSWORD"] else ""
    return f"postgres://{user}{password}@{env['PGHOST']}:{env['PGPORT']}/{database}"


def back_up(to: Path) -> None:
    """A backup of the test database as it is now (committed)."""
    if connection.vendor == "sqlite":
        with contextlib.closing(sqlite3.connect(connection.settings_dict["NAME"])) as live, \
                contextlib.closing(sqlite3.connect(to)) as copy:
            live.backup(copy)
        return
    run([postgres_binary("pg_dump"), "--format=custom", f"--file={to}"],
        env=libpq_environment(connection.settings_dict["NAME"]))


@contextlib.contextmanager
def restored(backup: Path, directory: Path) -> Iterator[str]:
    """A new database restored from ``backup``; its DATABASE_URL. Dropped afterwards."""
    if connection.vendor == "sqlite":
        path = directory / f"restored-{uuid.uuid4().hex[:8]}.sqlite3"
        shutil.copyfile(backup, path)
        yield database_url(str(path))
        return
    name = f"restored_{uuid.uuid4().hex[:12]}"
    with connection.cursor() as cursor:
        cursor.execute(f'CREATE DATABASE "{name}"')
    try:
        run([postgres_binary("pg_restore"), "--no-owner", "--exit-on-error", f"--dbname={name}",
             str(backup)], env=libpq_environment(name))
        yield database_url(name)
    finally:
        with connection.cursor() as cursor:
            cursor.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def run(command: list[str], *, env: dict[str, str] | None = None) -> str:
    done = subprocess.run(
        command, cwd=REPO, env={**os.environ, **(env or {})}, capture_output=True, text=True,
        timeout=180,
    )
    assert done.returncode == 0, f"{command[:3]} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout + done.stderr


def manage(url: str, *arguments: str) -> str:
    return run([sys.executable, "manage.py", *arguments], env={"DATABASE_URL": url})


def after_restore(url: str, paused: locks.Lease) -> dict[str, Any]:
    code = AFTER_RESTORE.format(paused=pickle.dumps(paused).hex(), resource=RESOURCE, key=KEY)
    out = manage(url, "shell", "-c", code)
    line = next(line for line in out.splitlines() if line.startswith("RESULT "))
    result: dict[str, Any] = json.loads(line.removeprefix("RESULT "))
    return result


# --- the story ----------------------------------------------------------------------


@pytest.mark.legs(
    "pg",
    reason="pg_dump and a second database; the restore guard is SQL the LTS Django does not change",
)
def test_a_restore_from_before_a_keys_first_grant_never_reissues_its_tokens(
    tmp_path: Path,
) -> None:
    # Before the backup: K's resource exists, K itself was never granted; another key was.
    Fence.objects.create(resource=RESOURCE, lock_key=KEY)
    for _ in range(2):
        locks.release(locks.acquire("report:old", holder="w", ttl=30))
    backup = tmp_path / "backup.dump"
    back_up(backup)

    # After it: K is granted, its fence accepts each token; the last holder pauses.
    issued = []
    for number in range(3):
        lease = locks.acquire(KEY, holder=f"worker-{number}", ttl=300)
        with fencing.fence(RESOURCE, lease):
            pass
        issued.append(lease.token)
        if number < 2:
            locks.release(lease)
    paused = lease
    assert issued == [1, 2, 3]
    assert Fence.objects.get(resource=RESOURCE).token == 3

    # Disaster: the database is restored from the backup, and guarded.
    with restored(backup, tmp_path) as url:
        out = manage(url, "coordination_restore_guard", "--bump", str(BUMP), "--raise-fences",
                     "--apply")
        assert f"raised the token floor from 0 to {BUMP}" in out
        seen = after_restore(url, paused)

    assert seen == {"late_write": "stale_token", "fresh_token": BUMP + 1, "fresh_write": "accepted"}
    assert seen["fresh_token"] > max(issued)

    # The negative control: the same restore, guarded with the counters alone.
    with restored(backup, tmp_path) as url:
        manage(url, "shell", "-c", GUARD_WITHOUT_FLOOR)
        unguarded = after_restore(url, paused)

    # The restored fence is back at 0 and takes the paused worker's write (3); K's
    # counter starts again and issues token 1 a second time, and the new holder's
    # write is then refused by the paused worker's.
    assert unguarded == {"late_write": "accepted", "fresh_token": 1, "fresh_write": "stale_token"}
