"""The grant point's PL/pgSQL: the acquire, release and failover-guard functions,
the calls that run them, and the constants their errors carry."""

from __future__ import annotations

from typing import Any
from weakref import WeakSet

from ..base import (
    WAKE_UP_CHANNEL,
)

ACQUIRE_FUNCTION = "coordination_acquire"
RELEASE_FUNCTION = "coordination_release"

# One row, granted or not. Granted: lock_id, token, acquired_at, expires_at,
# grant_id, and the lease this grant took over if it ran out without a
# release (prev_*). Refused: the lock's state, so the caller can say why
# without another round trip (lock_id is NULL for a key never granted). Both:
# the token floor the call read.
#
# The token is one above the key's counter and above the token floor (rule 8 of
# docs/rules.md; base.next_token): a key never granted starts at floor + 1.
# {read_floor} is how the floor is read (READ_FLOOR). It is read once, before the upsert, in the call's own
# statement snapshot: a floor committed before the call began is seen; and
# again, after the upsert, when the token is the one above that read (see the
# comment there: a prune raising the floor as it deletes the key's row).
CREATE_ACQUIRE_FUNCTION = """
CREATE OR REPLACE FUNCTION coordination_acquire(
    p_key text, p_holder text, p_hash text, p_ttl double precision,
    p_delay double precision, p_ticket bigint, p_max_token bigint,
    OUT granted boolean, OUT lock_id bigint, OUT token bigint, OUT holder text,
    OUT acquired_at timestamptz, OUT expires_at timestamptz, OUT now timestamptz,
    OUT lock_delay double precision, OUT delay_until timestamptz, OUT ahead bigint,
    OUT grant_id bigint, OUT prev_token bigint, OUT prev_holder text,
    OUT prev_acquired_at timestamptz, OUT prev_expires_at timestamptz,
    OUT token_floor bigint
) LANGUAGE plpgsql VOLATILE AS $fn$
DECLARE
    v_prev bigint;
    v_floor bigint;
BEGIN{guard}
    token_floor := {read_floor};
    -- Without a ticket (p_ticket = p_max_token) every live ticket of the key is
    -- ahead: nobody barges past fair waiters. A floor at the largest token
    -- leaves no token to issue: no row is proposed, so nothing is granted.
    INSERT INTO {lock} AS l (
        key, token, holder, lease_hash, acquired_at, expires_at, created_at, lock_delay
    )
    SELECT p_key, token_floor + 1, p_holder, p_hash, c.t, c.t + make_interval(secs => p_ttl),
        c.t, p_delay
    FROM (SELECT clock_timestamp() AS t) AS c
    WHERE token_floor < p_max_token AND NOT EXISTS (
        SELECT 1 FROM {ticket} AS q
        WHERE q.lock_key = p_key AND q.id < p_ticket AND q.expires_at > clock_timestamp()
    )
    ON CONFLICT (key) DO UPDATE SET
        token = GREATEST(l.token, token_floor) + 1, holder = EXCLUDED.holder,
        lease_hash = EXCLUDED.lease_hash,
        (acquired_at, expires_at) = (
            SELECT c.t, c.t + make_interval(secs => p_ttl)
            FROM (SELECT clock_timestamp() AS t) AS c
        ),
        lock_delay = EXCLUDED.lock_delay, delay_until = NULL
    -- The grant rule (base.grant_refusal): free with no lock-delay running, or
    -- expired with its lock-delay over; below the largest token (the floor is,
    -- or no row was proposed).
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
    -- A token just one above the floor read before the upsert (a key's first
    -- row, or a counter below the floor): read the floor again. A prune
    -- (coordination.pruning) deletes a key's row in the transaction that raises
    -- the floor above its counter; an upsert that found the row gone committed
    -- after that transaction did, so this later statement sees the raised floor
    -- and the token goes above it, never back to a token the key had.
    IF token = token_floor + 1 THEN
        v_floor := {read_floor};
        IF v_floor >= token THEN
            IF v_floor >= p_max_token THEN
                RAISE EXCEPTION 'the token floor is %, the largest token: no token is left for %',
                    v_floor, p_key USING ERRCODE = 'CF001';
            END IF;
            token := v_floor + 1;
            token_floor := v_floor;
            UPDATE {lock} AS l SET token = coordination_acquire.token
            WHERE l.id = coordination_acquire.lock_id;
        END IF;
    END IF;
    -- The key's previous token: token - 1, unless this grant rose to the floor
    -- (token = floor + 1): then it is the key's last grant at or below the
    -- floor, if it has one (the lookup runs only for such grants).
    IF token - 1 > token_floor THEN
        v_prev := token - 1;
    ELSIF token > 1 THEN
        SELECT max(g.token) INTO v_prev FROM {grant} AS g
        WHERE g.lock_id = coordination_acquire.lock_id;
    END IF;
    IF v_prev IS NOT NULL THEN
        -- Only the current lease's grant is ever open. If the previous one still
        -- is, its lease ran out without a release: close it as expired.
        UPDATE {grant} AS g SET ended_at = g.expires_at, end_reason = 'expired'
        WHERE g.lock_id = coordination_acquire.lock_id
            AND g.token = v_prev AND g.ended_at IS NULL
        RETURNING g.token, g.holder, g.acquired_at, g.expires_at
        INTO prev_token, prev_holder, prev_acquired_at, prev_expires_at;
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

# The promotion guard (migration 0012; docs/high-availability.md). With
# asynchronous replication a promoted replica may have missed the last grants of
# the old primary: the same tokens would be issued again. PostgreSQL gives every
# promotion a new timeline, and the grant point records in the token floor's row
# the timeline it last granted on. The first grant on a new timeline, before it
# issues anything, raises the floor past every token the old primary can have
# issued, revokes every lease and closes every Fence row's watermark at the new
# floor, all in the grant's own transaction, holding the floor's row lock, so
# concurrent first grants do it once (the others wait, then find the timeline
# recorded and the raised floor committed).
#
# FAILOVER_MARGIN bounds the grants an old primary can have committed that the
# promoted replica never received (the bound and why it holds:
# docs/high-availability.md). The current timeline is read from the name of the
# WAL file being written (CURRENT_TIMELINE_SQL): one shared-memory read per grant.
FAILOVER_GUARD_FUNCTION = "coordination_failover_guard"
FAILOVER_MARGIN = 1_000_000_000
CREATE_FAILOVER_GUARD_FUNCTION = """
CREATE OR REPLACE FUNCTION coordination_failover_guard(p_margin bigint, p_max_token bigint)
RETURNS void LANGUAGE plpgsql VOLATILE AS $fn$
DECLARE
    v_timeline integer;
    v_recorded integer;
    v_floor bigint;
    v_top bigint;
    v_now timestamptz;
    v_revoked bigint;
