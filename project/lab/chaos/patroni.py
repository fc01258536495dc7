"""Failover chaos: faults injected into the Patroni + etcd cluster of bin/cluster.sh.

``coordination_chaos --patroni`` runs the usual workload (worker processes that
acquire, write through the fences, renew and release) against the cluster, the
app connected with the multi-host address and ``target_session_attrs=read-write``
so every new connection finds the primary, while :class:`ClusterFaults` (a
thread of the controller) kills, pauses and switches over the primary on a
random schedule drawn from the run's seed:

- ``switchover``: a planned switchover through Patroni's REST API
  (``POST /switchover``): the primary shuts down, a standby is promoted;
- ``kill_node``: SIGKILL of the primary's Patroni, PostgreSQL and every backend
  (the machine dies); the leader key expires after Patroni's ``ttl`` and a
  standby is promoted; the node is started again once there is a new leader;
- ``kill_postgres``: SIGKILL of the primary's PostgreSQL only; its Patroni,
  still holding the leader key, restarts it (crash recovery, no promotion);
- ``pause_node``: SIGSTOP of the primary's Patroni and PostgreSQL (a VM
  pause), SIGCONT after a few seconds (clients stall) or after more than the
  ``ttl`` (a standby is promoted meanwhile; the old primary wakes up as a
  zombie until its Patroni demotes it).

The safe run uses synchronous replication (Patroni's ``synchronous_mode``,
strict): every acknowledged grant and write is on the standby that is promoted,
and the promotion guard (migration 0012) raises the token floor on the first
grant of every new timeline.

``--unsafe`` is the negative control: asynchronous replication, the guard
disabled (:func:`disable_guard`, a test-only control of this tool: it replaces
the guard function by a no-op in the cluster's database, and
:func:`restore_guard` puts the original back), and replication lag injected:
the primary's WAL senders are stopped (SIGSTOP) for a few seconds while the
workload goes on, then the primary is killed. The promoted standby never had
those seconds of grants, so it issues their tokens again; the checker must
report it.

Every fault is logged to the history (``cluster_fault``, ``promotion``,
``cluster_recovered`` events) so that :func:`failover_figures` can give each
failover's unavailability: from the fault to the first grant acknowledged on
the new primary (the first token above the floor the guard raised).
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import signal
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from random import Random
from typing import Any

from .history import Event, HistoryWriter

__all__ = [
    "CLUSTER_FAULT_KINDS", "ClusterFaults", "Member", "PatroniCluster", "PatroniError",
    "disable_guard", "failover_figures", "restore_guard",
]

CLUSTER_FAULT_KINDS = ("switchover", "kill_node", "kill_postgres", "pause_node")
# Switchovers are the cheapest leader change (seconds); a killed node costs
# Patroni's ttl and a rejoin, so it comes less often.
CLUSTER_FAULT_WEIGHTS = {"switchover": 0.45, "kill_node": 0.25, "kill_postgres": 0.1, "pause_node": 0.2}
NODES = (1, 2, 3)
SCRIPT = Path(__file__).resolve().parents[3] / "bin" / "cluster.sh"
# Patroni's leader key in etcd, as bin/cluster.sh configures it (namespace, scope).
LEADER_KEY = "/coordination-ha/coordination-ha/leader"
GUARD_SIGNATURE = "coordination_failover_guard(bigint, bigint)"
# What the negative control replaces the guard with: the same signature, no effect.
NO_GUARD = (
    "CREATE OR REPLACE FUNCTION coordination_failover_guard(p_margin bigint, p_max_token bigint) "
    "RETURNS void LANGUAGE plpgsql VOLATILE AS $fn$ BEGIN RETURN; END $fn$"
)


class PatroniError(RuntimeError):
    """The cluster is not running, or did not recover from a fault in time."""


@dataclass(frozen=True)
class Member:
    name: str
    role: str
    state: str
    timeline: int | None

    @property
    def node(self) -> int:
        return int(self.name.removeprefix("node"))


class PatroniCluster:
    """The running cluster of bin/cluster.sh: members, the multi-host database
    settings, and the faults. Its ports are the ones bin/cluster.sh chose when it
    started the cluster (``bin/cluster.sh ports``), read once when first needed."""

    def __init__(self) -> None:
        self._root: Path | None = None
        self._ports: dict[str, int] | None = None

    @property
    def ports(self) -> dict[str, int]:
        """``ETCD_PORT``, ``REST_PORT`` (node 1's; node N's is N - 1 more) and
        ``PG_PORT`` (likewise) of the cluster; before a start, the ports it would try
        first. Raises PatroniError if bin/cluster.sh cannot say."""
        if self._ports is None:
            lines = self.script("ports").split()
            self._ports = {name: int(value) for name, value in (line.split("=", 1) for line in lines)}
        return self._ports

    @property
    def rest_port(self) -> int:
        return self.ports["REST_PORT"]

    @property
    def pg_port(self) -> int:
        return self.ports["PG_PORT"]

    @property
    def etcd_port(self) -> int:
        return self.ports["ETCD_PORT"]

    # --- inspecting ---------------------------------------------------------------

    def script(self, *args: str, timeout: float = 180) -> str:
        # Files, not pipes: a node it starts outlives it and would hold a pipe open.
        with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
            done = subprocess.run([str(SCRIPT), *args], stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                                  timeout=timeout, check=False)
            out.seek(0)
            err.seek(0)
            if done.returncode:
                raise PatroniError(f"bin/cluster.sh {' '.join(args)} failed:\n{err.read()[-2000:]}")
            return out.read()

    @property
    def root(self) -> Path:
        if self._root is None:
            self._root = Path(self.script("root").strip())
        return self._root

    def database_settings(self) -> dict[str, Any]:
        """The app's DATABASES entry: libpq's multi-host form, the primary wanted."""
        return {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": "coordination", "USER": "coordination", "PASSWORD": "",
            "HOST": ",".join("127.0.0.1" for _ in NODES),
            "PORT": ",".join(str(self.pg_port + n - 1) for n in NODES),
            "OPTIONS": {"target_session_attrs": "read-write", "connect_timeout": 3},
            "CONN_MAX_AGE": 0,
        }

    def rest(self, node: int, path: str, body: dict[str, Any] | None = None, method: str = "GET",
             timeout: float = 5) -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.rest_port + node - 1}{path}", data=data, method=method,
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            text = answer.read().decode()
        try:
            return json.loads(text)
        except ValueError:
            return text

    def _any_node(self, path: str, body: dict[str, Any] | None = None, method: str = "GET") -> Any:
        for node in NODES:
            with contextlib.suppress(OSError, urllib.error.URLError, ValueError):
                return self.rest(node, path, body, method)
        raise PatroniError(f"no Patroni node answers {method} {path} (bin/cluster.sh start)")

    def members(self) -> list[Member]:
        with contextlib.suppress(PatroniError):
            found = self._any_node("/cluster")["members"]
            return [Member(m["name"], m["role"], m["state"], m.get("timeline")) for m in found]
        return []

    def leader(self) -> Member | None:
        leaders = [m for m in self.members() if m.role == "leader" and m.state == "running"]
        return leaders[0] if len(leaders) == 1 else None

    def views(self) -> list[list[Member]]:
        """The members as each answering node's Patroni sees them."""
        found = []
        for node in NODES:
            with contextlib.suppress(OSError, urllib.error.URLError, ValueError, KeyError):
                found.append([Member(m["name"], m["role"], m["state"], m.get("timeline"))
                              for m in self.rest(node, "/cluster", timeout=3)["members"]])
        return found

    def healthy(self, sync: bool) -> Member | None:
        """The leader, when it runs with two streaming standbys (one synchronous
        when ``sync``) and every node that answers agrees; else None. (A node that
        wakes up from a pause answers with its stale view for a moment.)"""
        views = self.views()
        if len(views) < len(NODES) or any(view != views[0] for view in views[1:]):
            return None
        members = views[0]
        leaders = [m for m in members if m.role == "leader" and m.state == "running"]
        leader = leaders[0] if len(leaders) == 1 else None
        streaming = [m for m in members if m.role in ("replica", "sync_standby", "quorum_standby")
                     and m.state == "streaming"]
        if leader is None or len(streaming) < 2:
            return None
        if sync and not any(m.role == "sync_standby" for m in streaming):
            return None
        return leader

    def wait(self, ready: Callable[[], Any], what: str, timeout: float,
             stop: threading.Event | None = None) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = ready()
            if found or (stop is not None and stop.is_set()):
                return found
            time.sleep(0.25)
        raise PatroniError(f"the cluster never reached: {what} within {timeout:g} s "
                           f"(members: {self.members()})")

    def config(self) -> dict[str, Any]:
        found: dict[str, Any] = self._any_node("/config")
        return found

    def patch_config(self, body: dict[str, Any]) -> None:
        self._any_node("/config", body, "PATCH")

    def set_sync(self, sync: bool) -> None:
        self.patch_config({"synchronous_mode": sync, "synchronous_mode_strict": sync})

    # --- processes ------------------------------------------------------------------

    def patroni_pid(self, node: int) -> int | None:
        with contextlib.suppress(OSError, ValueError):
            return int((self.root / f"node{node}" / "patroni.pid").read_text())
        return None

    def postmaster_pid(self, node: int) -> int | None:
        with contextlib.suppress(OSError, ValueError, IndexError):
            return int((self.root / f"node{node}" / "data" / "postmaster.pid").read_text().split()[0])
        return None

    def kill_postgres(self, node: int) -> None:
        """SIGKILL the node's PostgreSQL and every backend. The postmaster is
        stopped first, so it forks nothing after its children were listed."""
        postmaster = self.postmaster_pid(node)
        if postmaster is None:
            return
        _signal(postmaster, signal.SIGSTOP)
        for pid in _children(postmaster):
            _signal(pid, signal.SIGKILL)
        _signal(postmaster, signal.SIGKILL)

    def kill_node(self, node: int) -> None:
        """The machine dies: Patroni and PostgreSQL SIGKILLed, nothing shuts down."""
        runner = self.patroni_pid(node)
        if runner is not None:
            for pid in [*_children(runner), runner]:
                _signal(pid, signal.SIGKILL)
        self.kill_postgres(node)

    def pause_node(self, node: int) -> list[int]:
        """SIGSTOP the node's Patroni (with what it runs) and its PostgreSQL with
        every backend (the postmaster first, so it forks nothing unseen); returns
        the processes stopped, for :meth:`resume`."""
        stopped: list[int] = []
        runner = self.patroni_pid(node)
        if runner is not None:
            stopped += [runner, *_children(runner)]
        postmaster = self.postmaster_pid(node)
        if postmaster is not None:
            stopped.append(postmaster)
        self.pause(stopped)
        if postmaster is not None:
            backends = _children(postmaster)
            self.pause(backends)
            stopped += backends
        return list(dict.fromkeys(stopped))

    def pause(self, pids: Sequence[int]) -> None:
        for pid in pids:
            _signal(pid, signal.SIGSTOP)

    def resume(self, pids: Sequence[int]) -> None:
        for pid in pids:
            _signal(pid, signal.SIGCONT)

    def wal_senders(self, node: int) -> list[int]:
        """The node's WAL sender processes (one per streaming standby)."""
        postmaster = self.postmaster_pid(node)
        if postmaster is None:
            return []
        found = []
        for pid in _children(postmaster):
            with contextlib.suppress(OSError):
                # "postgres: [cluster name: ]walsender user host streaming LSN"
                if b" walsender " in Path(f"/proc/{pid}/cmdline").read_bytes():
                    found.append(pid)
        return found

    def switchover(self, leader: Member, candidate: Member | None) -> None:
        body: dict[str, Any] = {"leader": leader.name}
        if candidate is not None:
            body["candidate"] = candidate.name
        self.rest(leader.node, "/switchover", body, "POST", timeout=60)

    def drop_leader_key(self) -> None:
        """Delete Patroni's leader key in etcd (its v3 JSON gateway), as an operator
        would once the leader's machine is known dead: the standbys elect a new
        leader at once instead of after the key's ttl."""
        key = base64.b64encode(LEADER_KEY.encode()).decode()
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.etcd_port}/v3/kv/deleterange", data=json.dumps({"key": key}).encode(),
            method="POST", headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=5) as answer:
            answer.read()

    def start_node(self, node: int) -> None:
        self.script("start-node", str(node))

    def start_stopped_nodes(self) -> list[int]:
        """Start every node whose Patroni is not running (a kill left it down)."""
        started = [node for node in NODES if not self.node_running(node)]
        for node in started:
            self.start_node(node)
        return started

    def node_running(self, node: int) -> bool:
        pid = self.patroni_pid(node)
        if pid is None:
            return False
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(child) for child in text.split()]


