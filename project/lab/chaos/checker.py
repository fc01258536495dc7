"""Judge a chaos history against the fencing contract (the rules of docs/rules.md).

Works on the history alone (see :mod:`project.lab.chaos.history`), so it can be
run again later, and tested with hand-made histories::

    python -m project.lab.chaos.checker history.jsonl [--json figures.json]

What it checks:

- **grants**, per key: tokens unique and strictly increasing in grant order (in
  real time: a grant acknowledged before another was asked for has the lower
  token); no two grants live at the same database time unless both are shared
  (readers), so no writer overlaps a reader; every acknowledged grant is in the
  Grant table; the lock's counter is at least every issued token.
- **semaphores** (a ``semaphore`` event names one and its limit): never more
  live permits than the limit at any database time, no slot above it.
- **sets** (``acquire_many`` operations): a granted set has a grant of every
  key it asked for; a refused one left no grant of its holder (all or none).
- **writes**, per resource (a row, a ledger record, a document, an S3 object,
  a Redis key: the resource's prefix names its store): accepted (token, step) pairs are unique and
  linearizable in (token, step) order, so accepted tokens never go down, an equal
  token is accepted only for a later step, and nothing is accepted after a higher
  token was acknowledged; one token is used by one holder only.
- **durability**: the final state equals the last accepted write (or a later
  write whose outcome was unknown), and every acknowledged ledger record exists,
  across PostgreSQL restarts.
- **refusals** are justified by the state at that moment: a stale refusal names a
  watermark some earlier write really set, a duplicate had its twin, a held lock
  had a live grant, a lost lease had ended.
- **monotonic**: sampled counters and watermarks never went backwards.

A run also fails when no stale write was attempted: the faults did not bite.
"""

from __future__ import annotations

import argparse
import datetime as dt
import itertools
import json
import math
import re
import sys
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .history import Event, read_events

__all__ = ["Op", "Report", "Violation", "check", "main"]

INF = math.inf
GRANTS = {"acquire", "acquire_permit"}
"""Operations that acknowledge one grant of one key (a permit's key is its slot)."""
SHARED_HOLDERS = re.compile(r"\d+ shared holders?")
"""How a refusal names the readers holding a key together (coordination.backends.shared)."""
# A watermark at this step was closed, not written: the promotion guard closes
# every Fence row at the raised token floor with the largest step, so that no
# token from before the promotion writes again (docs/high-availability.md).
CLOSED_STEP = 2**63 - 1
WRITE_CHECKS = frozenset({
    "duplicate_accepted", "token_shared", "stale_write_accepted", "unjustified_refusal",
    "lost_write", "final_state",
})
"""The checks of the writes to a resource (their violations name the resource)."""


@dataclass
class Op:
    """One operation, from its invoke and complete events."""

    id: str
    op: str
    worker: str
    invoked: float
    completed: float = INF
    outcome: str = "unknown"
    reason: str = ""
    key: str = ""
    token: int | None = None
    step: int | None = None
    resource: str = ""
    value: Any = None
    result: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.outcome == "ok"

    @property
    def unknown(self) -> bool:
        return self.outcome == "unknown"

    @property
    def position(self) -> tuple[int, int]:
        return (self.token or 0, self.step or 0)


@dataclass
class Violation:
    check: str
    detail: str
    subject: str = ""

    def as_dict(self) -> dict[str, str]:
        return {"check": self.check, "subject": self.subject, "detail": self.detail}


@dataclass
class GrantSpan:
    key: str
    token: int
    holder: str
    acquired_at: dt.datetime
    expires_at: dt.datetime
    ended_at: dt.datetime | None = None
    mode: str = "exclusive"

    @property
    def shared(self) -> bool:
        return self.mode == "shared"

    @property
    def end(self) -> dt.datetime:
        return self.ended_at if self.ended_at is not None else self.expires_at


