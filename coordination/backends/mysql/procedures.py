"""The grant point's stored procedures on MariaDB: one ``CALL`` per acquire and release.

Each procedure is the ORM transaction of :mod:`coordination.backends.orm` run
inside the server: it opens its own transaction (``@@autocommit`` on, as the
grant point calls it; in a transaction already open, a test's, a savepoint of
it instead, as ``atomic()`` nests), locks the key's row with ``SELECT ... FOR UPDATE``
(creating it first if missing, as ``create_missing`` does), reads the clock
after the row lock, decides, writes the lock and its grant history, commits,
and returns one row. A refusal rolls back, as the ORM transaction's raised
refusal does (a key's row made for it is not kept). The decision is the SQL
twin of :func:`~coordination.backends.base.grant_refusal` and its token
:func:`~coordination.backends.base.next_token`'s; a test checks the two agree
on a grid of lock states and floors.

Each call's transaction is the few statements its guarantees need: an acquire
locks and reads the key's row together with the token floor and the fair
queue, writes the lock row and the grant row (and closes the lease it takes
over); a release locks and reads the row, closes the grant row and frees the
lock row. The row returned carries what the caller uses, no more: a granted
acquire's token and times, or a refusal's reasons. The server, not the client,
runs every statement of the transaction: no client pause can hold its row
locks, so the idle bound (``idle_transaction_timeout``) is not needed around
these calls; a statement the server ends (a deadlock's victim, a lock wait
timeout) rolls the whole transaction back and its error is raised to the
caller.

Keys, holders and lease hashes are ``utf8mb4_bin`` parameters: they compare
with the app's binary columns byte for byte (a parameter in the server's
default collation would make the comparison an error, or case-blind).
"""
from __future__ import annotations

from django.db.backends.base.base import BaseDatabaseWrapper

from ...models import Grant, Lock, Ticket, TokenFloor
from ..base import format_sql

__all__ = [
    "ACQUIRE",
    "ACQUIRE_PROCEDURE",
    "CREATE_PROCEDURES",
    "DROP_PROCEDURES",
    "RELEASE",
    "RELEASE_PROCEDURE",
    "install",
]

ACQUIRE_PROCEDURE = "coordination_acquire"
RELEASE_PROCEDURE = "coordination_release"

