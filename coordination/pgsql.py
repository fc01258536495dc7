"""The grant point's server-side functions on PostgreSQL.

``acquire()`` and ``release()`` each call one PL/pgSQL function: one round
trip, one transaction (the caller's autocommit statement), and the plans of
the statements inside are cached by the server per connection, with no named
prepared statement a transaction-pooling proxy could lose. Migration 0006
installs them (:func:`install`).

Why the acquire is safe: its upsert (``INSERT ... ON CONFLICT (key) DO
UPDATE ... WHERE <free>``) locks the key's row before it evaluates the WHERE
and the SET, on the latest committed row version, exactly as ``SELECT ... FOR
UPDATE`` would; ``clock_timestamp()`` is therefore read after the row lock is
held. The row lock is kept until the function's transaction commits, so the
token counter and the grant row commit together and whoever holds the row lock
is the only one deciding. In READ COMMITTED every later statement of a
VOLATILE function takes a new snapshot: the grant of the previous token, whose
transaction committed before this one could lock the row, is visible to the
statement that closes it.
"""

from __future__ import annotations

from typing import Any

ACQUIRE_FUNCTION = "coordination_acquire"
RELEASE_FUNCTION = "coordination_release"

# One row, granted or not. Granted: lock_id, token, acquired_at, expires_at,
# grant_id, and the lease this grant took over if it ran out without a
# release (prev_*). Refused: the lock's state, so the caller can say why
# without another round trip (lock_id is NULL for a key never granted).
_ACQUIRE = """
CREATE OR REPLACE FUNCTION coordination_acquire(
    p_key text, p_holder text, p_hash text, p_ttl double precision,
    p_delay double precision, p_ticket bigint, p_max_token bigint,
    OUT granted boolean, OUT lock_id bigint, OUT token bigint, OUT holder text,
    OUT acquired_at timestamptz, OUT expires_at timestamptz, OUT now timestamptz,
    OUT lock_delay double precision, OUT delay_until timestamptz, OUT ahead bigint,
    OUT grant_id bigint, OUT prev_holder text, OUT prev_acquired_at timestamptz,
    OUT prev_expires_at timestamptz
) LANGUAGE plpgsql VOLATILE AS $fn$
BEGIN
    -- Without a ticket (p_ticket = p_max_token) every live ticket of the key is
    -- ahead: nobody barges past fair waiters.
    INSERT INTO {lock} AS l (
        key, token, holder, lease_hash, acquired_at, expires_at, created_at, lock_delay
    )
    SELECT p_key, 1, p_holder, p_hash, c.t, c.t + make_interval(secs => p_ttl), c.t, p_delay
    FROM (SELECT clock_timestamp() AS t) AS c
    WHERE NOT EXISTS (
        SELECT 1 FROM {ticket} AS q
        WHERE q.lock_key = p_key AND q.id < p_ticket AND q.expires_at > clock_timestamp()
    )
    ON CONFLICT (key) DO UPDATE SET
        token = l.token + 1, holder = EXCLUDED.holder, lease_hash = EXCLUDED.lease_hash,
        (acquired_at, expires_at) = (
            SELECT c.t, c.t + make_interval(secs => p_ttl)
            FROM (SELECT clock_timestamp() AS t) AS c
        ),
        lock_delay = EXCLUDED.lock_delay, delay_until = NULL
    WHERE (
            (l.holder = '' AND (l.delay_until IS NULL OR l.delay_until <= clock_timestamp()))
            OR l.expires_at + make_interval(secs => l.lock_delay) <= clock_timestamp()
        )
        AND l.token < p_max_token
    RETURNING l.id, l.token, l.acquired_at, l.expires_at
    INTO lock_id, token, acquired_at, expires_at;

    IF NOT FOUND THEN
        granted := false;
        SELECT l.id, l.token, l.holder, l.expires_at, clock_timestamp(), l.lock_delay,
            l.delay_until,
            (SELECT count(*) FROM {ticket} AS q
             WHERE q.lock_key = p_key AND q.id < p_ticket AND q.expires_at > clock_timestamp())
        INTO lock_id, token, holder, expires_at, now, lock_delay, delay_until, ahead
        FROM (SELECT 1) AS one LEFT JOIN {lock} AS l ON l.key = p_key;
        RETURN;
    END IF;

    granted := true;
    IF token > 1 THEN
        -- Only the current lease's grant is ever open. If the previous one still
        -- is, its lease ran out without a release: close it as expired.
        UPDATE {grant} AS g SET ended_at = g.expires_at, end_reason = 'expired'
        WHERE g.lock_id = coordination_acquire.lock_id
            AND g.token = coordination_acquire.token - 1 AND g.ended_at IS NULL
        RETURNING g.holder, g.acquired_at, g.expires_at
        INTO prev_holder, prev_acquired_at, prev_expires_at;
    END IF;
    INSERT INTO {grant} (lock_id, token, holder, lease_hash, acquired_at, expires_at, end_reason)
    VALUES (lock_id, token, p_holder, p_hash, acquired_at, expires_at, '')
    RETURNING id INTO grant_id;
    IF p_ticket < p_max_token THEN
        DELETE FROM {ticket} AS q WHERE q.id = p_ticket;
    END IF;
END
$fn$
"""

