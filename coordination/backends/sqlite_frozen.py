"""The SQL the app's migrations run on SQLite, frozen: a migration is history.

Each step below is what one migration step ran on a fresh database when these
copies were taken, byte for byte, so that editing today's triggers (in
:mod:`coordination.backends.sqlite`) never changes what an old migration does.
Never edit a copy. SQLite drops a table's triggers when a later migration
rebuilds it: the ``post_migrate`` receiver puts today's back
(:func:`coordination.backends.triggers.install_after_migrate`).
"""

# ruff: noqa: E501

from collections.abc import Mapping

from .dialect import FrozenSQL

LOCK_NOT_LOWERED = 'CREATE TRIGGER "coordination_lock_watermark_not_lowered" BEFORE UPDATE OF "token" ON "coordination_lock" FOR EACH ROW WHEN NEW."token" < OLD."token" BEGIN SELECT RAISE(ABORT, \'coordination_watermark_not_lowered: UPDATE of coordination_lock would lower the watermark (token); watermarks never go backwards (rule 8 of docs/rules.md)\'); END'

FENCE_NOT_LOWERED = 'CREATE TRIGGER "coordination_fence_watermark_not_lowered" BEFORE UPDATE OF "token", "step" ON "coordination_fence" FOR EACH ROW WHEN (NEW."token", NEW."step") < (OLD."token", OLD."step") BEGIN SELECT RAISE(ABORT, \'coordination_watermark_not_lowered: UPDATE of coordination_fence would lower the watermark (token, step); watermarks never go backwards (rule 8 of docs/rules.md)\'); END'

TOKENFLOOR_NOT_LOWERED = 'CREATE TRIGGER "coordination_tokenfloor_watermark_not_lowered" BEFORE UPDATE OF "token" ON "coordination_tokenfloor" FOR EACH ROW WHEN NEW."token" < OLD."token" BEGIN SELECT RAISE(ABORT, \'coordination_watermark_not_lowered: UPDATE of coordination_tokenfloor would lower the watermark (token); watermarks never go backwards (rule 8 of docs/rules.md)\'); END'

DROP_LOCK_AND_FENCE_TRIGGERS = (
    'DROP TRIGGER IF EXISTS "coordination_lock_watermark_not_lowered"',
    'DROP TRIGGER IF EXISTS "coordination_lock_watermark_must_rise"',
    'DROP TRIGGER IF EXISTS "coordination_lock_watermark_kept"',
    'DROP TRIGGER IF EXISTS "coordination_lock_watermark_restored"',
    'DROP TRIGGER IF EXISTS "coordination_fence_watermark_not_lowered"',
    'DROP TRIGGER IF EXISTS "coordination_fence_watermark_must_rise"',
    'DROP TRIGGER IF EXISTS "coordination_fence_watermark_kept"',
    'DROP TRIGGER IF EXISTS "coordination_fence_watermark_restored"',
)

DROP_TOKENFLOOR_TRIGGERS = (
    'DROP TRIGGER IF EXISTS "coordination_tokenfloor_watermark_not_lowered"',
    'DROP TRIGGER IF EXISTS "coordination_tokenfloor_watermark_must_rise"',
    'DROP TRIGGER IF EXISTS "coordination_tokenfloor_watermark_kept"',
    'DROP TRIGGER IF EXISTS "coordination_tokenfloor_watermark_restored"',
)

MIGRATION_SQL: Mapping[str, FrozenSQL] = {
    "0007_watermark_triggers": FrozenSQL((LOCK_NOT_LOWERED, FENCE_NOT_LOWERED)),
    "0007_watermark_triggers.backwards": FrozenSQL(DROP_LOCK_AND_FENCE_TRIGGERS),
    "0008_token_floor.triggers": FrozenSQL((TOKENFLOOR_NOT_LOWERED,)),
    "0008_token_floor.triggers.backwards": FrozenSQL(DROP_TOKENFLOOR_TRIGGERS),
}
