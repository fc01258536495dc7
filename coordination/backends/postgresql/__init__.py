"""The grant point on PostgreSQL: one PL/pgSQL function call per acquire and release.

``acquire()`` and ``release()`` each call one function (today's are those
:func:`install` creates; each migration that created them ran its own frozen
copy, :mod:`.frozen`): one round trip, one
transaction (the call's own autocommit statement), and the plans of the
statements inside are cached by the server per connection, with no named
prepared statement a transaction-pooling proxy could lose. Renew and revoke
are the ORM transaction of :mod:`coordination.backends.orm`.

The acquire's upsert locks the key's row before it decides, and reads the
database clock after that; the token counter and the grant row commit
together (why this is safe: docs/operations.md). Its WHERE is the SQL twin of
:func:`coordination.backends.base.grant_refusal`, and its token is
:func:`~coordination.backends.base.next_token`'s.

Waiters are woken with LISTEN/NOTIFY, by both PostgreSQL backends (this one and
the ORM transaction chosen with ``COORDINATION["GRANT_POINT"] = "orm"``).

One module per part: :mod:`.functions` (the PL/pgSQL and the calls that run
it), :mod:`.install` (creating the functions), :mod:`.grant_point` (the two
grant points), :mod:`.triggers` (the watermark triggers), :mod:`.dialect`
(everything else the app asks of PostgreSQL), :mod:`.calls` (prepared calls
straight to libpq) and :mod:`.frozen` (each migration's own SQL).
"""

from .dialect import PostgreSQLDialect
from .functions import (
    ACQUIRE,
    ACQUIRE_FUNCTION,
    CURRENT_TIMELINE_SQL,
    DROP_FUNCTIONS,
    FAILOVER_GUARD_FUNCTION,
    FAILOVER_MARGIN,
    RELEASE,
    RELEASE_FUNCTION,
)
from .grant_point import PostgreSQLGrantPoint, PostgreSQLOrmGrantPoint
from .install import install, install_for_models, install_if_permitted, leave_room_for_updates
from .triggers import PostgreSQLWatermarkTriggers

__all__ = [
    "ACQUIRE",
    "ACQUIRE_FUNCTION",
    "CURRENT_TIMELINE_SQL",
    "DROP_FUNCTIONS",
    "FAILOVER_GUARD_FUNCTION",
    "FAILOVER_MARGIN",
    "RELEASE",
    "RELEASE_FUNCTION",
    "PostgreSQLDialect",
    "PostgreSQLGrantPoint",
    "PostgreSQLOrmGrantPoint",
    "PostgreSQLWatermarkTriggers",
    "install",
    "install_for_models",
    "install_if_permitted",
    "leave_room_for_updates",
]