# One row, its first column whether the call granted. Granted: the token, the
# lease's start and end, and, if it took over a lease that ran out without a
# release, that lease's token, holder, start and end. Refused: the lock's state
# (a key never granted reads as a free lock at token 0), the clock, how many fair
# waiters are ahead and the token floor, so the caller can say why.
#
# The key's row is read and locked by one statement that also reads the token
# floor and whether a fair waiter is ahead: as on PostgreSQL, a floor raised
# before the call began is seen (a floor raised by a prune that deleted the
# key's row is seen by the read after the row is made again), and a waiter that
# queued while this call waited for the row lock may be passed, as it queued
# after this call began. The clock is read after the row lock.
CREATE_ACQUIRE_PROCEDURE = """
CREATE PROCEDURE coordination_acquire(
    IN p_key VARCHAR(200) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin,
    IN p_holder VARCHAR(200) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin,
    IN p_hash VARCHAR(64) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin,
    IN p_ttl DOUBLE, IN p_delay DOUBLE, IN p_ticket BIGINT, IN p_max_token BIGINT
) MODIFIES SQL DATA
body: BEGIN
    DECLARE v_own BOOLEAN DEFAULT @@autocommit = 1;
    DECLARE v_id, v_token, v_floor, v_ahead, v_new_token BIGINT;
    DECLARE v_holder VARCHAR(200) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin;
    DECLARE v_acquired, v_expires, v_delay_until, v_now, v_new_expires DATETIME(6);
    DECLARE v_delay DOUBLE;
    DECLARE v_tries INT DEFAULT 0;
    DECLARE CONTINUE HANDLER FOR NOT FOUND BEGIN END;
    DECLARE EXIT HANDLER FOR SQLEXCEPTION BEGIN
        IF v_own THEN ROLLBACK; END IF;
        RESIGNAL;
    END;
    IF v_own THEN START TRANSACTION; ELSE SAVEPOINT coordination_acquire; END IF;
    -- The key's row, locked until the end. Racing first acquirers of a key all
    -- insert it without an error (ON DUPLICATE KEY UPDATE takes the row lock,
    -- so they queue on it); a row pruned before it is locked is made again.
    -- Without a ticket (p_ticket = p_max_token) every live ticket is ahead.
    row_lock: LOOP
        SELECT l.id, l.token, l.holder, l.acquired_at, l.expires_at, l.lock_delay, l.delay_until,
            COALESCE((SELECT f.token FROM {floor} AS f WHERE f.id = 1), 0),
            EXISTS (SELECT 1 FROM {ticket} AS q
                WHERE q.lock_key = p_key AND q.id < p_ticket AND q.expires_at > UTC_TIMESTAMP(6))
        INTO v_id, v_token, v_holder, v_acquired, v_expires, v_delay, v_delay_until, v_floor, v_ahead
        FROM {lock} AS l WHERE l.`key` = p_key FOR UPDATE;
        IF v_id IS NOT NULL THEN LEAVE row_lock; END IF;
        SET v_tries = v_tries + 1;
        IF v_tries > 100 THEN
            SIGNAL SQLSTATE 'HY000' SET MESSAGE_TEXT = 'the lock row keeps disappearing';
        END IF;
        INSERT INTO {lock} (`key`) VALUES (p_key) ON DUPLICATE KEY UPDATE `key` = VALUES(`key`);
    END LOOP;
    SET v_now = UTC_TIMESTAMP(6);
    -- The grant rule (base.grant_refusal): no lease runs, no lock-delay runs, no
    -- fair waiter is ahead, a token is left above the counter and the floor.
    IF NOT (
        IF(v_holder <> '',
            v_expires <= v_now AND (v_delay = 0
                OR v_expires + INTERVAL ROUND(v_delay * 1000000) MICROSECOND <= v_now),
            v_delay_until IS NULL OR v_delay_until <= v_now)
        AND v_ahead = 0 AND v_token < p_max_token AND v_floor < p_max_token
    ) THEN
        IF v_ahead THEN
            -- Counted for the refusal's message, by the clock read after the row lock.
            SELECT COUNT(*) INTO v_ahead FROM {ticket} AS q
            WHERE q.lock_key = p_key AND q.id < p_ticket AND q.expires_at > v_now;
        END IF;
        IF v_own THEN ROLLBACK; ELSE ROLLBACK TO SAVEPOINT coordination_acquire; END IF;
        SELECT FALSE, v_token, v_holder, v_expires, v_now, v_delay, v_delay_until, v_ahead,
            v_floor;
        LEAVE body;
    END IF;
    IF v_holder <> '' THEN
        -- The previous lease ran out without a release: close it as expired.
        UPDATE {grant} AS g SET g.ended_at = g.expires_at, g.end_reason = 'expired'
        WHERE g.lock_id = v_id AND g.token = v_token AND g.ended_at IS NULL;
    END IF;
    SET v_new_token = GREATEST(v_token, v_floor) + 1,
        v_new_expires = v_now + INTERVAL ROUND(p_ttl * 1000000) MICROSECOND;
    UPDATE {lock} SET token = v_new_token, holder = p_holder, lease_hash = p_hash,
        acquired_at = v_now, expires_at = v_new_expires, lock_delay = p_delay, delay_until = NULL
    WHERE id = v_id;
    INSERT INTO {grant} (lock_id, token, holder, lease_hash, acquired_at, expires_at)
    VALUES (v_id, v_new_token, p_holder, p_hash, v_now, v_new_expires);
    IF p_ticket < p_max_token THEN
        DELETE FROM {ticket} WHERE id = p_ticket;
    END IF;
    IF v_own THEN COMMIT; ELSE RELEASE SAVEPOINT coordination_acquire; END IF;
    IF v_holder = '' THEN
        SELECT TRUE, v_new_token, v_now, v_new_expires;
    ELSE
        SELECT TRUE, v_new_token, v_now, v_new_expires, v_token, v_holder, v_acquired, v_expires;
    END IF;
END
"""

