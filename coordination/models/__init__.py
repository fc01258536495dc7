"""What the grant point and the fences store, one module per area.

The database enforces what the code assumes: counters and watermarks are
BIGINT NOT NULL DEFAULT 0 with ``>= 0`` checks, a grant's token is unique per
lock, keys are validated. Fence rows are never deleted by the app: their
watermarks are what keeps old tokens from becoming valid again. A Lock row is
deleted only by pruning (:mod:`coordination.pruning`), once unused for long,
in the transaction that raises the token floor above its counter.

- :mod:`.grants`: locks, the token floor, tickets, grants;
- :mod:`.fences`: fences, rejections, accepted writes, idempotency records,
  tombstones, unfenced saves, documents;
- :mod:`.access`: access rules; :mod:`.election`: roles and beat slots;
- :mod:`.jobs`: job policies, their changes, tallies, executions and unique-job claims;
- :mod:`.outbox`: external calls recorded under a fence, sent by the relay;
- :mod:`.ratelimits`: rate keys and their logs of starts.

Every name is importable from here (``from coordination.models import Lock``);
the rules of keys and holders are :mod:`coordination.keys`'.
"""

# The migrations name the field validators by their paths under coordination.models.
from ..keys import (
    HOLDER_MAX_LENGTH,
    KEY_MAX_LENGTH,
    KEY_PATTERN,
    KEY_RULE,
    MAX_TOKEN,
    PATTERN_RULE,
    PATTERN_WILDCARD,
    hash_lease_id,
    key_matches,
    lease_matches,
    validate_holder,
    validate_key,
    validate_key_pattern,
)
from ..keys import (
    _key_field_validator as _key_field_validator,
)
from ..keys import (
    _pattern_field_validator as _pattern_field_validator,
)
from .access import (
    AccessAction,
    AccessRule,
)
from .election import (
    BeatSlot,
    BeatSlotQuerySet,
    Role,
    slot_identity,
)
from .fences import (
    AcceptedWrite,
    Document,
    Fence,
    IdempotencyRecord,
    Rejection,
    RejectionReason,
    Tombstone,
    UnfencedSave,
)
from .grants import (
    DatabaseNow,
    Grant,
    GrantEnd,
    GrantMode,
    GrantQuerySet,
    Lock,
    LockQuerySet,
    LockState,
    Ticket,
    TokenFloor,
    TokenFloorQuerySet,
)
from .jobs import (
    RATE_LIMIT_MAX,
    RATE_PERIOD_MAX,
    RATE_PERIOD_MIN,
    TASK_PATTERN_WILDCARD,
    TASK_RULE,
    Execution,
    ExecutionQuerySet,
    JobOutcome,
    JobPolicy,
    JobPolicyChange,
    JobTally,
    ReportedTask,
    UniqueClaim,
    UniqueScope,
    WhenPaused,
    validate_task_pattern,
)
from .jobs import (
    _task_field_validator as _task_field_validator,
)
from .outbox import (
    OutboxCall,
    OutboxState,
)
from .ratelimits import (
    RATE_BUCKET_MAX_LENGTH,
    RateBucket,
    RateStart,
    render_template,
    template_fields,
)

__all__ = [
    "HOLDER_MAX_LENGTH",
    "KEY_MAX_LENGTH",
    "KEY_PATTERN",
    "KEY_RULE",
    "MAX_TOKEN",
    "PATTERN_RULE",
    "PATTERN_WILDCARD",
    "RATE_BUCKET_MAX_LENGTH",
    "RATE_LIMIT_MAX",
    "RATE_PERIOD_MAX",
    "RATE_PERIOD_MIN",
    "TASK_PATTERN_WILDCARD",
    "TASK_RULE",
    "AcceptedWrite",
    "AccessAction",
    "AccessRule",
    "BeatSlot",
    "BeatSlotQuerySet",
    "DatabaseNow",
    "Document",
    "Execution",
    "ExecutionQuerySet",
    "Fence",
    "Grant",
    "GrantEnd",
    "GrantMode",
    "GrantQuerySet",
    "IdempotencyRecord",
    "JobOutcome",
    "JobPolicy",
    "JobPolicyChange",
    "JobTally",
    "Lock",
    "LockQuerySet",
    "LockState",
    "OutboxCall",
    "OutboxState",
    "RateBucket",
    "RateStart",
    "Rejection",
    "RejectionReason",
    "ReportedTask",
    "Role",
    "Ticket",
    "TokenFloor",
    "TokenFloorQuerySet",
    "Tombstone",
    "UnfencedSave",
    "UniqueClaim",
    "UniqueScope",
    "WhenPaused",
    "hash_lease_id",
    "key_matches",
    "lease_matches",
    "render_template",
    "slot_identity",
    "template_fields",
    "validate_holder",
    "validate_key",
    "validate_key_pattern",
    "validate_task_pattern",
]
