"""The grant a fenced write presents, and the step it numbers its write with."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from ..exceptions import InvalidInput, NoGrant
from ..leases import Lease, current_grant
from ..models import MAX_TOKEN

Grants = Lease | Mapping[str, Lease] | Iterable[Lease]
"""What ``fence()`` takes as its grant: one lease, or several (a list, or the
``{key: lease}`` dict of :func:`coordination.locks.acquire_many`)."""


def resolve_grants(grant: Grants | None) -> list[Lease]:
    """The leases of ``grant``: one, or several of distinct keys."""
    if grant is None or isinstance(grant, Lease):
        return [resolve_grant(grant)]
    leases = list(grant.values()) if isinstance(grant, Mapping) else list(grant)
    if not leases:
        raise InvalidInput("fence() needs at least one grant")
    keys = [lease.key for lease in leases]
    if len(set(keys)) != len(keys):
        raise InvalidInput("fence() takes at most one grant per lock key")
    return [resolve_grant(lease) for lease in leases]


def resolve_grant(grant: Lease | None) -> Lease:
    grant = grant if grant is not None else current_grant()
    if grant is None:
        raise NoGrant()
    token = grant.token
    if isinstance(token, bool) or not isinstance(token, int) or not 0 < token <= MAX_TOKEN:
        raise InvalidInput(f"token must be an integer from 1 to {MAX_TOKEN}")
    return grant


def resolve_step(grant: Lease, step: int | None) -> int:
    if step is None:
        return grant.next_step()
    if isinstance(step, bool) or not isinstance(step, int) or not 0 < step <= MAX_TOKEN:
        raise InvalidInput(f"step must be an integer from 1 to {MAX_TOKEN}")
    return step
