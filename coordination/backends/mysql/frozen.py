"""The SQL the app's migrations run on MariaDB, frozen: a migration is history.

Each step below is what one migration step ran on a fresh database when these
copies were taken, byte for byte, so that editing today's SQL (in
:mod:`coordination.backends.mysql.procedures`) never changes what an old
migration does. Never edit a copy: new SQL comes with a new migration and a new
step, and today's procedures are those of the latest step that creates them (a
test checks that ``migrate`` ends with exactly what today's :func:`install` makes).
"""

from collections.abc import Mapping

from ..dialect import FrozenSQL

DROP_ACQUIRE = 'DROP PROCEDURE IF EXISTS coordination_acquire'

DROP_RELEASE = 'DROP PROCEDURE IF EXISTS coordination_release'

ACQUIRE = """
CREATE PROCEDURE coordination_acquire(
    IN p_key VARCHAR(200) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin,
    IN p_holder VARCHAR(200) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin,
    IN p_hash VARCHAR(64) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin,
    IN p_ttl DOUBLE, IN p_delay DOUBLE, IN p_ticket BIGINT, IN p_max_token BIGINT
) MODIFIES SQL DATA
body: BEGIN
    DECLARE v_own BOOLEAN DEFAULT @@autocommit = 1;
    DECLARE v_id BIGINT DEFAULT NULL;
    DECLARE v_token BIGINT DEFAULT 0;
    DECLARE v_holder VARCHAR(200) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin DEFAULT '';
    DECLARE v_acquired DATETIME(6) DEFAULT NULL;
    DECLARE v_expires DATETIME(6) DEFAULT NULL;
    DECLARE v_delay DOUBLE DEFAULT 0;
    DECLARE v_delay_until DATETIME(6) DEFAULT NULL;
    DECLARE v_now DATETIME(6);
    DECLARE v_floor BIGINT;
    DECLARE v_ahead BIGINT;
    DECLARE v_new_token BIGINT;
    DECLARE v_new_expires DATETIME(6);
    DECLARE v_grant_id BIGINT;
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
    row_lock: LOOP
        SELECT l.id, l.token, l.holder, l.acquired_at, l.expires_at, l.lock_delay, l.delay_until
        INTO v_id, v_token, v_holder, v_acquired, v_expires, v_delay, v_delay_until
        FROM `coordination_lock` AS l WHERE l.`key` = p_key FOR UPDATE;
        IF v_id IS NOT NULL THEN LEAVE row_lock; END IF;
        SET v_tries = v_tries + 1;
        IF v_tries > 100 THEN
            SIGNAL SQLSTATE 'HY000' SET MESSAGE_TEXT = 'the lock row keeps disappearing';
        END IF;
        INSERT INTO `coordination_lock` (`key`) VALUES (p_key) ON DUPLICATE KEY UPDATE `key` = VALUES(`key`);
    END LOOP;
    -- The clock, the floor (0 if its row is missing) and the fair queue, read
    -- after the row lock. Without a ticket (p_ticket = p_max_token) every live
    -- ticket is ahead; they are counted only for a refusal's message.
    SELECT UTC_TIMESTAMP(6),
        COALESCE((SELECT f.token FROM `coordination_tokenfloor` AS f WHERE f.id = 1), 0),
        EXISTS (SELECT 1 FROM `coordination_ticket` AS q
            WHERE q.lock_key = p_key AND q.id < p_ticket AND q.expires_at > UTC_TIMESTAMP(6))
    INTO v_now, v_floor, v_ahead;
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
            SELECT COUNT(*) INTO v_ahead FROM `coordination_ticket` AS q
            WHERE q.lock_key = p_key AND q.id < p_ticket AND q.expires_at > v_now;
        END IF;
        IF v_own THEN ROLLBACK; ELSE ROLLBACK TO SAVEPOINT coordination_acquire; END IF;
        SELECT FALSE AS granted, v_id AS lock_id, v_token AS token, v_holder AS holder,
            NULL AS acquired_at, v_expires AS expires_at, v_now AS now,
            v_delay AS lock_delay, v_delay_until AS delay_until, v_ahead AS ahead,
            NULL AS grant_id, NULL AS prev_token, NULL AS prev_holder,
            NULL AS prev_acquired_at, NULL AS prev_expires_at, v_floor AS token_floor;
        LEAVE body;
    END IF;
    IF v_holder <> '' THEN
        -- The previous lease ran out without a release: close it as expired.
        UPDATE `coordination_grant` AS g SET g.ended_at = g.expires_at, g.end_reason = 'expired'
        WHERE g.lock_id = v_id AND g.token = v_token AND g.ended_at IS NULL;
    END IF;
    SET v_new_token = GREATEST(v_token, v_floor) + 1,
        v_new_expires = v_now + INTERVAL ROUND(p_ttl * 1000000) MICROSECOND;
    UPDATE `coordination_lock` SET token = v_new_token, holder = p_holder, lease_hash = p_hash,
        acquired_at = v_now, expires_at = v_new_expires, lock_delay = p_delay, delay_until = NULL
    WHERE id = v_id;
    INSERT INTO `coordination_grant` (lock_id, token, holder, lease_hash, acquired_at, expires_at)
    VALUES (v_id, v_new_token, p_holder, p_hash, v_now, v_new_expires);
    SET v_grant_id = LAST_INSERT_ID();
    IF p_ticket < p_max_token THEN
        DELETE FROM `coordination_ticket` WHERE id = p_ticket;
    END IF;
    IF v_own THEN COMMIT; ELSE RELEASE SAVEPOINT coordination_acquire; END IF;
    SELECT TRUE AS granted, v_id AS lock_id, v_new_token AS token, p_holder AS holder,
        v_now AS acquired_at, v_new_expires AS expires_at, v_now AS now, p_delay AS lock_delay,
        NULL AS delay_until, 0 AS ahead, v_grant_id AS grant_id,
        IF(v_holder <> '', v_token, NULL) AS prev_token,
        IF(v_holder <> '', v_holder, NULL) AS prev_holder,
        IF(v_holder <> '', v_acquired, NULL) AS prev_acquired_at,
        IF(v_holder <> '', v_expires, NULL) AS prev_expires_at, v_floor AS token_floor;
END
"""

