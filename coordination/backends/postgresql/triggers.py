"""The watermark and tombstone triggers on PostgreSQL (rule 8 of docs/rules.md)."""

from __future__ import annotations

from typing import Any

from ...watermarks import (
    ALL_RULES,
    HIGHEST_STEP,
    KEPT,
    MUST_RISE,
    NOT_LOWERED,
    RESTORED,
    TOMBSTONES,
    Watermark,
    WatermarkTriggers,
    fingerprint,
    sql_literal,
)

# --- watermark triggers (coordination.watermarks) ------------------------------------
#
# One function serves every trigger. It only runs when a trigger's WHEN clause
# has already decided to refuse, so it may take its time to say why: it reads
# the watermark and the primary key through to_jsonb(), named by the trigger's
# arguments (constraint, primary key column, watermark columns).
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
WATERMARK_TRIGGER = (
    "CREATE TRIGGER {name} BEFORE UPDATE{of} ON {table} FOR EACH ROW "
    "WHEN ({condition}) EXECUTE FUNCTION coordination_refuse_watermark({arguments})"
)

# The tombstone functions take the primary key column and the two watermark
# columns as arguments, and read them through to_jsonb(): one function for
# every table. A row's primary key is kept as jsonb renders it as text, the
# same on delete and on insert.
KEEP_WATERMARK_FUNCTION = f"""
CREATE OR REPLACE FUNCTION coordination_keep_watermark() RETURNS trigger
LANGUAGE plpgsql AS $fn$
DECLARE
    before jsonb := to_jsonb(OLD);
BEGIN
    INSERT INTO {TOMBSTONES} AS kept (table_name, row_pk, fence, fence_step, deleted_at)
    VALUES (TG_TABLE_NAME, before ->> TG_ARGV[0], (before ->> TG_ARGV[1])::bigint,
            (before ->> TG_ARGV[2])::bigint, now())
    ON CONFLICT (table_name, row_pk) DO UPDATE
    SET fence = EXCLUDED.fence, fence_step = EXCLUDED.fence_step, deleted_at = EXCLUDED.deleted_at
    WHERE (EXCLUDED.fence, EXCLUDED.fence_step) > (kept.fence, kept.fence_step);
    RETURN NULL;
END
$fn$
"""
# BEFORE INSERT: the row is written with the restored watermark, which an
# INSERT ... RETURNING reads back.
RESTORE_WATERMARK_FUNCTION = f"""
CREATE OR REPLACE FUNCTION coordination_restore_watermark() RETURNS trigger
LANGUAGE plpgsql AS $fn$
DECLARE
    after jsonb := to_jsonb(NEW);
    kept bigint;
BEGIN
    SELECT t.fence INTO kept FROM {TOMBSTONES} t
    WHERE t.table_name = TG_TABLE_NAME AND t.row_pk = after ->> TG_ARGV[0];
    IF kept IS NOT NULL AND ((after ->> TG_ARGV[1])::bigint, (after ->> TG_ARGV[2])::bigint)
            < (kept, {HIGHEST_STEP}) THEN
        NEW := jsonb_populate_record(
            NEW, jsonb_build_object(TG_ARGV[1], kept, TG_ARGV[2], {HIGHEST_STEP})
        );
    END IF;
    RETURN NEW;
END
$fn$
"""
KEEP_WATERMARK_TRIGGER = (
    "CREATE TRIGGER {name} AFTER DELETE ON {table} FOR EACH ROW "
    "WHEN ({old} > (0, 0)) EXECUTE FUNCTION coordination_keep_watermark({arguments})"
)
RESTORE_WATERMARK_TRIGGER = (
    "CREATE TRIGGER {name} BEFORE INSERT ON {table} FOR EACH ROW "
    "EXECUTE FUNCTION coordination_restore_watermark({arguments})"
)
_WATERMARK_FUNCTIONS = {
    NOT_LOWERED: ("coordination_refuse_watermark", REFUSE_WATERMARK_FUNCTION),
    MUST_RISE: ("coordination_refuse_watermark", REFUSE_WATERMARK_FUNCTION),
    KEPT: ("coordination_keep_watermark", KEEP_WATERMARK_FUNCTION),
    RESTORED: ("coordination_restore_watermark", RESTORE_WATERMARK_FUNCTION),
}


class PostgreSQLWatermarkTriggers(WatermarkTriggers):
    """Watermark triggers on PostgreSQL: one PL/pgSQL function per rule, shared by
    every table; a refusal is SQLSTATE 23514 naming the rule as its constraint."""

    restores_before_insert = True

    # The fingerprint of a trigger's definition is kept as its comment: the
    # server only keeps a normalised form of the statement.
    def trigger(self, watermark: Watermark, rule: str) -> str:
        if rule in (KEPT, RESTORED):
            template = KEEP_WATERMARK_TRIGGER if rule == KEPT else RESTORE_WATERMARK_TRIGGER
            return template.format(
                name=self.quote(self.trigger_name(watermark, rule)),
                table=self.quote(watermark.table), old=self.row("OLD", watermark),
                arguments=", ".join(
                    sql_literal(value) for value in (watermark.pk_column, *watermark.columns)
                ),
            )
        arguments = ", ".join(
            sql_literal(value) for value in (rule, watermark.pk_column, *watermark.columns)
        )
        return WATERMARK_TRIGGER.format(
            name=self.quote(self.trigger_name(watermark, rule)), of=self.of(watermark, rule),
            table=self.quote(watermark.table), condition=self.condition(watermark, rule),
            arguments=arguments,
        )

    def existing(self, cursor: Any, table: str) -> dict[str, str]:
        cursor.execute(
            "SELECT t.tgname, coalesce(obj_description(t.oid, 'pg_trigger'), '') FROM pg_trigger t"
            " WHERE t.tgrelid = to_regclass(%s) AND NOT t.tgisinternal",
            [self.quote(table)],
        )
        return dict(cursor.fetchall())

    def create(self, cursor: Any, watermark: Watermark, name: str, sql: str) -> None:
        rule = next(rule for rule in ALL_RULES if self.trigger_name(watermark, rule) == name)
        function, definition = _WATERMARK_FUNCTIONS[rule]
        cursor.execute(
            f"SELECT coalesce(obj_description(to_regprocedure('{function}()'), 'pg_proc'), '')"
        )
        if cursor.fetchone()[0] != fingerprint(definition):
            cursor.execute(definition)
            cursor.execute(
                f"COMMENT ON FUNCTION {function}() IS " + sql_literal(fingerprint(definition))
            )
        cursor.execute(sql)
        cursor.execute(
            f"COMMENT ON TRIGGER {self.quote(name)} ON {self.quote(watermark.table)} IS "
            + sql_literal(fingerprint(sql))
        )

    def drop(self, cursor: Any, watermark: Watermark, name: str) -> None:
        cursor.execute(f"DROP TRIGGER IF EXISTS {self.quote(name)} ON {self.quote(watermark.table)}")