BEGIN
    v_timeline := ('x' || left(pg_walfile_name(pg_current_wal_lsn()), 8))::bit(32)::integer;
    SELECT f.timeline INTO v_recorded FROM {floor} AS f WHERE f.id = 1;
    IF NOT FOUND OR v_recorded = v_timeline THEN
        RETURN;
    END IF;
    -- A new timeline (or none recorded yet): decide again under the row lock.
    SELECT f.timeline, f.token INTO v_recorded, v_floor FROM {floor} AS f
    WHERE f.id = 1 FOR UPDATE;
    IF v_recorded = v_timeline THEN
        RETURN;  -- another first grant did it and committed
    END IF;
    IF v_recorded IS NULL THEN
        -- Nothing recorded since the row was made: no grant to have missed.
        UPDATE {floor} AS f SET timeline = v_timeline WHERE f.id = 1;
        RETURN;
    END IF;
    v_now := clock_timestamp();
    SELECT GREATEST(v_floor, COALESCE(max(l.token), 0)) INTO v_top FROM {lock} AS l;
    v_floor := CASE WHEN v_top > p_max_token - p_margin THEN p_max_token
        ELSE v_top + p_margin END;
    -- Every lease ends: its holder may have been granted on the old primary,
    -- and its token is now at or below the floor.
    UPDATE {grant} AS g SET ended_at = LEAST(v_now, g.expires_at),
        end_reason = CASE WHEN g.expires_at > v_now THEN 'revoked' ELSE 'expired' END
    FROM {lock} AS l
    WHERE g.lock_id = l.id AND g.token = l.token AND g.ended_at IS NULL AND l.holder <> '';
    UPDATE {lock} AS l SET holder = '', lease_hash = '', acquired_at = NULL,
        expires_at = NULL,
        delay_until = CASE WHEN l.lock_delay > 0
            THEN v_now + make_interval(secs => l.lock_delay) END
    WHERE l.holder <> '';
    GET DIAGNOSTICS v_revoked = ROW_COUNT;
    -- Every watermark closed at the new floor: no token from before writes again.
    UPDATE {fence} AS w SET token = v_floor, step = p_max_token, updated_at = v_now
    WHERE w.token < v_floor OR (w.token = v_floor AND w.step < p_max_token);
    UPDATE {floor} AS f SET token = v_floor, raised_at = v_now, timeline = v_timeline
    WHERE f.id = 1;
    RAISE LOG 'coordination: promotion to timeline % (from %): token floor raised to %, % leases revoked',
        v_timeline, v_recorded, v_floor, v_revoked;