def _signal(pid: int, how: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, how)


# --- the guard's test-only switch ---------------------------------------------------


def disable_guard(cursor: Any) -> str:
    """Replace the promotion guard by a no-op in the cluster's database; returns
    the original definition for :func:`restore_guard`.

    A test-only control of the negative control (``--unsafe``), never of a real
    site: the grant point then issues tokens after a promotion from whatever
    counters the promoted standby had.
    """
    cursor.execute("SELECT pg_get_functiondef(%s::regprocedure)", [GUARD_SIGNATURE])
    original = str(cursor.fetchone()[0])
    cursor.execute(NO_GUARD)
    return original


def restore_guard(cursor: Any, original: str) -> None:
    cursor.execute(original)


# --- the fault thread ---------------------------------------------------------------


class ClusterFaults(threading.Thread):
    """Injects cluster faults one after the other, each once the cluster is healthy
    again (a leader and two streaming standbys), until ``stop`` is set; then brings
    every node back. Its events go to their own history file."""

    def __init__(self, cluster: PatroniCluster, rng: Random, history: Path, *, kinds: Sequence[str],
                 sync: bool, unsafe: bool, interval: float, lag_seconds: float,
                 say: Callable[[str], None], started: float) -> None:
        super().__init__(name="cluster-faults", daemon=True)
        self.cluster = cluster
        self.rng = rng
        self.log = HistoryWriter(history)
        self.kinds = list(kinds)
        self.sync = sync
        self.unsafe = unsafe
        self.interval = interval
        self.lag_seconds = lag_seconds
        self.say = say
        self.started = started
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.injected = 0
        self.leader_changes = 0
        self._paused: list[int] = []
        self._killed: set[int] = set()
        try:
            self.ttl = float(cluster.config().get("ttl", 30))
        except PatroniError:
            self.ttl = 30.0

    def run(self) -> None:
        try:
            pending = list(self.kinds)
            self.rng.shuffle(pending)
            while not self.stop.is_set():
                self.cluster.wait(lambda: self.cluster.healthy(self.sync), "a healthy cluster", 240,
                                  self.stop)
                if self.stop.wait(self.rng.uniform(0.5, 1.5) * self.interval):
                    break
                leader = self.cluster.healthy(self.sync)
                if leader is None:
                    continue
                if self.unsafe:
                    self._lagging_failover(leader)
                    continue
                kind = pending.pop() if pending else self.rng.choices(
                    self.kinds, weights=[CLUSTER_FAULT_WEIGHTS[k] for k in self.kinds])[0]
                self._inject(kind, leader)
        except BaseException as error:  # reported by the controller
            self.error = error
        finally:
            self._recover()
            self.log.close()

    def finish(self, timeout: float = 300) -> None:
        """Stop injecting, wait for the cluster to be whole again."""
        self.stop.set()
        self.join(timeout)
        if self.is_alive():
            raise PatroniError("the cluster fault thread did not finish")
        if self.error is not None:
            raise PatroniError(f"the cluster faults failed: {self.error}") from self.error

    def _at(self) -> str:
        return f"t+{time.monotonic() - self.started:5.1f}s"

    def _record(self, event: Event) -> None:
        self.log.write(event)

    def _inject(self, kind: str, leader: Member) -> None:
        members = self.cluster.members()
        fault: Event = {"type": "cluster_fault", "kind": kind, "node": leader.node,
                        "timeline": leader.timeline}
        self.injected += 1
        if kind == "switchover":
            standbys = [m for m in members if m.role == ("sync_standby" if self.sync else "replica")
                        and m.state == "streaming"]
            candidate = self.rng.choice(standbys) if standbys else None
            fault["candidate"] = candidate.node if candidate else None
            self._record(fault)
            self.say(f"chaos: {self._at()} cluster: switchover from node{leader.node}")
            try:
                self.cluster.switchover(leader, candidate)
            except (OSError, urllib.error.URLError) as error:
                self._record({"type": "cluster_note", "kind": kind, "error": str(error)[:300]})
            self._await_leader_change(leader, self.ttl * 3)
        elif kind == "kill_node":
            self._record(fault)
            self.say(f"chaos: {self._at()} cluster: kill node{leader.node} (Patroni and PostgreSQL)")
            self.cluster.kill_node(leader.node)
            self._killed.add(leader.node)
            self._await_leader_change(leader, self.ttl * 4)
            self._restart_killed()
        elif kind == "kill_postgres":
            self._record(fault)
            self.say(f"chaos: {self._at()} cluster: kill node{leader.node}'s PostgreSQL")
            self.cluster.kill_postgres(leader.node)
            # Its Patroni restarts it (it still holds the leader key), or a standby
            # is promoted; either way a leader runs again.
            self._await_leader_running(leader, self.ttl * 4)
        elif kind == "pause_node":
            long = self.rng.random() < 0.5
            seconds = self.rng.uniform(self.ttl + 3, self.ttl + 8) if long else self.rng.uniform(2, 6)
            fault["seconds"] = round(seconds, 2)
            self._record(fault)
            self.say(f"chaos: {self._at()} cluster: pause node{leader.node} for {seconds:.1f} s")
            self._paused = self.cluster.pause_node(leader.node)
            self.stop.wait(seconds)
            self.cluster.resume(self._paused)
            self._paused = []
            self._await_leader_running(leader, self.ttl * 4)

    def _lagging_failover(self, leader: Member) -> None:
        """The negative control's fault: the standbys stop receiving WAL (the
        primary's WAL senders are stopped) while the workload goes on for
        ``lag_seconds``, then the primary dies. Whatever it acknowledged meanwhile
        is on no standby."""
        senders = self.cluster.wal_senders(leader.node)
        self.injected += 1
        self._record({"type": "cluster_fault", "kind": "lag_then_kill_node", "node": leader.node,
                      "timeline": leader.timeline, "lag_seconds": self.lag_seconds,
                      "wal_senders": len(senders)})
        self.say(f"chaos: {self._at()} cluster: stop node{leader.node}'s {len(senders)} WAL senders "
                 f"for {self.lag_seconds:g} s, then kill it")
        self._paused = senders
        self.cluster.pause(senders)
        self.stop.wait(self.lag_seconds)
        self.cluster.kill_node(leader.node)
        self._paused = []
        # The leader key would expire after the ttl (20 s); nothing here depends on
        # that wait, so the control removes the dead leader's key at once.
        with contextlib.suppress(OSError, urllib.error.URLError):
            self.cluster.drop_leader_key()
        self._killed.add(leader.node)
        self._await_leader_change(leader, self.ttl * 4)
        self._restart_killed()

    def _await_leader_change(self, old: Member, timeout: float) -> None:
        def changed() -> Member | None:
            leader = self.cluster.leader()
            moved = leader is not None and leader.node != old.node
            return leader if moved and leader and (leader.timeline or 0) > (old.timeline or 0) else None

        try:
            new = self.cluster.wait(changed, f"a new leader after node{old.node}", timeout)
        except PatroniError as error:
            self._record({"type": "cluster_note", "error": str(error)[:500]})
            self.say(f"chaos: {self._at()} cluster: {error}")
            return
        self._promoted(new, old)

    def _await_leader_running(self, old: Member, timeout: float) -> None:
        # Whole again, not merely a running leader: a node that wakes up from a
        # pause still answers /cluster with its own stale view (itself the leader)
        # until its Patroni has caught up and demoted it.
        leader = self.cluster.wait(lambda: self.cluster.healthy(self.sync), "a healthy cluster", timeout)
        if (leader.timeline or 0) > (old.timeline or 0):
            self._promoted(leader, old)
        else:
            self._record({"type": "cluster_recovered", "node": leader.node, "timeline": leader.timeline})

    def _promoted(self, new: Member, old: Member) -> None:
        self.leader_changes += 1
        self._record({"type": "promotion", "node": new.node, "timeline": new.timeline,
                      "previous": old.node, "previous_timeline": old.timeline})
        self.say(f"chaos: {self._at()} cluster: node{new.node} is the primary (timeline {new.timeline})")

    def _restart_killed(self) -> None:
        for node in sorted(self._killed):
            if not self.cluster.node_running(node):
                self.cluster.start_node(node)
        self._killed.clear()

    def _recover(self) -> None:
        """Every node running again: resume what is paused, start what was killed."""
        with contextlib.suppress(Exception):
            self.cluster.resume(self._paused)
        self._paused = []
        with contextlib.suppress(Exception):
            self.cluster.start_stopped_nodes()


