"""MariaDB (and MySQL, untested): the grant point's stored procedures, the
portable ORM transaction, and the database's own triggers.

``acquire()`` and ``release()`` each ``CALL`` one stored procedure
(:mod:`.procedures`; created by ``migrate``, each migration running its own
frozen copy, :mod:`.frozen`): one round trip, the grant's whole transaction run
by the server, sent on the connection's MySQLdb handle without a cursor.
Renew, revoke, the readers' shared leases and ``acquire_many`` are the ORM
transaction of :mod:`coordination.backends.orm`, which is also the
whole grant point with ``COORDINATION["GRANT_POINT"] = "orm"``: it holds the
key's row with ``SELECT ... FOR UPDATE`` under READ COMMITTED (Django's
isolation on this database; system check ``coordination.E006`` refuses
another). Both decide with the same rule. Waiters poll: the database cannot
announce a release.

Keys, holders and resources compare byte for byte, as on PostgreSQL and
SQLite: after every ``migrate`` the app's tables are converted to
``utf8mb4_bin`` (a server's default collation, ``utf8mb4_general_ci`` on
Debian, would make ``Billing:1`` and ``billing:1`` one lock).

Failure modes: a client paused inside an ORM grant transaction has its session
ended after ``IDLE_BOUND`` seconds (MariaDB's ``idle_transaction_timeout``,
set for that transaction; a procedure's transaction has no client to wait
for); a ``fence()`` block has no such bound (a holder paused inside it keeps
its Fence rows until it wakes or its connection dies, and a waiter's row-lock
wait ends after ``innodb_lock_wait_timeout``). No promotion guard; a JSON
value nests at most 31 levels.

One module per part: :mod:`.procedures` (today's procedures and their
installer), :mod:`.grant_point` (the two grant points), :mod:`.triggers` (the
watermark triggers), :mod:`.dialect` (everything else the app asks of
MariaDB) and :mod:`.frozen` (each migration's own SQL).
"""

from .dialect import COLLATION, MySQLDialect
from .grant_point import MySQLGrantPoint, MySQLOrmGrantPoint
from .procedures import ACQUIRE, ACQUIRE_PROCEDURE, RELEASE, RELEASE_PROCEDURE, install
from .triggers import MySQLWatermarkTriggers

__all__ = [
    "ACQUIRE",
    "ACQUIRE_PROCEDURE",
    "COLLATION",
    "RELEASE",
    "RELEASE_PROCEDURE",
    "MySQLDialect",
    "MySQLGrantPoint",
    "MySQLOrmGrantPoint",
    "MySQLWatermarkTriggers",
    "install",
]