@dataclass
class Report:
    figures: dict[str, Any]
    violations: list[Violation]

    @property
    def stale_attempts(self) -> int:
        return int(self.figures.get("stale_write_attempts", 0))

    @property
    def passed(self) -> bool:
        """No violation, and the faults made at least one stale write happen."""
        return not self.violations and self.stale_attempts > 0

    def as_dict(self) -> dict[str, Any]:
        return {
            "passed": self.passed,
            **self.figures,
            "violations": [v.as_dict() for v in self.violations],
        }

    def summary(self, limit: int = 20) -> str:
        f = self.figures
        lines = [
            f"operations: {f['operations']}  (by kind: {_fmt(f['operations_by_kind'])})",
            f"ok: {f['ok']}   accepted writes: {f['accepted_writes']}",
            f"refused: {f['refused']}  (by reason: {_fmt(f['refused_by_reason'])})",
            f"unknown outcomes: {f['unknown']}",
            f"faults injected: {f['faults']}  (by kind: {_fmt(f['faults_by_kind'])})",
            f"stale writes attempted: {f['stale_write_attempts']}",
            f"grants checked: {f['grants_checked']}   resources checked: {f['resources_checked']}"
            f"  (by store: {_fmt(f.get('resources_by_store', {}))})",
            f"accepted writes by store: {_fmt(f.get('accepted_writes_by_store', {}))}   "
            f"stale tokens refused by store: {_fmt(f.get('stale_refused_by_store', {}))}",
            f"violations: {len(self.violations)}  (by check: {_fmt(f['violations_by_check'])})",
        ]
        if "failovers" in f:
            lines += [
                f"cluster faults: {f['cluster_faults']}  (by kind: {_fmt(f['cluster_faults_by_kind'])})",
                f"failovers and switchovers: {f['failovers']}  (by fault: {_fmt(f['failovers_by_kind'])})",
                f"unavailability per failover (fault to first grant on the new primary): "
                f"p50 {f['unavailable_p50']} s, p99 {f['unavailable_p99']} s",
                f"tokens skipped by the promotion guard per failover: "
                f"{_span(f['tokens_skipped'])}",
            ]
        for violation in self.violations[:limit]:
            lines.append(f"  - [{violation.check}] {violation.subject}: {violation.detail}")
        if len(self.violations) > limit:
            lines.append(f"  ... and {len(self.violations) - limit} more")
        if not self.violations and self.stale_attempts == 0:
            lines.append("no stale write was attempted: the faults did not bite; the run proves nothing")
        if self.violations:
            lines.append(f"violations by store: {_fmt(f.get('violations_by_store', {}))}")
        lines.append("PASSED" if self.passed else "FAILED")
        return "\n".join(lines)


def _store(resource: str) -> str:
    """The store a resource is in, by its prefix: ``account`` (the Account rows),
    ``ledger``, ``document``, ``s3``, ``redis``."""
    return resource.split(":", 1)[0]


def _span(values: list[int]) -> str:
    return f"{min(values)} to {max(values)} ({len(values)} failovers)" if values else "none"


def _fmt(counts: dict[str, int]) -> str:
    return ", ".join(f"{name} {count}" for name, count in sorted(counts.items())) or "none"


def _time(value: Any) -> dt.datetime | None:
    if value is None or value == "":
        return None
    if isinstance(value, dt.datetime):
        return value
    return dt.datetime.fromisoformat(str(value))


def build_ops(events: Iterable[Event]) -> list[Op]:
    """Pair invoke and complete events into operations."""
    ops: dict[str, Op] = {}
    for event in events:
        kind = event.get("type")
        if kind == "invoke":
            ops[event["id"]] = Op(
                id=event["id"],
                op=event["op"],
                worker=str(event.get("worker", "")),
                invoked=float(event["mono"]),
                key=event.get("key", ""),
                token=event.get("token"),
                step=event.get("step"),
                resource=event.get("resource", ""),
                value=event.get("value"),
            )
        elif kind == "complete" and event.get("id") in ops:
            op = ops[event["id"]]
            op.completed = float(event["mono"])
            op.outcome = event.get("outcome", "unknown")
            op.reason = event.get("reason", "") or ""
            op.result = event
            if not op.key and event.get("key"):
                op.key = str(event["key"])  # a permit: its slot is known once granted
            if op.token is None and event.get("token") is not None:
                op.token = int(event["token"])
            if op.outcome == "unknown":
                op.completed = INF
    return list(ops.values())


