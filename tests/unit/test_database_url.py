"""The site's DATABASE_URL: dj-database-url's forms, and libpq's multi-host form that a
failover cluster (Patroni) is reached by."""

from __future__ import annotations

from pathlib import Path

import pytest

from project.database_url import parse
from tests.unit.test_site_settings import site_settings


def test_a_patroni_multi_host_url_gives_psycopg_the_host_and_port_lists() -> None:
    config = parse("postgres://app@db1:5432,db2:5432/coordination?target_session_attrs=read-write")

    assert config["ENGINE"] == "django.db.backends.postgresql"
    assert (config["HOST"], config["PORT"]) == ("db1,db2", "5432,5432")
    assert (config["USER"], config["NAME"]) == ("app", "coordination")
    assert config["OPTIONS"] == {"target_session_attrs": "read-write"}


def test_hosts_without_a_port_an_ipv6_host_and_a_quoted_password() -> None:
    config = parse("postgresql://app:p%40ss%2Cword@db1,[::1]:5433,db3/coordination?sslmode=require")

    assert config["HOST"] == "db1,::1,db3"
    assert config["PORT"] == ",5433,"  # empty: libpq's default port for that host
    assert config["PASSWORD"] == "p@ss,word"
    assert config["OPTIONS"] == {"sslmode": "require"}


def test_a_host_list_without_any_port_leaves_the_port_to_libpq() -> None:
    assert parse("postgres://db1,db2/coordination")["PORT"] == ""


def test_a_one_host_url_is_dj_database_urls_own_result() -> None:
    import dj_database_url

    for url in ["postgres://app:secret@db1:5432/coordination?sslmode=require", "sqlite:////tmp/site.sqlite3"]:
        assert parse(url, conn_max_age=0) == dj_database_url.parse(url, conn_max_age=0)


@pytest.mark.parametrize(
    ("url", "named"),
    [
        ("mysql://app@db1,db2/coordination", "PostgreSQL"),
        ("postgres://app@db1,:5432/coordination", "host list"),
    ],
)
def test_a_host_list_it_cannot_use_is_refused_naming_the_problem(url: str, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        parse(url)


def test_the_sites_settings_read_a_multi_host_database_url(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    values = site_settings(
        monkeypatch, tmp_path, DJANGO_SECRET_KEY="k" * 50,
        DATABASE_URL="postgres://app@db1:5432,db2:5432/coordination?target_session_attrs=read-write",
    )

    database = values["DATABASES"]["default"]
    assert (database["HOST"], database["PORT"]) == ("db1,db2", "5432,5432")
    assert database["OPTIONS"]["target_session_attrs"] == "read-write"
    assert database["CONN_MAX_AGE"] == 0


@pytest.mark.parametrize(
    "engine", ["django.db.backends.postgresql", "django.db.backends.mysql"]
)
def test_the_demos_workers_get_the_url_of_the_demos_own_database(engine: str) -> None:
    import dj_database_url

    from project.lab.management.commands.coordination_demo import database_url as demo_url

    settings = {"ENGINE": engine, "NAME": "test_coordination", "USER": "app",
                "PASSWORD": "s3cret/+", "HOST": "127.0.0.1", "PORT": 33069}
    parsed = dj_database_url.parse(demo_url(settings))
    assert parsed["ENGINE"] == engine
    assert (parsed["NAME"], parsed["USER"], parsed["PASSWORD"], parsed["HOST"], parsed["PORT"]) == (
        "test_coordination", "app", "s3cret/+", "127.0.0.1", 33069,
    )