# One row, its first column whether the call released. Released (the current
# lease, live or run out): when its grant ended and whether it had expired.
# Refused: the clock and the lock's state (its id NULL for a key never granted),
# so the caller can say why. A current lease that ran out is ended as expired at
# its end, and its lock-delay runs from there, as the ORM transaction ends it.
CREATE_RELEASE_PROCEDURE = """
CREATE PROCEDURE coordination_release(
    IN p_key VARCHAR(200) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin,
    IN p_token BIGINT,
    IN p_hash VARCHAR(64) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin
) MODIFIES SQL DATA
body: BEGIN
    DECLARE v_own BOOLEAN DEFAULT @@autocommit = 1;
    DECLARE v_id, v_token BIGINT;
    DECLARE v_holder VARCHAR(200) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin;
    DECLARE v_hash VARCHAR(64) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin;
    DECLARE v_expires, v_now DATETIME(6);
    DECLARE v_delay DOUBLE;
    DECLARE v_expired BOOLEAN;
    DECLARE CONTINUE HANDLER FOR NOT FOUND BEGIN END;
    DECLARE EXIT HANDLER FOR SQLEXCEPTION BEGIN
        IF v_own THEN ROLLBACK; END IF;
        RESIGNAL;
    END;
    IF v_own THEN START TRANSACTION; END IF;
    SELECT l.id, l.token, l.holder, l.lease_hash, l.expires_at, l.lock_delay
    INTO v_id, v_token, v_holder, v_hash, v_expires, v_delay
    FROM {lock} AS l WHERE l.`key` = p_key FOR UPDATE;
    SET v_now = UTC_TIMESTAMP(6);
    IF v_id IS NULL OR v_holder = '' OR v_token <> p_token OR v_hash <> p_hash THEN
        IF v_own THEN ROLLBACK; END IF;
        SELECT FALSE, v_now, v_id, v_token, v_holder, v_hash, v_expires;
        LEAVE body;
    END IF;
    SET v_expired = v_expires <= v_now;
    UPDATE {grant} AS g
    SET g.ended_at = IF(v_expired, g.expires_at, v_now),
        g.end_reason = IF(v_expired, 'expired', 'released')
    WHERE g.lock_id = v_id AND g.token = v_token AND g.ended_at IS NULL;
    UPDATE {lock} SET holder = '', lease_hash = '', acquired_at = NULL, expires_at = NULL,
        delay_until = IF(v_expired AND v_delay <> 0,
            v_expires + INTERVAL ROUND(v_delay * 1000000) MICROSECOND, NULL)
    WHERE id = v_id;
    IF v_own THEN COMMIT; END IF;
    SELECT TRUE, IF(v_expired, v_expires, v_now), v_expired;
END
"""

CREATE_PROCEDURES = (CREATE_ACQUIRE_PROCEDURE, CREATE_RELEASE_PROCEDURE)
DROP_PROCEDURES = (
    f"DROP PROCEDURE IF EXISTS {ACQUIRE_PROCEDURE}",
    f"DROP PROCEDURE IF EXISTS {RELEASE_PROCEDURE}",
)

ACQUIRE = f"CALL {ACQUIRE_PROCEDURE}(%s, %s, %s, %s, %s, %s, %s)"
RELEASE = f"CALL {RELEASE_PROCEDURE}(%s, %s, %s)"

APP_TABLES = {"lock": Lock, "grant": Grant, "ticket": Ticket, "floor": TokenFloor}


def install(connection: BaseDatabaseWrapper) -> None:
    """Create today's procedures on ``connection`` for the app's tables (the latest
    migration that creates them runs the same SQL, frozen), dropping them first.
    Reads no settings."""
    with connection.cursor() as cursor:
        for statement in DROP_PROCEDURES:
            cursor.execute(statement)
        for template in CREATE_PROCEDURES:
            cursor.execute(format_sql(template, connection, tables=APP_TABLES))