# Release matches the lease by key, token and lease hash, after the row lock
# is held. The grant row's expires_at (moved together with the lock's by renew)
# says whether the lease ran out first. Waiters are notified only if one said
# it waits (wake_until, on the row version this update locked), so releases
# nobody waits for do not queue on the server's single NOTIFY lock. Refused:
# the lock's state, so the caller can say why (lock_id is NULL for a key never
# granted).
_RELEASE = """
CREATE OR REPLACE FUNCTION coordination_release(
    p_key text, p_token bigint, p_hash text, p_notify boolean, p_channel text,
    OUT released boolean, OUT now timestamptz, OUT ended_at timestamptz,
    OUT end_reason text, OUT lock_id bigint, OUT token bigint, OUT holder text,
    OUT lease_hash text, OUT expires_at timestamptz
) LANGUAGE plpgsql VOLATILE AS $fn$
DECLARE
    v_wake_until timestamptz;
BEGIN
    UPDATE {lock} AS l SET holder = '', lease_hash = '', acquired_at = NULL,
        expires_at = NULL,
        delay_until = CASE WHEN l.expires_at <= clock_timestamp()
            THEN l.expires_at + make_interval(secs => l.lock_delay) END
    WHERE l.key = p_key AND l.holder <> '' AND l.token = p_token AND l.lease_hash = p_hash
    RETURNING l.id, clock_timestamp(), l.wake_until INTO lock_id, now, v_wake_until;
    released := FOUND;
    IF NOT released THEN
        SELECT l.id, l.token, l.holder, l.lease_hash, l.expires_at, clock_timestamp()
        INTO lock_id, token, holder, lease_hash, expires_at, now
        FROM (SELECT 1) AS one LEFT JOIN {lock} AS l ON l.key = p_key;
        RETURN;
    END IF;
    UPDATE {grant} AS g SET
        ended_at = LEAST(coordination_release.now, g.expires_at),
        end_reason = CASE WHEN g.expires_at > coordination_release.now
            THEN 'released' ELSE 'expired' END
    WHERE g.lock_id = coordination_release.lock_id AND g.token = p_token
        AND g.ended_at IS NULL
    RETURNING g.ended_at, g.end_reason INTO ended_at, end_reason;
    IF p_notify AND v_wake_until > coordination_release.now THEN
        PERFORM pg_notify(p_channel, p_key);
    END IF;
END
$fn$
"""

FUNCTIONS = (_ACQUIRE, _RELEASE)
DROP = (
    "DROP FUNCTION IF EXISTS coordination_acquire("
    "text, text, text, double precision, double precision, bigint, bigint)",
    "DROP FUNCTION IF EXISTS coordination_release(text, bigint, text, boolean, text)",
)


def install(connection: Any, *, lock: type[Any], grant: type[Any], ticket: type[Any]) -> None:
    """Create the functions on ``connection`` for these models' tables (the
    app's own, or a migration's historical ones). They are dropped first, so
    a later version may change what they return."""
    quote = connection.ops.quote_name
    tables = {
        "lock": quote(lock._meta.db_table),
        "grant": quote(grant._meta.db_table),
        "ticket": quote(ticket._meta.db_table),
    }
    with connection.cursor() as cursor:
        for statement in DROP:
            cursor.execute(statement)
        for template in FUNCTIONS:
            cursor.execute(template.format(**tables))


def install_for_models(connection: Any) -> None:
    """Create the functions for the app's current tables on ``connection``
    (for schemas made without migrations, such as the benchmark's)."""
    from .models import Grant, Lock, Ticket

    install(connection, lock=Lock, grant=Grant, ticket=Ticket)