END
$fn$
"""
GUARD = f"\n    PERFORM {FAILOVER_GUARD_FUNCTION}({FAILOVER_MARGIN}, p_max_token);"

# How the acquire function reads the token floor: its one row, 0 if the row is
# missing (TokenFloor.objects.value() reads it the same way).
READ_FLOOR = "COALESCE((SELECT f.token FROM {floor} AS f WHERE f.id = 1), 0)"
# The timeline the server writes WAL on: the first eight hex digits of the WAL
# file's name (it changes when a promotion ends, before the server accepts
# writes; pg_control_checkpoint() would lag until the first checkpoint).
CURRENT_TIMELINE_SQL = "('x' || left(pg_walfile_name(pg_current_wal_lsn()), 8))::bit(32)::integer"

# Release does not wait for its WAL flush (synchronous_commit off for its own
# transaction, and only when that transaction has written nothing before it: a
# release is never called inside a caller's transaction, and a raw call inside
# one keeps that transaction durable). Losing a release can only leave a lock
# held longer: if the server crashes before the release reaches the disk, the
# lease is live again after recovery and runs to its expiry (the next acquire
# closes its grant as expired). No token, grant or watermark depends on a
# release being durable, and a grant that found the lock released commits after
# the release in the WAL, so flushing that grant flushes the release first. A
# renew stays durable: losing one would shorten a lease its holder believes in.
#
# Release matches the lease by key, token and lease hash, after the row lock
# is held. The grant row's expires_at (moved together with the lock's by renew)
# says whether the lease ran out first. Waiters are notified only if one said
# it waits (wake_until, on the row version this update locked), so releases
# nobody waits for do not queue on the server's single NOTIFY lock. Refused:
# the lock's state, so the caller can say why (lock_id is NULL for a key never
# granted).
CREATE_RELEASE_FUNCTION = """
CREATE OR REPLACE FUNCTION coordination_release(
    p_key text, p_token bigint, p_hash text, p_notify boolean, p_channel text,
    OUT released boolean, OUT now timestamptz, OUT ended_at timestamptz,
    OUT end_reason text, OUT lock_id bigint, OUT token bigint, OUT holder text,
    OUT lease_hash text, OUT expires_at timestamptz
) LANGUAGE plpgsql VOLATILE AS $fn$
DECLARE
    v_wake_until timestamptz;
BEGIN
    IF txid_current_if_assigned() IS NULL THEN
        PERFORM set_config('synchronous_commit', 'off', true);
    END IF;
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

