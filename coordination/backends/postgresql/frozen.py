"""The SQL the app's migrations run on PostgreSQL, frozen: a migration is history.

Each step below is what one migration step ran on a fresh database when these
copies were taken, byte for byte, so that editing today's SQL (in
:mod:`coordination.backends.postgresql`) never changes what an old migration
does. Never edit a copy: new SQL comes with a new migration and a new step,
and today's functions are those of the latest step that creates them (a test
checks that ``migrate`` ends with exactly what today's :func:`install` makes).
Copies repeat where migrations re-created the same functions.
"""

# ruff: noqa: E501

from collections.abc import Mapping

from ..dialect import FrozenSQL

DROP_ACQUIRE = 'DROP FUNCTION IF EXISTS coordination_acquire(text, text, text, double precision, double precision, bigint, bigint)'

DROP_RELEASE = 'DROP FUNCTION IF EXISTS coordination_release(text, bigint, text, boolean, text)'

DROP_FAILOVER_GUARD = 'DROP FUNCTION IF EXISTS coordination_failover_guard(bigint, bigint)'

ACQUIRE_WITHOUT_FLOOR = """
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
BEGIN
    token_floor := 0;
    -- Without a ticket (p_ticket = p_max_token) every live ticket of the key is
    -- ahead: nobody barges past fair waiters. A floor at the largest token
    -- leaves no token to issue: no row is proposed, so nothing is granted.
    INSERT INTO "coordination_lock" AS l (
        key, token, holder, lease_hash, acquired_at, expires_at, created_at, lock_delay
    )
    SELECT p_key, token_floor + 1, p_holder, p_hash, c.t, c.t + make_interval(secs => p_ttl),
        c.t, p_delay
    FROM (SELECT clock_timestamp() AS t) AS c
    WHERE token_floor < p_max_token AND NOT EXISTS (
        SELECT 1 FROM "coordination_ticket" AS q
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
            (SELECT count(*) FROM "coordination_ticket" AS q
             WHERE q.lock_key = p_key AND q.id < p_ticket AND q.expires_at > clock_timestamp())
        INTO lock_id, token, holder, expires_at, now, lock_delay, delay_until, ahead
        FROM (SELECT 1) AS one LEFT JOIN "coordination_lock" AS l ON l.key = p_key;
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
        v_floor := 0;
        IF v_floor >= token THEN
            IF v_floor >= p_max_token THEN
                RAISE EXCEPTION 'the token floor is %, the largest token: no token is left for %',
                    v_floor, p_key USING ERRCODE = 'CF001';
            END IF;
            token := v_floor + 1;
            token_floor := v_floor;
            UPDATE "coordination_lock" AS l SET token = coordination_acquire.token
            WHERE l.id = coordination_acquire.lock_id;
        END IF;
    END IF;
    -- The key's previous token: token - 1, unless this grant rose to the floor
    -- (token = floor + 1): then it is the key's last grant at or below the
    -- floor, if it has one (the lookup runs only for such grants).
    IF token - 1 > token_floor THEN
        v_prev := token - 1;
    ELSIF token > 1 THEN
        SELECT max(g.token) INTO v_prev FROM "coordination_grant" AS g
        WHERE g.lock_id = coordination_acquire.lock_id;
    END IF;
    IF v_prev IS NOT NULL THEN
        -- Only the current lease's grant is ever open. If the previous one still
        -- is, its lease ran out without a release: close it as expired.
        UPDATE "coordination_grant" AS g SET ended_at = g.expires_at, end_reason = 'expired'
        WHERE g.lock_id = coordination_acquire.lock_id
            AND g.token = v_prev AND g.ended_at IS NULL
        RETURNING g.token, g.holder, g.acquired_at, g.expires_at
        INTO prev_token, prev_holder, prev_acquired_at, prev_expires_at;
    END IF;
    INSERT INTO "coordination_grant" (lock_id, token, holder, lease_hash, acquired_at, expires_at, end_reason)
    VALUES (lock_id, token, p_holder, p_hash, acquired_at, expires_at, '')
    RETURNING id INTO grant_id;
    IF p_ticket < p_max_token THEN
        DELETE FROM "coordination_ticket" AS q WHERE q.id = p_ticket;
    END IF;
END
$fn$
"""