def check(events: Sequence[Event]) -> Report:
    """Check a whole history; returns the figures and every violation found."""
    ops = build_ops(events)
    violations: list[Violation] = []
    grants, grant_figures = _check_grants(ops, events, violations)
    _check_semaphores(grants, events, violations)
    _check_sets(ops, events, violations)
    stale_attempts, resources = _check_writes(ops, events, violations)
    _check_lock_refusals(ops, grants, violations)
    _check_monotonic(events, violations)

    faults = Counter(str(e.get("kind")) for e in events if e.get("type") == "fault")
    refused = Counter(op.reason or "unspecified" for op in ops if op.outcome == "refused")
    figures: dict[str, Any] = {
        "operations": len(ops),
        "operations_by_kind": dict(Counter(op.op for op in ops)),
        "ok": sum(op.ok for op in ops),
        "accepted_writes": sum(op.ok for op in ops if op.op == "write"),
        "refused": sum(refused.values()),
        "refused_by_reason": dict(refused),
        "unknown": sum(op.unknown for op in ops),
        "unknown_by_kind": dict(Counter(op.op for op in ops if op.unknown)),
        "faults": sum(faults.values()),
        "faults_by_kind": dict(faults),
        "stale_write_attempts": stale_attempts,
        "grants_checked": grant_figures,
        "resources_checked": resources,
        "resources_by_store": dict(Counter(
            _store(resource) for resource in {op.resource for op in ops if op.op == "write"}
        )),
        "accepted_writes_by_store": dict(Counter(_store(op.resource) for op in ops
                                                 if op.op == "write" and op.ok)),
        "stale_refused_by_store": dict(Counter(_store(op.resource) for op in ops if op.op == "write"
                                               and op.outcome == "refused" and op.reason == "stale_token")),
        # Of the writes' checks (a grant's violation names its key, which may read like a resource).
        "violations_by_store": dict(Counter(_store(v.subject) for v in violations
                                            if v.check in WRITE_CHECKS)),
        "violations": len(violations),
        "violations_by_check": dict(Counter(v.check for v in violations)),
    }
    return Report(figures=figures, violations=violations)


# --- grants ------------------------------------------------------------------