RELEASE = """
CREATE PROCEDURE coordination_release(
    IN p_key VARCHAR(200) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin,
    IN p_token BIGINT,
    IN p_hash VARCHAR(64) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin
) MODIFIES SQL DATA
body: BEGIN
    DECLARE v_own BOOLEAN DEFAULT @@autocommit = 1;
    DECLARE v_id BIGINT DEFAULT NULL;
    DECLARE v_token BIGINT DEFAULT NULL;
    DECLARE v_holder VARCHAR(200) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin DEFAULT NULL;
    DECLARE v_hash VARCHAR(64) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin DEFAULT NULL;
    DECLARE v_expires DATETIME(6) DEFAULT NULL;
    DECLARE v_delay DOUBLE DEFAULT 0;
    DECLARE v_now DATETIME(6);
    DECLARE v_expired BOOLEAN;
    DECLARE CONTINUE HANDLER FOR NOT FOUND BEGIN END;
    DECLARE EXIT HANDLER FOR SQLEXCEPTION BEGIN
        IF v_own THEN ROLLBACK; END IF;
        RESIGNAL;
    END;
    IF v_own THEN START TRANSACTION; END IF;
    SELECT l.id, l.token, l.holder, l.lease_hash, l.expires_at, l.lock_delay
    INTO v_id, v_token, v_holder, v_hash, v_expires, v_delay
    FROM `coordination_lock` AS l WHERE l.`key` = p_key FOR UPDATE;
    SET v_now = UTC_TIMESTAMP(6);
    IF v_id IS NULL OR v_holder = '' OR v_token <> p_token OR v_hash <> p_hash THEN
        IF v_own THEN ROLLBACK; END IF;
        SELECT FALSE AS released, v_now AS now, NULL AS ended_at, NULL AS end_reason,
            v_id AS lock_id, v_token AS token, v_holder AS holder, v_hash AS lease_hash,
            v_expires AS expires_at;
        LEAVE body;
    END IF;
    SET v_expired = v_expires <= v_now;
    UPDATE `coordination_grant` AS g
    SET g.ended_at = IF(v_expired, g.expires_at, v_now),
        g.end_reason = IF(v_expired, 'expired', 'released')
    WHERE g.lock_id = v_id AND g.token = v_token AND g.ended_at IS NULL;
    UPDATE `coordination_lock` SET holder = '', lease_hash = '', acquired_at = NULL, expires_at = NULL,
        delay_until = IF(v_expired AND v_delay <> 0,
            v_expires + INTERVAL ROUND(v_delay * 1000000) MICROSECOND, NULL)
    WHERE id = v_id;
    IF v_own THEN COMMIT; END IF;
    SELECT TRUE AS released, v_now AS now, IF(v_expired, v_expires, v_now) AS ended_at,
        IF(v_expired, 'expired', 'released') AS end_reason, v_id AS lock_id, v_token AS token,
        v_holder AS holder, v_hash AS lease_hash, v_expires AS expires_at;
END
"""

