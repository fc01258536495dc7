"""The chaos checker on hand-made histories, one per kind of violation, so a
passing chaos run means something: the checker provably notices each violation.
The real runs are in tests/processes/test_chaos.py."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

from project.lab.chaos import checker
from project.lab.chaos.history import HistoryWriter, merge, read_events

T0 = "2026-01-01T00:00:{:06.3f}+00:00"


def db_time(second: float) -> str:
    return T0.format(second)


class History:
    """Builds a history by hand: operations with invoke and completion times."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self.ids = itertools.count(1)

    def op(
        self, op: str, worker: str, invoked: float, completed: float | None, outcome: str = "ok",
        reason: str = "", result: dict[str, Any] | None = None, **fields: Any,
    ) -> History:
        op_id = f"{worker}-{next(self.ids)}"
        self.events.append({"type": "invoke", "id": op_id, "op": op, "worker": worker, "mono": invoked,
                            **fields})
        if completed is not None:
            self.events.append({"type": "complete", "id": op_id, "outcome": outcome, "reason": reason,
                                "mono": completed, **(result or {})})
        return self

    def acquire(self, worker: str, key: str, token: int, invoked: float, completed: float,
                lease: tuple[float, float]) -> History:
        return self.op("acquire", worker, invoked, completed, key=key, result={
            "token": token, "holder": worker,
            "acquired_at": db_time(lease[0]), "expires_at": db_time(lease[1]),
        })

    def write(self, worker: str, resource: str, token: int, step: int, value: int, invoked: float,
              completed: float | None, outcome: str = "ok", reason: str = "",
              watermark: list[int] | None = None) -> History:
        result = {"watermark": watermark} if watermark else {}
        return self.op("write", worker, invoked, completed, outcome, reason, result,
                       key="k", resource=resource, token=token, step=step, value=value)

    def add(self, **event: Any) -> History:
        self.events.append({"mono": 1000.0, **event})
        return self

    def check(self) -> checker.Report:
        return checker.check(self.events)


def seed_timeline() -> History:
    """The seed's timeline, correctly fenced: A gets 41, pauses past its lease; B gets
    42 and writes; A resumes and is refused."""
    return (
        History()
        .acquire("A", "k", 41, 0.0, 0.1, (0.0, 1.0))
        .acquire("B", "k", 42, 0.5, 1.2, (1.1, 2.1))
        .write("B", "r", 42, 1, 420, 1.3, 1.4)
        .write("A", "r", 41, 1, 410, 0.2, 1.6, "refused", "stale_token", [42, 1])
        .add(type="grant_row", key="k", token=41, holder="A", acquired_at=db_time(0.0),
             expires_at=db_time(1.0), ended_at=db_time(1.0), end_reason="expired")
        .add(type="grant_row", key="k", token=42, holder="B", acquired_at=db_time(1.1),
             expires_at=db_time(2.1), ended_at=None)
        .add(type="lock_row", key="k", token=42)
        .add(type="final", resource="r", token=42, step=1, value=420)
    )


def checks(report: checker.Report) -> set[str]:
    return {violation.check for violation in report.violations}


def test_the_seed_timeline_fenced_passes_and_counts_one_stale_attempt() -> None:
    report = seed_timeline().check()
    assert report.violations == []
    assert report.stale_attempts == 1
    assert report.passed
    assert report.figures["refused_by_reason"] == {"stale_token": 1}


def test_a_clean_history_without_any_stale_write_does_not_pass() -> None:
    report = (
        History()
        .acquire("A", "k", 1, 0.0, 0.1, (0.0, 1.0))
        .write("A", "r", 1, 1, 10, 0.2, 0.3)
        .add(type="final", resource="r", token=1, step=1, value=10)
        .check()
    )
    assert report.violations == []
    assert not report.passed, "a run where the faults never bit proves nothing"
    assert "did not bite" in report.summary()


