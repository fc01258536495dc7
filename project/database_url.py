"""The site's ``DATABASE_URL``, including libpq's multi-host form.

A PostgreSQL deployment with failover (Patroni, a managed service's replicas)
names every node and lets libpq pick the primary::

    postgres://app@db1:5432,db2:5432,db3:5432/coordination?target_session_attrs=read-write

dj-database-url reads one host only and refuses this form. It stays the parser
of everything else (user, password, database, query options): the host list is
taken out of the URL first and put back as the comma-separated ``HOST`` and
``PORT`` that psycopg hands to libpq, which tries the hosts in order and, with
``target_session_attrs=read-write`` (kept in ``OPTIONS``), keeps the one that
accepts writes.
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import unquote

import dj_database_url

__all__ = ["parse"]

# scheme://[userinfo@]hostlist[/path][?query][#fragment]
_URL = re.compile(
    r"^(?P<scheme>[^:/?#]+://)(?:(?P<userinfo>[^@/?#]*)@)?(?P<hosts>[^/?#]*)(?P<rest>.*)$", re.DOTALL
)
# One host of the list: a name, an IPv4 address or a bracketed IPv6 address, and an optional port.
_HOST = re.compile(r"^(?P<host>\[[^\]]*\]|[^:\[\]]*)(?::(?P<port>\d*))?$")
_PLACEHOLDER = "multi-host.invalid"


def parse(url: str, **options: Any) -> dict[str, Any]:
    """``DATABASES["default"]`` for ``url``; ``options`` go to ``dj_database_url.parse``.

    A URL with one host is dj-database-url's result unchanged. With several
    (``h1:5432,h2:5433``) ``HOST`` and ``PORT`` are the comma-separated lists
    (an empty port is libpq's default for that host). Raises ValueError for a
    host list on an engine other than PostgreSQL, or a malformed host.
    """
    match = _URL.match(url)
    if match is None or "," not in match["hosts"]:
        return dict(dj_database_url.parse(url, **options))
    hosts: list[str] = []
    ports: list[str] = []
    for item in match["hosts"].split(","):
        part = _HOST.match(item)
        if part is None or not part["host"]:
            raise ValueError(f"DATABASE_URL: {item!r} in the host list is not host[:port]")
        hosts.append(unquote(part["host"].strip("[]")))
        ports.append(part["port"] or "")
    userinfo = f"{match['userinfo']}@" if match["userinfo"] is not None else ""
    one_host = f"{match['scheme']}{userinfo}{_PLACEHOLDER}{match['rest']}"
    config = dict(dj_database_url.parse(one_host, **options))
    if config["ENGINE"] != "django.db.backends.postgresql":
        raise ValueError(
            f"DATABASE_URL: a list of hosts is libpq's (PostgreSQL) form; {config['ENGINE']} takes one host"
        )
    config["HOST"] = ",".join(hosts)
    config["PORT"] = ",".join(ports) if any(ports) else ""
    return config