def _check_grants(
    ops: list[Op], events: Sequence[Event], violations: list[Violation]
) -> tuple[dict[str, list[GrantSpan]], int]:
    acquires: dict[str, list[Op]] = defaultdict(list)
    for op in ops:
        if op.op in GRANTS and op.ok and op.token is not None:
            acquires[op.key].append(op)

    for key, granted in acquires.items():
        seen: dict[int, Op] = {}
        for op in granted:
            assert op.token is not None
            if op.token in seen:
                violations.append(Violation(
                    "token_unique", f"token {op.token} granted twice ({seen[op.token].id}, {op.id})", key
                ))
            seen[op.token] = op
        _check_realtime_order(
            sorted(granted, key=lambda op: op.token or 0), "token_order", key, violations,
            lambda op: f"token {op.token}",
        )

    spans = _grant_spans(ops, events)
    rows = [e for e in events if e.get("type") == "grant_row"]
    if rows:
        table: dict[str, dict[int, Event]] = defaultdict(dict)
        for row in rows:
            key, token = row["key"], int(row["token"])
            if token in table[key]:
                violations.append(Violation("token_unique", f"Grant table has token {token} twice", key))
            table[key][token] = row
        for key, granted in acquires.items():
            for op in granted:
                assert op.token is not None
                found = table[key].get(op.token)
                if found is None:
                    violations.append(Violation(
                        "grant_lost",
                        f"acknowledged grant {op.token} ({op.id}) is not in the Grant table", key,
                    ))
                elif found.get("holder") != op.result.get("holder", found.get("holder")) or (
                    op.result.get("acquired_at")
                    and _time(found.get("acquired_at")) != _time(op.result.get("acquired_at"))
                ):
                    violations.append(Violation(
                        "grant_lost",
                        f"grant {op.token} in the Grant table differs from the one acknowledged",
                        key,
                    ))
        for row in [e for e in events if e.get("type") == "lock_row"]:
            issued = max(table[row["key"]], default=0)
            if int(row["token"]) < issued:
                violations.append(Violation(
                    "counter_backwards",
                    f"lock counter {row['token']} is below issued token {issued}", row["key"],
                ))

    checked = 0
    for key, key_spans in spans.items():
        ordered = sorted(key_spans, key=lambda span: span.token)
        checked += len(ordered)
        for earlier, later in itertools.pairwise(ordered):
            if later.acquired_at <= earlier.acquired_at:
                violations.append(Violation(
                    "token_order",
                    f"token {later.token} was granted at {later.acquired_at.isoformat()}, not after "
                    f"token {earlier.token} ({earlier.acquired_at.isoformat()})", key,
                ))
        _check_overlaps(key, ordered, violations)
    return spans, checked


def _check_overlaps(key: str, ordered: list[GrantSpan], violations: list[Violation]) -> None:
    """No grant begins while an earlier one it excludes is live: a writer excludes
    every grant, a reader only writers. ``ordered`` is in token order."""
    last_any: GrantSpan | None = None  # of the earlier grants, the one live longest
    last_writer: GrantSpan | None = None  # the same among the exclusive ones
    for span in ordered:
        blocker = last_writer if span.shared else last_any
        if blocker is not None and span.acquired_at < blocker.end:
            check = "grants_overlap" if span.shared == blocker.shared else "writer_overlaps_readers"
            violations.append(Violation(
                check,
                f"{span.mode} grant {span.token} began at {span.acquired_at.isoformat()} while "
                f"{blocker.mode} grant {blocker.token} was live until {blocker.end.isoformat()}", key,
            ))
        if last_any is None or span.end > last_any.end:
            last_any = span
        if not span.shared and (last_writer is None or span.end > last_writer.end):
            last_writer = span


def _check_semaphores(
    spans: dict[str, list[GrantSpan]], events: Sequence[Event], violations: list[Violation]
) -> None:
    """At most ``limit`` live permits of each semaphore at any database time."""
    for event in events:
        if event.get("type") != "semaphore":
            continue
        name, limit = str(event["name"]), int(event["limit"])
        permits: list[GrantSpan] = []
        for key, key_spans in spans.items():
            base, _, slot = key.rpartition("@")
            if base != name or not slot.isdigit():
                continue
            if not 1 <= int(slot) <= limit:
                violations.append(Violation(
                    "permit_above_limit", f"slot {slot} was granted; the limit is {limit}", name
                ))
            permits.extend(key_spans)
        # A sweep over the permits' starts and ends, an end before a start at the
        # same instant (a lease ending as the next begins is not an overlap).
        changes = sorted(
            [(span.acquired_at, 1) for span in permits] + [(span.end, -1) for span in permits],
            key=lambda change: (change[0], change[1]),
        )
        live = 0
        for moment, change in changes:
            live += change
            if live > limit:
                violations.append(Violation(
                    "permits_above_limit",
                    f"{live} permits were live at {moment.isoformat()}; the limit is {limit}", name,
                ))
                break