def test_a_stale_write_accepted_after_a_newer_one_is_a_violation() -> None:
    history = seed_timeline()
    history.events = [e for e in history.events if e.get("reason") != "stale_token"]
    history.write("A", "r", 41, 1, 410, 1.5, 1.6)
    assert "stale_write_accepted" in checks(history.check())


def one_grant_at_every_store(a_refused_by: set[str]) -> History:
    """The seed's timeline over a row, an S3 object and a Redis key: B writes all
    three with 42; A's late writes with 41 are refused by the stores named."""
    history = (
        History()
        .acquire("A", "k", 41, 0.0, 0.1, (0.0, 1.0))
        .acquire("B", "k", 42, 0.5, 1.2, (1.1, 2.1))
    )
    resources = {"account": "account:1", "s3": "s3:bucket/chaos/account-1", "redis": "redis:chaos:account:1"}
    for step, resource in enumerate(resources.values(), start=1):
        history.write("B", resource, 42, step, 420 + step, 1.3, 1.4)
    for step, (store, resource) in enumerate(resources.items(), start=1):
        if store in a_refused_by:
            history.write("A", resource, 41, step, 410 + step, 1.5, 1.6, "refused", "stale_token", [42, step])
        else:
            history.write("A", resource, 41, step, 410 + step, 1.5, 1.6)
    for step, (store, resource) in enumerate(resources.items(), start=1):
        # What each store holds at the end: B's, or A's where the write was let through.
        who, value = (42, 420 + step) if store in a_refused_by else (41, 410 + step)
        history.add(type="final", resource=resource, token=who, step=step, value=value)
    return history


def test_objects_and_redis_keys_are_judged_like_rows_store_by_store() -> None:
    fenced = one_grant_at_every_store({"account", "s3", "redis"}).check()
    assert fenced.violations == [], fenced.summary()
    assert fenced.figures["resources_by_store"] == {"account": 1, "s3": 1, "redis": 1}
    assert fenced.figures["stale_refused_by_store"] == {"account": 1, "s3": 1, "redis": 1}
    assert "by store: account 1, redis 1, s3 1" in fenced.summary()

    # The row is fenced but the object and the key are not: each is found on its own.
    unfenced = one_grant_at_every_store({"account"}).check()
    assert unfenced.figures["violations_by_store"] == {"s3": 2, "redis": 2}, unfenced.summary()
    assert {v.check for v in unfenced.violations} == {"stale_write_accepted", "lost_write"}
    assert "violations by store: redis 2, s3 2" in unfenced.summary()


def test_the_same_token_and_step_accepted_twice_is_a_violation() -> None:
    history = seed_timeline().write("B", "r", 42, 1, 421, 1.5, 1.6)
    assert "duplicate_accepted" in checks(history.check())


def test_one_token_writing_from_two_workers_is_a_violation() -> None:
    history = seed_timeline().write("C", "r", 42, 2, 422, 1.5, 1.6)
    assert "token_shared" in checks(history.check())


def test_a_token_granted_twice_is_a_violation() -> None:
    history = seed_timeline().acquire("C", "k", 42, 3.0, 3.1, (3.0, 4.0))
    assert "token_unique" in checks(history.check())


def test_a_lower_token_granted_after_a_higher_one_is_a_violation() -> None:
    history = seed_timeline().acquire("C", "k", 40, 3.0, 3.1, (3.0, 4.0))
    assert "token_order" in checks(history.check())


def test_two_live_grants_of_one_key_at_the_same_database_time_are_a_violation() -> None:
    history = seed_timeline()
    for event in history.events:
        if event.get("type") == "grant_row" and event["token"] == 41:
            event["expires_at"] = event["ended_at"] = db_time(1.5)
    assert "grants_overlap" in checks(history.check())



def grant_row(key: str, token: int, holder: str, lease: tuple[float, float], mode: str) -> dict[str, Any]:
    return {"type": "grant_row", "key": key, "token": token, "holder": holder, "mode": mode,
            "acquired_at": db_time(lease[0]), "expires_at": db_time(lease[1]), "ended_at": None}