# Today's functions, in the order they are created (the acquire calls the guard).
CREATE_FUNCTIONS = (
    CREATE_FAILOVER_GUARD_FUNCTION,
    CREATE_ACQUIRE_FUNCTION.replace("{read_floor}", READ_FLOOR).replace("{guard}", GUARD),
    CREATE_RELEASE_FUNCTION,
)
DROP_FUNCTIONS = (
    "DROP FUNCTION IF EXISTS coordination_acquire("
    "text, text, text, double precision, double precision, bigint, bigint)",
    "DROP FUNCTION IF EXISTS coordination_release(text, bigint, text, boolean, text)",
    "DROP FUNCTION IF EXISTS coordination_failover_guard(bigint, bigint)",
)

ACQUIRE = f"SELECT * FROM {ACQUIRE_FUNCTION}(%s, %s, %s, %s, %s, %s, %s)"
# A fenced execution's acquire: the same call, and with a grant the execution's
# record, in one statement (one round trip, one transaction: the record shares
# the grant's commit, which the grant waits for anyway). No record without a
# grant; one already there for the grant (none can be: tokens never repeat) is
# kept, so the record never fails the grant.
ACQUIRE_RECORDED = f"""
WITH granted AS MATERIALIZED (
    SELECT * FROM {ACQUIRE_FUNCTION}(%s, %s, %s, %s, %s, %s, %s)
), recorded AS (
    INSERT INTO {{execution}} (
        task, task_id, attempt, worker, lock_key, token, permit_key, cap_permit_key, ttl
    )
    SELECT %s::text, %s::text, %s::integer, %s::text, %s::text, g.token, '', '',
        EXTRACT(EPOCH FROM g.expires_at - g.acquired_at)
    FROM granted AS g WHERE g.granted
    ON CONFLICT (lock_key, token) DO NOTHING
)
SELECT * FROM granted
"""
# The classes of SQLSTATE a refused record raises (a value, a constraint, a
# missing table, column or privilege): the grant is then made without it.
RECORD_REFUSED = ("22", "23", "42")
RELEASE = f"SELECT * FROM {RELEASE_FUNCTION}(%s, %s, %s, %s, %s)"

# A waiter says until when it may wait, before its next attempt; a release
# notifies only while someone may be waiting. The row lock orders this with
# the release's update: either the release sees it, or it committed first and
# the attempt after this sees the lock free.
WAKE_ME = """
UPDATE {lock} SET wake_until = GREATEST(wake_until,
    clock_timestamp() + make_interval(secs => %(seconds)s))
WHERE key = %(key)s
RETURNING 1
"""
NOTIFY = "SELECT pg_notify(%s, %s)"
INSUFFICIENT_PRIVILEGE = "42501"
# The acquire function found the token floor raised to the largest token after
# it created the key's row: nothing was granted (the call rolled back).
FLOOR_EXHAUSTED = "CF001"
UNDEFINED_FUNCTION = "42883"
# A prepared statement the server does not have (26000), or has under the same
# name (42P05): what a transaction-pooling proxy that cannot keep prepared
# statements leads to. Connections that met one prepare nothing more.
# SQLSTATEs of a server that went away or is not the one to write to: class 08
# (connection exception), and shut down / crashed / starting up (57P01-57P03);
# and of a session the server ended for idling in a transaction (25P03) or at
# all (57P05): a client paused inside a grant point transaction.
IDLE_SESSION_ENDED = "25P03"
LOST_SESSION = ("08", "57P01", "57P02", "57P03", "57P05", IDLE_SESSION_ENDED)
_LOST_PREPARED = ("26000", "42P05")
_UNPREPARED: WeakSet[Any] = WeakSet()
IDLE = 0  # psycopg.pq.TransactionStatus.IDLE: no transaction open
LISTEN = f"LISTEN {WAKE_UP_CHANNEL}"

def _sqlstate(error: BaseException) -> str | None:
    return getattr(error.__cause__, "sqlstate", None) or getattr(error, "sqlstate", None)