def _check_sets(ops: list[Op], events: Sequence[Event], violations: list[Violation]) -> None:
    """A set is granted all or none: every key of a granted set, no key of a refused one."""
    holders_granted: dict[str, set[str]] = defaultdict(set)
    for row in events:
        if row.get("type") == "grant_row":
            holders_granted[str(row.get("holder", ""))].add(str(row["key"]))
    for op in ops:
        if op.op != "acquire_many":
            continue
        asked = set(op.result.get("keys") or [])
        holder = str(op.result.get("holder", ""))
        if op.ok:
            granted = set((op.result.get("grants") or {}).keys())
            if granted != asked:
                violations.append(Violation(
                    "set_partial",
                    f"{op.id}: asked for {sorted(asked)}, granted {sorted(granted)}", holder,
                ))
        elif op.outcome == "refused" and holder and holders_granted.get(holder):
            violations.append(Violation(
                "set_partial",
                f"{op.id}: refused, yet {sorted(holders_granted[holder])} were granted to {holder}",
                holder,
            ))


def _grant_spans(ops: list[Op], events: Sequence[Event]) -> dict[str, list[GrantSpan]]:
    """Each grant's live interval in database time: the Grant table when the history
    has it, completed with what the acquires, renews and releases reported."""
    spans: dict[str, dict[int, GrantSpan]] = defaultdict(dict)
    for op in sorted(ops, key=lambda op: op.invoked):
        if not op.ok or op.token is None:
            continue
        result = op.result
        if op.op in GRANTS:
            acquired, expires = _time(result.get("acquired_at")), _time(result.get("expires_at"))
            if acquired and expires:
                spans[op.key][op.token] = GrantSpan(
                    op.key, op.token, str(result.get("holder", op.worker)), acquired, expires,
                    mode=str(result.get("mode") or "exclusive"),
                )
        span = spans[op.key].get(op.token)
        if span is None:
            continue
        if op.op == "renew" and (expires := _time(result.get("expires_at"))):
            span.expires_at = max(span.expires_at, expires)
        elif op.op == "release" and (ended := _time(result.get("ended_at"))):
            span.ended_at = ended
    for row in events:
        if row.get("type") != "grant_row":
            continue
        acquired, expires = _time(row.get("acquired_at")), _time(row.get("expires_at"))
        assert acquired is not None and expires is not None
        spans[row["key"]][int(row["token"])] = GrantSpan(
            row["key"], int(row["token"]), str(row.get("holder", "")), acquired, expires,
            _time(row.get("ended_at")), mode=str(row.get("mode") or "exclusive"),
        )
    return {key: list(by_token.values()) for key, by_token in spans.items()}


def _check_lock_refusals(
    ops: list[Op], spans: dict[str, list[GrantSpan]], violations: list[Violation]
) -> None:
    for op in ops:
        if op.outcome != "refused" or op.op not in {"acquire", "renew", "release"}:
            continue
        key_spans = spans.get(op.key, [])
        if op.op == "acquire":
            if op.reason != "lock_held":
                violations.append(
                    Violation("unjustified_refusal", f"acquire refused with {op.reason}", op.key)
                )
                continue
            until = _time(op.result.get("expires_at"))
            holder = op.result.get("holder")
            # A group of readers is named by its count: any reader live then.
            readers = SHARED_HOLDERS.fullmatch(str(holder)) is not None
            if until is None or not any(
                (span.shared if readers else span.holder == holder)
                and span.acquired_at < until <= span.expires_at
                for span in key_spans
            ):
                violations.append(Violation(
                    "unjustified_refusal",
                    f"{op.id}: lock_held by {holder} until {op.result.get('expires_at')}, "
                    "but no such grant was live", op.key,
                ))
            continue
        if op.reason != "lease_lost":
            violations.append(Violation("unjustified_refusal", f"{op.op} refused with {op.reason}", op.key))
            continue
        # The database time was read just after the refusal: whatever ended the
        # lease before the decision had happened by then too.
        after = _time(op.result.get("db_time"))
        if after is None:
            continue
        own = [span for span in key_spans if span.token == op.token]
        ended = any(span.end <= after for span in own) or any(
            span.token > (op.token or 0) and span.acquired_at <= after for span in key_spans
        )
        if not ended:
            violations.append(Violation(
                "unjustified_refusal",
                f"{op.id}: {op.op} of token {op.token} refused as lease_lost, but the lease was live "
                f"at {after.isoformat()}", op.key,
            ))