def readers_then_a_writer(writer_from: float) -> History:
    """Two readers of k live together until 2.0 and 3.0; a writer from ``writer_from``."""
    history = seed_timeline()
    history.events = [e for e in history.events if e.get("type") not in {"grant_row", "lock_row"}]
    history.add(type="lock_row", key="k", token=46)
    for row in [
        grant_row("k", 41, "A", (0.0, 1.0), "exclusive"),
        grant_row("k", 42, "B", (1.1, 2.1), "exclusive"),
        grant_row("k", 43, "R1", (2.2, 3.0), "shared"),
        grant_row("k", 44, "R2", (2.5, 4.0), "shared"),
        grant_row("k", 45, "W", (writer_from, writer_from + 1), "exclusive"),
    ]:
        history.add(**row)
    return history


def test_readers_may_overlap_but_a_writer_overlapping_a_reader_is_a_violation() -> None:
    assert checks(readers_then_a_writer(4.0).check()) == set()
    # Past the first reader's end, not past the second's: still a violation.
    assert "writer_overlaps_readers" in checks(readers_then_a_writer(3.5).check())


def test_a_reader_overlapping_a_writer_is_a_violation() -> None:
    history = readers_then_a_writer(4.0)
    history.add(**grant_row("k", 46, "R3", (4.5, 6.0), "shared"))  # inside the writer's 4..5
    assert "writer_overlaps_readers" in checks(history.check())


def permits(slots: list[tuple[int, tuple[float, float]]]) -> History:
    history = seed_timeline().add(type="semaphore", name="pool", limit=2)
    for token, (slot, lease) in enumerate(slots, start=1):
        history.add(**grant_row(f"pool@{slot}", token, f"P{token}", lease, "exclusive"))
    return history


def test_more_live_permits_than_the_limit_is_a_violation() -> None:
    assert checks(permits([(1, (0.0, 2.0)), (2, (1.0, 3.0)), (1, (2.0, 4.0))]).check()) == set()
    found = checks(permits([(1, (0.0, 2.0)), (2, (1.0, 3.0)), (3, (1.5, 4.0))]).check())
    assert {"permit_above_limit", "permits_above_limit"} <= found


def acquire_many(history: History, holder: str, keys: list[str], grants: dict[str, int] | None) -> History:
    outcome = "ok" if grants is not None else "refused"
    return history.op("acquire_many", holder, 5.0, 5.1, outcome, "" if grants else "lock_held",
                      result={"keys": keys, "holder": holder, "grants": grants or {}})


def test_a_set_granted_in_part_is_a_violation() -> None:
    whole = acquire_many(seed_timeline(), "S1", ["x", "y"], {"x": 1, "y": 1})
    refused = acquire_many(seed_timeline(), "S2", ["x", "y"], None)
    assert checks(whole.check()) == checks(refused.check()) == set()

    assert "set_partial" in checks(acquire_many(seed_timeline(), "S1", ["x", "y"], {"x": 1}).check())
    left_behind = acquire_many(seed_timeline(), "S2", ["x", "y"], None)
    left_behind.add(**grant_row("x", 1, "S2", (5.0, 6.0), "exclusive"))
    assert "set_partial" in checks(left_behind.check())

def test_an_acknowledged_grant_missing_from_the_grant_table_is_a_violation() -> None:
    history = seed_timeline()
    history.events = [e for e in history.events if not (e.get("type") == "grant_row" and e["token"] == 42)]
    assert "grant_lost" in checks(history.check())


def test_a_lock_counter_below_an_issued_token_is_a_violation() -> None:
    history = seed_timeline()
    for event in history.events:
        if event.get("type") == "lock_row":
            event["token"] = 41
    assert "counter_backwards" in checks(history.check())


