"""A multi-host DATABASE_URL on the real PostgreSQL: libpq skips a host that does not
answer and connects to the next, as it does when a Patroni primary is down."""

from __future__ import annotations

import pytest
from django.db import connection
from django.db.utils import ConnectionHandler

from project.database_url import parse

pytestmark = [
    pytest.mark.postgres,
    pytest.mark.django_db,
]


def test_a_dead_first_host_is_skipped_and_the_read_write_server_is_used() -> None:
    real = connection.settings_dict
    url = (
        f"postgres://{real['USER']}@127.0.0.1:1,{real['HOST'] or '127.0.0.1'}:{real['PORT']}/{real['NAME']}"
        "?target_session_attrs=read-write&connect_timeout=10"
    )
    config = parse(url, conn_max_age=0)
    config["PASSWORD"] = real["PASSWORD"]
    handler = ConnectionHandler({"default": config})
    other = handler["default"]
    try:
        with other.cursor() as cursor:
            cursor.execute("SELECT inet_server_port(), pg_is_in_recovery(), current_database()")
            port, in_recovery, name = cursor.fetchone()
    finally:
        handler.close_all()

    assert (str(port), in_recovery, name) == (str(real["PORT"]), False, real["NAME"])