# --- writes ------------------------------------------------------------------


def _check_realtime_order(
    ordered: list[Op], check_name: str, subject: str, violations: list[Violation], describe: Any
) -> list[Op]:
    """Ops must be linearizable in the given (token) order: none may take effect
    after an op later in the order had already been acknowledged. Returns the ops
    that did (one violation each, naming the earliest acknowledged later op)."""
    broken: list[Op] = []
    found: list[Violation] = []
    first_done: Op | None = None  # of the ops later in the order, the first acknowledged
    for op in reversed(ordered):
        if first_done is not None and first_done.completed < op.invoked:
            broken.append(op)
            found.append(Violation(
                check_name,
                f"{describe(op)} ({op.id}, worker {op.worker}) took effect although "
                f"{describe(first_done)} ({first_done.id}, worker {first_done.worker}) had already "
                "been acknowledged",
                subject,
            ))
        if first_done is None or op.completed < first_done.completed:
            first_done = op
    broken.reverse()
    violations.extend(reversed(found))
    return broken


def _check_writes(ops: list[Op], events: Sequence[Event], violations: list[Violation]) -> tuple[int, int]:
    writes: dict[str, list[Op]] = defaultdict(list)
    for op in ops:
        if op.op == "write":
            writes[op.resource].append(op)
    finals = {e["resource"]: e for e in events if e.get("type") == "final"}
    stored: dict[str, dict[tuple[int, int], Any]] = defaultdict(dict)
    stored_resources = set()
    for event in events:
        if event.get("type") == "stored":
            stored[event["resource"]][(int(event["token"]), int(event["step"]))] = event.get("value")
        elif event.get("type") == "stored_resource":
            stored_resources.add(event["resource"])

    # Cluster faults (coordination_chaos --patroni): from the first one on, a
    # Fence row may have been closed by the promotion guard.
    faults_from = min(
        (float(e["mono"]) for e in events if e.get("type") == "cluster_fault"), default=INF
    )
    stale_attempts = 0
    for resource, resource_writes in writes.items():
        accepted = sorted((op for op in resource_writes if op.ok), key=lambda op: op.position)
        maybe = [op for op in resource_writes if op.ok or op.unknown]

        holders: dict[int, str] = {}
        seen: dict[tuple[int, int], Op] = {}
        for op in accepted:
            if op.position in seen:
                violations.append(Violation(
                    "duplicate_accepted",
                    f"token {op.token} step {op.step} accepted twice ({seen[op.position].id}, {op.id})",
                    resource,
                ))
            seen[op.position] = op
            owner = holders.setdefault(op.token or 0, op.worker)
            if owner != op.worker:
                violations.append(Violation(
                    "token_shared", f"token {op.token} wrote from {owner} and {op.worker}", resource
                ))
        broken = _check_realtime_order(
            accepted, "stale_write_accepted", resource, violations,
            lambda op: f"write token {op.token} step {op.step}",
        )
        stale_attempts += len(broken)

        for op in resource_writes:
            if op.outcome != "refused":
                continue
            if op.reason == "stale_token":
                stale_attempts += 1
                watermark = op.result.get("watermark") or [None, None]
                mark = watermark[0]
                closed = watermark[1] == CLOSED_STEP and faults_from < op.completed
                justified = mark is not None and int(mark) > (op.token or 0) and (closed or any(
                    other.token == int(mark) and other.invoked < op.completed for other in maybe
                ))
            elif op.reason == "duplicate_write":
                justified = any(
                    other is not op and other.token == op.token and (other.step or 0) >= (op.step or 0)
                    and other.invoked < op.completed
                    for other in maybe
                )
            elif op.reason == "lease_lost":
                justified = True  # refused locally after a renew or release reported the loss
            else:
                justified = False
            if not justified:
                violations.append(Violation(
                    "unjustified_refusal",
                    f"{op.id}: token {op.token} step {op.step} refused as {op.reason or 'unspecified'} "
                    f"(watermark {op.result.get('watermark')}), but no earlier write explains it",
                    resource,
                ))

        final = finals.get(resource)
        if final is not None:
            _check_final(resource, accepted, resource_writes, final, violations)
        if resource in stored_resources:
            for op in accepted:
                if stored[resource].get(op.position, _MISSING) != op.value:
                    violations.append(Violation(
                        "lost_write",
                        f"acknowledged write token {op.token} step {op.step} ({op.id}) has no stored "
                        "record with its value",
                        resource,
                    ))
    return stale_attempts, len(writes)