RELEASE = """
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
    UPDATE "coordination_lock" AS l SET holder = '', lease_hash = '', acquired_at = NULL,
        expires_at = NULL,
        delay_until = CASE WHEN l.expires_at <= clock_timestamp()
            THEN l.expires_at + make_interval(secs => l.lock_delay) END
    WHERE l.key = p_key AND l.holder <> '' AND l.token = p_token AND l.lease_hash = p_hash
    RETURNING l.id, clock_timestamp(), l.wake_until INTO lock_id, now, v_wake_until;
    released := FOUND;
    IF NOT released THEN
        SELECT l.id, l.token, l.holder, l.lease_hash, l.expires_at, clock_timestamp()
        INTO lock_id, token, holder, lease_hash, expires_at, now
        FROM (SELECT 1) AS one LEFT JOIN "coordination_lock" AS l ON l.key = p_key;
        RETURN;
    END IF;
    UPDATE "coordination_grant" AS g SET
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

ACQUIRE_WITH_FLOOR = """
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
BEGIN
    token_floor := COALESCE((SELECT f.token FROM "coordination_tokenfloor" AS f WHERE f.id = 1), 0);
    -- Without a ticket (p_ticket = p_max_token) every live ticket of the key is
    -- ahead: nobody barges past fair waiters. A floor at the largest token
    -- leaves no token to issue: no row is proposed, so nothing is granted.
    INSERT INTO "coordination_lock" AS l (
        key, token, holder, lease_hash, acquired_at, expires_at, created_at, lock_delay
    )
    SELECT p_key, token_floor + 1, p_holder, p_hash, c.t, c.t + make_interval(secs => p_ttl),
        c.t, p_delay
    FROM (SELECT clock_timestamp() AS t) AS c
    WHERE token_floor < p_max_token AND NOT EXISTS (
        SELECT 1 FROM "coordination_ticket" AS q
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
            (SELECT count(*) FROM "coordination_ticket" AS q
             WHERE q.lock_key = p_key AND q.id < p_ticket AND q.expires_at > clock_timestamp())
        INTO lock_id, token, holder, expires_at, now, lock_delay, delay_until, ahead
        FROM (SELECT 1) AS one LEFT JOIN "coordination_lock" AS l ON l.key = p_key;
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
        v_floor := COALESCE((SELECT f.token FROM "coordination_tokenfloor" AS f WHERE f.id = 1), 0);
        IF v_floor >= token THEN
            IF v_floor >= p_max_token THEN
                RAISE EXCEPTION 'the token floor is %, the largest token: no token is left for %',
                    v_floor, p_key USING ERRCODE = 'CF001';
            END IF;
            token := v_floor + 1;
            token_floor := v_floor;
            UPDATE "coordination_lock" AS l SET token = coordination_acquire.token
            WHERE l.id = coordination_acquire.lock_id;
        END IF;
    END IF;
    -- The key's previous token: token - 1, unless this grant rose to the floor
    -- (token = floor + 1): then it is the key's last grant at or below the
    -- floor, if it has one (the lookup runs only for such grants).
    IF token - 1 > token_floor THEN
        v_prev := token - 1;
    ELSIF token > 1 THEN
        SELECT max(g.token) INTO v_prev FROM "coordination_grant" AS g
        WHERE g.lock_id = coordination_acquire.lock_id;
    END IF;
    IF v_prev IS NOT NULL THEN
        -- Only the current lease's grant is ever open. If the previous one still
        -- is, its lease ran out without a release: close it as expired.
        UPDATE "coordination_grant" AS g SET ended_at = g.expires_at, end_reason = 'expired'
        WHERE g.lock_id = coordination_acquire.lock_id
            AND g.token = v_prev AND g.ended_at IS NULL
        RETURNING g.token, g.holder, g.acquired_at, g.expires_at
        INTO prev_token, prev_holder, prev_acquired_at, prev_expires_at;
    END IF;
    INSERT INTO "coordination_grant" (lock_id, token, holder, lease_hash, acquired_at, expires_at, end_reason)
    VALUES (lock_id, token, p_holder, p_hash, acquired_at, expires_at, '')
    RETURNING id INTO grant_id;
    IF p_ticket < p_max_token THEN
        DELETE FROM "coordination_ticket" AS q WHERE q.id = p_ticket;
    END IF;
END
$fn$
"""

FAILOVER_GUARD = """
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
    SELECT f.timeline INTO v_recorded FROM "coordination_tokenfloor" AS f WHERE f.id = 1;
    IF NOT FOUND OR v_recorded = v_timeline THEN
        RETURN;
    END IF;
    -- A new timeline (or none recorded yet): decide again under the row lock.
    SELECT f.timeline, f.token INTO v_recorded, v_floor FROM "coordination_tokenfloor" AS f
    WHERE f.id = 1 FOR UPDATE;
    IF v_recorded = v_timeline THEN
        RETURN;  -- another first grant did it and committed
    END IF;
    IF v_recorded IS NULL THEN
        -- Nothing recorded since the row was made: no grant to have missed.
        UPDATE "coordination_tokenfloor" AS f SET timeline = v_timeline WHERE f.id = 1;
        RETURN;
    END IF;
    v_now := clock_timestamp();
    SELECT GREATEST(v_floor, COALESCE(max(l.token), 0)) INTO v_top FROM "coordination_lock" AS l;
    v_floor := CASE WHEN v_top > p_max_token - p_margin THEN p_max_token
        ELSE v_top + p_margin END;
    -- Every lease ends: its holder may have been granted on the old primary,
    -- and its token is now at or below the floor.
    UPDATE "coordination_grant" AS g SET ended_at = LEAST(v_now, g.expires_at),
        end_reason = CASE WHEN g.expires_at > v_now THEN 'revoked' ELSE 'expired' END
    FROM "coordination_lock" AS l
    WHERE g.lock_id = l.id AND g.token = l.token AND g.ended_at IS NULL AND l.holder <> '';
    UPDATE "coordination_lock" AS l SET holder = '', lease_hash = '', acquired_at = NULL,
        expires_at = NULL,
        delay_until = CASE WHEN l.lock_delay > 0
            THEN v_now + make_interval(secs => l.lock_delay) END
    WHERE l.holder <> '';
    GET DIAGNOSTICS v_revoked = ROW_COUNT;
    -- Every watermark closed at the new floor: no token from before writes again.
    UPDATE "coordination_fence" AS w SET token = v_floor, step = p_max_token, updated_at = v_now
    WHERE w.token < v_floor OR (w.token = v_floor AND w.step < p_max_token);
    UPDATE "coordination_tokenfloor" AS f SET token = v_floor, raised_at = v_now, timeline = v_timeline
    WHERE f.id = 1;
    RAISE LOG 'coordination: promotion to timeline % (from %): token floor raised to %, % leases revoked',
        v_timeline, v_recorded, v_floor, v_revoked;
END
$fn$
"""

ACQUIRE_WITH_GUARD = """
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
BEGIN
    PERFORM coordination_failover_guard(1000000000, p_max_token);
    token_floor := COALESCE((SELECT f.token FROM "coordination_tokenfloor" AS f WHERE f.id = 1), 0);
    -- Without a ticket (p_ticket = p_max_token) every live ticket of the key is
    -- ahead: nobody barges past fair waiters. A floor at the largest token
    -- leaves no token to issue: no row is proposed, so nothing is granted.
    INSERT INTO "coordination_lock" AS l (
        key, token, holder, lease_hash, acquired_at, expires_at, created_at, lock_delay
    )
    SELECT p_key, token_floor + 1, p_holder, p_hash, c.t, c.t + make_interval(secs => p_ttl),
        c.t, p_delay
    FROM (SELECT clock_timestamp() AS t) AS c
    WHERE token_floor < p_max_token AND NOT EXISTS (
        SELECT 1 FROM "coordination_ticket" AS q
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
            (SELECT count(*) FROM "coordination_ticket" AS q
             WHERE q.lock_key = p_key AND q.id < p_ticket AND q.expires_at > clock_timestamp())
        INTO lock_id, token, holder, expires_at, now, lock_delay, delay_until, ahead
        FROM (SELECT 1) AS one LEFT JOIN "coordination_lock" AS l ON l.key = p_key;
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
        v_floor := COALESCE((SELECT f.token FROM "coordination_tokenfloor" AS f WHERE f.id = 1), 0);
        IF v_floor >= token THEN
            IF v_floor >= p_max_token THEN
                RAISE EXCEPTION 'the token floor is %, the largest token: no token is left for %',
                    v_floor, p_key USING ERRCODE = 'CF001';
            END IF;
            token := v_floor + 1;
            token_floor := v_floor;
            UPDATE "coordination_lock" AS l SET token = coordination_acquire.token
            WHERE l.id = coordination_acquire.lock_id;
        END IF;
    END IF;
    -- The key's previous token: token - 1, unless this grant rose to the floor
    -- (token = floor + 1): then it is the key's last grant at or below the
    -- floor, if it has one (the lookup runs only for such grants).
    IF token - 1 > token_floor THEN
        v_prev := token - 1;
    ELSIF token > 1 THEN
        SELECT max(g.token) INTO v_prev FROM "coordination_grant" AS g
        WHERE g.lock_id = coordination_acquire.lock_id;
    END IF;
    IF v_prev IS NOT NULL THEN
        -- Only the current lease's grant is ever open. If the previous one still
        -- is, its lease ran out without a release: close it as expired.
        UPDATE "coordination_grant" AS g SET ended_at = g.expires_at, end_reason = 'expired'
        WHERE g.lock_id = coordination_acquire.lock_id
            AND g.token = v_prev AND g.ended_at IS NULL
        RETURNING g.token, g.holder, g.acquired_at, g.expires_at
        INTO prev_token, prev_holder, prev_acquired_at, prev_expires_at;
    END IF;
    INSERT INTO "coordination_grant" (lock_id, token, holder, lease_hash, acquired_at, expires_at, end_reason)
    VALUES (lock_id, token, p_holder, p_hash, acquired_at, expires_at, '')
    RETURNING id INTO grant_id;
    IF p_ticket < p_max_token THEN
        DELETE FROM "coordination_ticket" AS q WHERE q.id = p_ticket;
    END IF;
END
$fn$
"""

RECORD_TIMELINE = 'UPDATE "coordination_tokenfloor" SET timeline = (\'x\' || left(pg_walfile_name(pg_current_wal_lsn()), 8))::bit(32)::integer WHERE id = 1'

LOCK_FILLFACTOR_80 = 'ALTER TABLE "coordination_lock" SET (fillfactor = 80)'

FENCE_FILLFACTOR_80 = 'ALTER TABLE "coordination_fence" SET (fillfactor = 80)'

LOCK_FILLFACTOR_100 = 'ALTER TABLE "coordination_lock" SET (fillfactor = 100)'

FENCE_FILLFACTOR_100 = 'ALTER TABLE "coordination_fence" SET (fillfactor = 100)'

# The watermark triggers of the app's own tables (0007, 0008).
REFUSE_WATERMARK_FUNCTION = """
CREATE OR REPLACE FUNCTION coordination_refuse_watermark() RETURNS trigger
LANGUAGE plpgsql AS $fn$
DECLARE
    before jsonb := to_jsonb(OLD);
    after jsonb := to_jsonb(NEW);
    columns text[] := TG_ARGV[2:TG_NARGS - 1];
    old_mark jsonb;
    new_mark jsonb;
    old_shown text;
    new_shown text;
    shown text;
BEGIN
    SELECT jsonb_agg(before -> u.c ORDER BY u.n), jsonb_agg(after -> u.c ORDER BY u.n)
    INTO old_mark, new_mark FROM unnest(columns) WITH ORDINALITY AS u(c, n);
    -- Shown as the comparison reads them: 5, or the row (2, 1).
    old_shown := CASE WHEN TG_NARGS = 3 THEN old_mark ->> 0
        ELSE translate(old_mark::text, '[]', '()') END;
    new_shown := CASE WHEN TG_NARGS = 3 THEN new_mark ->> 0
        ELSE translate(new_mark::text, '[]', '()') END;
    shown := format('%s: UPDATE of %s pk %s', TG_ARGV[0], TG_TABLE_NAME, before ->> TG_ARGV[1]);
    RAISE EXCEPTION USING
        ERRCODE = 'check_violation',
        CONSTRAINT = TG_ARGV[0],
        SCHEMA = TG_TABLE_SCHEMA,
        TABLE = TG_TABLE_NAME,
        MESSAGE = CASE WHEN TG_ARGV[0] = 'coordination_watermark_must_rise' THEN format(
            '%s leaves the watermark (%s) at %s; the table is fenced strictly, so every '
            'UPDATE must raise it (fenced_update or fenced_save)',
            shown, array_to_string(columns, ', '), old_shown)
        ELSE format(
            '%s would lower the watermark (%s) from %s to %s; watermarks never go backwards '
            '(rule 8 of docs/rules.md)',
            shown, array_to_string(columns, ', '), old_shown, new_shown)
        END,
        DETAIL = jsonb_build_object(
            'table', TG_TABLE_NAME, 'pk', before -> TG_ARGV[1], 'columns', to_jsonb(columns),
            'old', old_mark, 'new', new_mark
        )::text;
END
$fn$
"""

REFUSE_WATERMARK_FUNCTION_COMMENT = "COMMENT ON FUNCTION coordination_refuse_watermark() IS 'coordination 1dd7feb16d7213c8'"

LOCK_NOT_LOWERED = 'CREATE TRIGGER "coordination_lock_watermark_not_lowered" BEFORE UPDATE OF "token" ON "coordination_lock" FOR EACH ROW WHEN (NEW."token" < OLD."token") EXECUTE FUNCTION coordination_refuse_watermark(\'coordination_watermark_not_lowered\', \'id\', \'token\')'

LOCK_NOT_LOWERED_COMMENT = 'COMMENT ON TRIGGER "coordination_lock_watermark_not_lowered" ON "coordination_lock" IS \'coordination c15e318f5cf616fa\''

FENCE_NOT_LOWERED = 'CREATE TRIGGER "coordination_fence_watermark_not_lowered" BEFORE UPDATE OF "token", "step" ON "coordination_fence" FOR EACH ROW WHEN ((NEW."token", NEW."step") < (OLD."token", OLD."step")) EXECUTE FUNCTION coordination_refuse_watermark(\'coordination_watermark_not_lowered\', \'id\', \'token\', \'step\')'

FENCE_NOT_LOWERED_COMMENT = 'COMMENT ON TRIGGER "coordination_fence_watermark_not_lowered" ON "coordination_fence" IS \'coordination c11e7436ae0c417a\''

TOKENFLOOR_NOT_LOWERED = 'CREATE TRIGGER "coordination_tokenfloor_watermark_not_lowered" BEFORE UPDATE OF "token" ON "coordination_tokenfloor" FOR EACH ROW WHEN (NEW."token" < OLD."token") EXECUTE FUNCTION coordination_refuse_watermark(\'coordination_watermark_not_lowered\', \'id\', \'token\')'

TOKENFLOOR_NOT_LOWERED_COMMENT = 'COMMENT ON TRIGGER "coordination_tokenfloor_watermark_not_lowered" ON "coordination_tokenfloor" IS \'coordination ff808f09f294a95c\''

DROP_LOCK_AND_FENCE_TRIGGERS = (
    'DROP TRIGGER IF EXISTS "coordination_lock_watermark_not_lowered" ON "coordination_lock"',
    'DROP TRIGGER IF EXISTS "coordination_lock_watermark_must_rise" ON "coordination_lock"',
    'DROP TRIGGER IF EXISTS "coordination_lock_watermark_kept" ON "coordination_lock"',
    'DROP TRIGGER IF EXISTS "coordination_lock_watermark_restored" ON "coordination_lock"',
    'DROP TRIGGER IF EXISTS "coordination_fence_watermark_not_lowered" ON "coordination_fence"',
    'DROP TRIGGER IF EXISTS "coordination_fence_watermark_must_rise" ON "coordination_fence"',
    'DROP TRIGGER IF EXISTS "coordination_fence_watermark_kept" ON "coordination_fence"',
    'DROP TRIGGER IF EXISTS "coordination_fence_watermark_restored" ON "coordination_fence"',
)

DROP_TOKENFLOOR_TRIGGERS = (
    'DROP TRIGGER IF EXISTS "coordination_tokenfloor_watermark_not_lowered" ON "coordination_tokenfloor"',
    'DROP TRIGGER IF EXISTS "coordination_tokenfloor_watermark_must_rise" ON "coordination_tokenfloor"',
    'DROP TRIGGER IF EXISTS "coordination_tokenfloor_watermark_kept" ON "coordination_tokenfloor"',
    'DROP TRIGGER IF EXISTS "coordination_tokenfloor_watermark_restored" ON "coordination_tokenfloor"',
)

DROP_FUNCTIONS = (DROP_ACQUIRE, DROP_RELEASE, DROP_FAILOVER_GUARD)

MIGRATION_SQL: Mapping[str, FrozenSQL] = {
    "0007_watermark_triggers": FrozenSQL((
        REFUSE_WATERMARK_FUNCTION, REFUSE_WATERMARK_FUNCTION_COMMENT,
        LOCK_NOT_LOWERED, LOCK_NOT_LOWERED_COMMENT, FENCE_NOT_LOWERED, FENCE_NOT_LOWERED_COMMENT,
    )),
    "0007_watermark_triggers.backwards": FrozenSQL(DROP_LOCK_AND_FENCE_TRIGGERS),
    "0008_token_floor.triggers": FrozenSQL((TOKENFLOOR_NOT_LOWERED, TOKENFLOOR_NOT_LOWERED_COMMENT)),
    "0008_token_floor.triggers.backwards": FrozenSQL(DROP_TOKENFLOOR_TRIGGERS),
    "0006_grant_point_functions": FrozenSQL(
        (*DROP_FUNCTIONS, ACQUIRE_WITHOUT_FLOOR, RELEASE), functions=True
    ),
    "0006_grant_point_functions.backwards": FrozenSQL(DROP_FUNCTIONS),
    "0008_token_floor": FrozenSQL((*DROP_FUNCTIONS, ACQUIRE_WITH_FLOOR, RELEASE), functions=True),
    "0008_token_floor.backwards": FrozenSQL(
        (*DROP_FUNCTIONS, ACQUIRE_WITHOUT_FLOOR, RELEASE), functions=True
    ),
    "0011_acquire_rereads_floor": FrozenSQL(
        (*DROP_FUNCTIONS, ACQUIRE_WITH_FLOOR, RELEASE), functions=True
    ),
    # The timeline is recorded only where the functions were created.
    "0012_failover_guard": FrozenSQL(
        (*DROP_FUNCTIONS, FAILOVER_GUARD, ACQUIRE_WITH_GUARD, RELEASE, RECORD_TIMELINE),
        functions=True,
    ),
    "0012_failover_guard.backwards": FrozenSQL(
        (*DROP_FUNCTIONS, ACQUIRE_WITH_FLOOR, RELEASE), functions=True
    ),
    "0014_release_without_flush_wait": FrozenSQL(
        (*DROP_FUNCTIONS, FAILOVER_GUARD, ACQUIRE_WITH_GUARD, RELEASE), functions=True
    ),
    "0015_room_for_updates_in_place": FrozenSQL((LOCK_FILLFACTOR_80, FENCE_FILLFACTOR_80)),
    "0015_room_for_updates_in_place.backwards": FrozenSQL(
        (LOCK_FILLFACTOR_100, FENCE_FILLFACTOR_100)
    ),
}