def test_a_final_state_older_than_the_last_acknowledged_write_is_a_lost_write() -> None:
    history = seed_timeline()
    for event in history.events:
        if event.get("type") == "final":
            event.update(token=41, step=1, value=410)
    assert "lost_write" in checks(history.check())


def test_a_final_value_that_no_write_made_is_a_violation() -> None:
    history = seed_timeline()
    for event in history.events:
        if event.get("type") == "final":
            event["value"] = 999
    assert checks(history.check()) & {"lost_write", "final_state"}


def test_a_write_of_unknown_outcome_may_be_the_final_state() -> None:
    history = seed_timeline().write("B", "r", 42, 2, 423, 1.5, None)
    for event in history.events:
        if event.get("type") == "final":
            event.update(step=2, value=423)
    report = history.check()
    assert report.violations == []
    assert report.figures["unknown"] == 1


def test_an_acknowledged_ledger_record_that_is_missing_is_a_lost_write() -> None:
    history = seed_timeline().add(type="stored_resource", resource="r")
    assert "lost_write" in checks(history.check())
    history.add(type="stored", resource="r", token=42, step=1, value=420)
    assert history.check().violations == []


def test_a_stale_refusal_that_no_higher_write_explains_is_unjustified() -> None:
    history = (
        History()
        .acquire("A", "k", 1, 0.0, 0.1, (0.0, 1.0))
        .write("A", "r", 1, 1, 10, 0.2, 0.3, "refused", "stale_token", [7, 1])
    )
    assert "unjustified_refusal" in checks(history.check())


def test_a_duplicate_refusal_without_its_twin_is_unjustified() -> None:
    history = seed_timeline().write("B", "r", 42, 2, 421, 1.5, 1.6, "refused", "duplicate_write", [42, 1])
    assert "unjustified_refusal" in checks(history.check())
    justified = seed_timeline().write("B", "r", 42, 1, 420, 1.5, 1.6, "refused", "duplicate_write", [42, 1])
    assert "unjustified_refusal" not in checks(justified.check())


def test_lock_held_with_no_live_grant_of_that_holder_is_unjustified() -> None:
    history = seed_timeline().op("acquire", "C", 1.3, 1.35, "refused", "lock_held", key="k",
                                 result={"holder": "A", "expires_at": db_time(1.8)})
    assert "unjustified_refusal" in checks(history.check())
    justified = seed_timeline().op("acquire", "C", 1.3, 1.35, "refused", "lock_held", key="k",
                                   result={"holder": "B", "expires_at": db_time(2.1)})
    assert justified.check().violations == []


def test_a_lease_lost_while_the_lease_was_live_is_unjustified() -> None:
    history = seed_timeline().op("renew", "B", 1.5, 1.6, "refused", "lease_lost", key="k", token=42,
                                 result={"db_time": db_time(1.6)})
    assert "unjustified_refusal" in checks(history.check())
    justified = seed_timeline().op("renew", "A", 1.5, 1.6, "refused", "lease_lost", key="k", token=41,
                                   result={"db_time": db_time(1.6)})
    assert justified.check().violations == []


def test_a_watermark_or_counter_seen_going_backwards_is_a_violation() -> None:
    history = (
        seed_timeline()
        .add(type="observe", object="fence:r", token=42, step=1, mono=2.0)
        .add(type="observe", object="fence:r", token=41, step=1, mono=2.3)
        .add(type="observe", object="lock:k", token=42, step=0, mono=2.0)
        .add(type="observe", object="lock:k", token=40, step=0, mono=2.3)
    )
    assert {"watermark_backwards", "counter_backwards"} <= checks(history.check())