_MISSING = object()


def _check_final(
    resource: str, accepted: list[Op], resource_writes: list[Op], final: Event, violations: list[Violation]
) -> None:
    state = (int(final.get("token") or 0), int(final.get("step") or 0))
    value = final.get("value")
    last = accepted[-1] if accepted else None
    # Closed by the promotion guard after the last write: the data is the last
    # write's (an accepted one, or a later one of unknown outcome). A ledger's
    # final value is read at the watermark, so a closed one has none.
    closed = state[1] == CLOSED_STEP and (last is None or state > last.position)
    if closed and (value is None or (last is not None and value == last.value) or any(
        op.unknown and op.value == value and (last is None or op.position > last.position)
        for op in resource_writes
    )):
        return
    if last is not None and state == last.position and value == last.value:
        return
    floor = last.position if last is not None else (0, 0)
    if any(op.unknown and op.position == state and op.value == value and state > floor
           for op in resource_writes):
        return  # a later write whose outcome was unknown did apply
    if last is None and state == (0, 0):
        return
    if last is not None and state < last.position:
        detail = (f"final state token {state[0]} step {state[1]} is older than the last acknowledged "
                  f"write token {last.token} step {last.step} ({last.id}): an acknowledged write was lost")
        check_name = "lost_write"
    else:
        detail = (f"final state token {state[0]} step {state[1]} value {value!r} matches no "
                  f"acknowledged or possible write (last acknowledged: "
                  f"{None if last is None else (last.token, last.step, last.value)})")
        check_name = "lost_write" if last is not None and value != last.value else "final_state"
    violations.append(Violation(check_name, detail, resource))


# --- sampled counters and watermarks ---------------------------------------


def _check_monotonic(events: Sequence[Event], violations: list[Violation]) -> None:
    latest: dict[str, tuple[int, int, float]] = {}
    for event in sorted((e for e in events if e.get("type") == "observe"), key=lambda e: float(e["mono"])):
        name = str(event["object"])
        value = (int(event.get("token") or 0), int(event.get("step") or 0))
        previous = latest.get(name)
        if previous is not None and value < previous[:2]:
            check_name = "counter_backwards" if name.startswith("lock:") else "watermark_backwards"
            violations.append(Violation(
                check_name, f"went from {previous[:2]} back to {value}", name,
            ))
        if previous is None or value >= previous[:2]:
            latest[name] = (*value, float(event["mono"]))


# --- command line ------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Check a coordination chaos history.")
    parser.add_argument("history", help="JSON lines history written by coordination_chaos --history")
    parser.add_argument("--json", dest="json_path", help="write the figures and violations here")
    args = parser.parse_args(argv)
    report = check(list(read_events(args.history)))
    print(report.summary())
    if args.json_path:
        with open(args.json_path, "w", encoding="utf-8") as out:
            json.dump(report.as_dict(), out, indent=2, sort_keys=True)
    return 0 if report.passed else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