# 0027: the key's row, the floor and the fair queue read by one statement; the
# rows returned carry only what the caller reads.
ACQUIRE_ONE_READ = """
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
            COALESCE((SELECT f.token FROM `coordination_tokenfloor` AS f WHERE f.id = 1), 0),
            EXISTS (SELECT 1 FROM `coordination_ticket` AS q
                WHERE q.lock_key = p_key AND q.id < p_ticket AND q.expires_at > UTC_TIMESTAMP(6))
        INTO v_id, v_token, v_holder, v_acquired, v_expires, v_delay, v_delay_until, v_floor, v_ahead
        FROM `coordination_lock` AS l WHERE l.`key` = p_key FOR UPDATE;
        IF v_id IS NOT NULL THEN LEAVE row_lock; END IF;
        SET v_tries = v_tries + 1;
        IF v_tries > 100 THEN
            SIGNAL SQLSTATE 'HY000' SET MESSAGE_TEXT = 'the lock row keeps disappearing';
        END IF;
        INSERT INTO `coordination_lock` (`key`) VALUES (p_key) ON DUPLICATE KEY UPDATE `key` = VALUES(`key`);
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
            SELECT COUNT(*) INTO v_ahead FROM `coordination_ticket` AS q
            WHERE q.lock_key = p_key AND q.id < p_ticket AND q.expires_at > v_now;
        END IF;
        IF v_own THEN ROLLBACK; ELSE ROLLBACK TO SAVEPOINT coordination_acquire; END IF;
        SELECT FALSE, v_token, v_holder, v_expires, v_now, v_delay, v_delay_until, v_ahead,
            v_floor;
        LEAVE body;
    END IF;
    IF v_holder <> '' THEN
        -- The previous lease ran out without a release: close it as expired.
        UPDATE `coordination_grant` AS g SET g.ended_at = g.expires_at, g.end_reason = 'expired'
        WHERE g.lock_id = v_id AND g.token = v_token AND g.ended_at IS NULL;
    END IF;
    SET v_new_token = GREATEST(v_token, v_floor) + 1,
        v_new_expires = v_now + INTERVAL ROUND(p_ttl * 1000000) MICROSECOND;
    UPDATE `coordination_lock` SET token = v_new_token, holder = p_holder, lease_hash = p_hash,
        acquired_at = v_now, expires_at = v_new_expires, lock_delay = p_delay, delay_until = NULL
    WHERE id = v_id;
    INSERT INTO `coordination_grant` (lock_id, token, holder, lease_hash, acquired_at, expires_at)
    VALUES (v_id, v_new_token, p_holder, p_hash, v_now, v_new_expires);
    IF p_ticket < p_max_token THEN
        DELETE FROM `coordination_ticket` WHERE id = p_ticket;
    END IF;
    IF v_own THEN COMMIT; ELSE RELEASE SAVEPOINT coordination_acquire; END IF;
    IF v_holder = '' THEN
        SELECT TRUE, v_new_token, v_now, v_new_expires;
    ELSE
        SELECT TRUE, v_new_token, v_now, v_new_expires, v_token, v_holder, v_acquired, v_expires;
    END IF;
END
"""

RELEASE_NARROW_ROW = """
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
    FROM `coordination_lock` AS l WHERE l.`key` = p_key FOR UPDATE;
    SET v_now = UTC_TIMESTAMP(6);
    IF v_id IS NULL OR v_holder = '' OR v_token <> p_token OR v_hash <> p_hash THEN
        IF v_own THEN ROLLBACK; END IF;
        SELECT FALSE, v_now, v_id, v_token, v_holder, v_hash, v_expires;
        LEAVE body;
    END IF;
    SET v_expired = v_expires <= v_now;
    UPDATE `coordination_grant` AS g
    SET g.ended_at = IF(v_expired, g.expires_at, v_now),
        g.end_reason = IF(v_expired, 'expired', 'released')
    WHERE g.lock_id = v_id AND g.token = v_token AND g.ended_at IS NULL;
    UPDATE `coordination_lock` SET holder = '', lease_hash = '', acquired_at = NULL, expires_at = NULL,
        delay_until = IF(v_expired AND v_delay <> 0,
            v_expires + INTERVAL ROUND(v_delay * 1000000) MICROSECOND, NULL)
    WHERE id = v_id;
    IF v_own THEN COMMIT; END IF;
    SELECT TRUE, IF(v_expired, v_expires, v_now), v_expired;
END
"""

DROP_PROCEDURES = (DROP_ACQUIRE, DROP_RELEASE)

MIGRATION_SQL: Mapping[str, FrozenSQL] = {
    "0025_mariadb_grant_procedures": FrozenSQL(
        (*DROP_PROCEDURES, ACQUIRE, RELEASE), functions=True
    ),
    "0025_mariadb_grant_procedures.backwards": FrozenSQL(DROP_PROCEDURES),
    "0027_mariadb_leaner_grant_procedures": FrozenSQL(
        (*DROP_PROCEDURES, ACQUIRE_ONE_READ, RELEASE_NARROW_ROW), functions=True
    ),
    "0027_mariadb_leaner_grant_procedures.backwards": FrozenSQL(
        (*DROP_PROCEDURES, ACQUIRE, RELEASE), functions=True
    ),
}