def test_history_files_merge_in_time_order_and_a_line_cut_by_a_kill_is_skipped(tmp_path: Path) -> None:
    with HistoryWriter(tmp_path / "a.jsonl") as a, HistoryWriter(tmp_path / "b.jsonl") as b:
        a.write({"type": "invoke", "id": "a-1", "mono": 2.0})
        b.write({"type": "invoke", "id": "b-1", "mono": 1.0})
    with open(tmp_path / "b.jsonl", "a") as killed:
        killed.write('{"type": "invoke", "id": "b-2", "mo')
    events = merge([tmp_path / "a.jsonl", tmp_path / "b.jsonl"], tmp_path / "all.jsonl")
    assert [e["id"] for e in events] == ["b-1", "a-1"]
    assert [e["id"] for e in read_events(tmp_path / "all.jsonl")] == ["b-1", "a-1"]


def test_the_checker_runs_on_its_own_over_a_history_file(tmp_path: Path) -> None:
    path = tmp_path / "history.jsonl"
    path.write_text("".join(json.dumps(e) + "\n" for e in seed_timeline().events))
    assert checker.main([str(path), "--json", str(tmp_path / "figures.json")]) == 0
    figures = json.loads((tmp_path / "figures.json").read_text())
    assert figures["passed"] is True and figures["stale_write_attempts"] == 1


# --- across a promotion (coordination_chaos --patroni) ---------------------------

FLOOR = 1_000_000_042  # the floor the promotion guard raised the counters to


def promoted(history: History, at: float = 1.45) -> History:
    """A cluster fault, then the guard's work on the new primary: the Fence row
    closed at the raised floor with the largest step."""
    return history.add(type="cluster_fault", kind="kill_node", node=1, timeline=1, mono=at)


def test_a_refusal_by_a_watermark_the_promotion_guard_closed_is_justified() -> None:
    closed = [FLOOR, checker.CLOSED_STEP]
    history = seed_timeline().write("B", "r", 42, 2, 421, 1.5, 1.6, "refused", "stale_token", closed)
    # No write of the floor's token explains it, so without a cluster fault it is
    # unjustified; after one, the guard closed the watermark.
    assert "unjustified_refusal" in checks(history.check())
    assert promoted(history).check().violations == []
    # Only before a refusal: a fault after it does not explain it.
    late = seed_timeline().write("B", "r", 42, 2, 421, 1.5, 1.6, "refused", "stale_token", closed)
    assert "unjustified_refusal" in checks(promoted(late, at=1.7).check())


def test_a_final_state_the_promotion_guard_closed_keeps_the_last_write() -> None:
    history = promoted(seed_timeline())
    for event in history.events:
        if event.get("type") == "final":
            event.update(token=FLOOR, step=checker.CLOSED_STEP)
    assert history.check().violations == [], "closed after B's write, still B's value"
    for event in history.events:
        if event.get("type") == "final":
            event["value"] = 410  # the closed row holds a value no last write left
    assert "lost_write" in checks(history.check())


def test_failover_figures_measure_from_the_fault_to_the_first_token_above_the_floor() -> None:
    from project.lab.chaos.patroni import failover_figures

    margin = 1_000_000_000
    history = (
        History()
        .acquire("A", "k", 41, 0.0, 0.1, (0.0, 1.0))
        .acquire("B", "k", 42, 0.5, 1.0, (0.5, 1.5))
        .add(type="cluster_fault", kind="switchover", node=1, timeline=1, mono=2.0)
        .op("acquire", "A", 2.5, None, key="k")  # cut by the failover: unknown
        .add(type="promotion", node=2, timeline=2, previous=1, previous_timeline=1, mono=6.0)
        .acquire("A", "k", 42 + margin + 1, 5.0, 7.5, (5.0, 6.0))
        .acquire("B", "k", 42 + margin + 2, 7.6, 7.7, (7.6, 8.6))
    )
    figures = failover_figures(history.events, margin)
    assert figures["failovers"] == 1 and figures["failovers_by_kind"] == {"switchover": 1}
    assert figures["unavailable_seconds"] == [5.5]
    assert figures["unavailable_p50"] == figures["unavailable_p99"] == 5.5
    assert figures["tokens_skipped"] == [margin]