# --- the figures ----------------------------------------------------------------------


def failover_figures(events: Sequence[Event], margin: int) -> dict[str, Any]:
    """Failovers and switchovers of a run, from its history.

    A promotion is a leader change the fault thread saw. Its unavailability runs
    from the fault to the first acquire acknowledged after it with a token more
    than ``margin / 2`` above every token acknowledged before the fault (the
    first grant on the new primary, past the floor the guard raised; without the
    guard, the first grant acknowledged after the promotion was seen). The tokens
    skipped are that jump: the first token on the new primary, less the highest
    acknowledged before the fault, less one.
    """
    ordered = sorted(events, key=lambda e: float(e.get("mono", 0.0)))
    invoked: dict[str, float] = {}
    grants: list[tuple[float, int]] = []  # (completed, token) of every acknowledged acquire
    for event in ordered:
        if event.get("type") == "invoke" and event.get("op") == "acquire":
            invoked[event["id"]] = float(event["mono"])
        elif (event.get("type") == "complete" and event.get("id") in invoked
              and event.get("outcome") == "ok" and event.get("token") is not None):
            grants.append((float(event["mono"]), int(event["token"])))
    faults = [e for e in ordered if e.get("type") == "cluster_fault"]
    promotions = [e for e in ordered if e.get("type") == "promotion"]
    unavailable: list[float] = []
    skipped: list[int] = []
    for promotion in promotions:
        seen = float(promotion["mono"])
        fault = max((f for f in faults if float(f["mono"]) <= seen), key=lambda f: float(f["mono"]),
                    default=None)
        if fault is None:
            continue
        start = float(fault["mono"])
        before = max((token for at, token in grants if at < start), default=0)
        jumped = [(at, token) for at, token in grants if at > start and token > before + margin // 2]
        after = [(at, token) for at, token in grants if at > seen]
        first = min(jumped) if jumped else (min(after) if after else None)
        if first is None:
            continue
        unavailable.append(first[0] - start)
        if jumped:
            skipped.append(first[1] - before - 1)
    return {
        "cluster_faults": len(faults),
        "cluster_faults_by_kind": _count(str(f.get("kind")) for f in faults),
        "failovers": len(promotions),
        "failovers_by_kind": _count(
            str(max((f for f in faults if float(f["mono"]) <= float(p["mono"])),
                    key=lambda f: float(f["mono"]), default={}).get("kind"))
            for p in promotions
        ),
        "unavailable_seconds": [round(value, 3) for value in unavailable],
        "unavailable_p50": _quantile(unavailable, 0.5),
        "unavailable_p99": _quantile(unavailable, 0.99),
        "tokens_skipped": skipped,
    }


def _count(names: Any) -> dict[str, int]:
    counts: dict[str, int] = {}
    for name in names:
        counts[name] = counts.get(name, 0) + 1
    return counts


def _quantile(values: Sequence[float], q: float) -> float | None:
    """The nearest-rank quantile (p99 of fewer than 100 values is the maximum)."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, -(-int(q * 1000) * len(ordered) // 1000))
    return round(ordered[min(rank, len(ordered)) - 1], 3)
