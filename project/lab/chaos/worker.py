"""One chaos worker: a plain process using the Python API with its own connection.

Started by the controller as ``python -m project.lab.chaos.worker CONFIG.json``.
It loops: acquire one of the keys, do fenced writes to the resources that key
guards (the demo Account row, a Fence-guarded ledger record, a document of the
fenced store when it is installed, an S3 object and a Redis key when the run has
those stores: :mod:`project.lab.chaos.stores`), maybe renew, release. Each operation is
logged before and after (see :mod:`project.lab.chaos.history`).

With ``fencing`` off (the negative control) the same writes are plain updates.

With ``primitives`` on, each cycle is one of four, at random: the exclusive
acquire above; a reader (``acquire_shared`` of the same key, writing the
ledger: a read-derived write a writer's later token must refuse); a permit of
the run's semaphore (``acquire_permit``, writing the ledger of its slot,
``ledger:<name>@<slot>``); or a set of two keys (``acquire_many`` under a
holder name of its own, writing both accounts and ledgers). The history
records each so the checker judges its invariants: at most ``limit`` live
permits, no writer overlapping readers, every set all or none.

A database error mid-call (the connection was terminated, the server restarted)
makes the outcome unknown: the write may or may not have committed. The worker
closes the connection, so Django reconnects on the next query, and goes on.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

from .history import HistoryWriter, iso
from .stores import StoreWrites

# Phases the controller reads from the phase file, to pause a worker while it
# holds a lease and has not written yet: the pause then straddles its expiry.
STARTING, IDLE, HOLDING = b"S", b"-", b"H"


class Worker:
    def __init__(self, config: dict[str, Any]) -> None:
        from django.db import connections

        self.config = config
        self.name: str = config["worker"]
        self.number: int = int(config["number"])
        self.keys: list[int] = list(config["accounts"])
        self.ttl: float = float(config["ttl"])
        self.fencing: bool = bool(config["fencing"])
        self.documents: bool = bool(config.get("documents"))
        self.primitives: bool = bool(config.get("primitives"))
        self.semaphore: str = str(config.get("semaphore") or "")
        self.limit: int = int(config.get("limit") or 0)
        self.stores = StoreWrites(config.get("stores") or {}, self.fencing)
        self.rng = random.Random(config["seed"])
        self.history = HistoryWriter(config["history"])
        self.phase_fd = os.open(config["phase"], os.O_RDWR | os.O_CREAT, 0o644)
        self.connection = connections["default"]
        self.ops = 0
        self.writes = 0
        self.stopping = False
        self.failures = 0  # database errors in a row: back off while the server is away
        self.set_phase(IDLE)  # ready: the controller starts its clock once every worker is

    # --- logging around every call ------------------------------------------

    def perform(
        self, op: str, fields: dict[str, Any], call: Callable[[], dict[str, Any]],
        always: dict[str, Any] | None = None,
    ) -> tuple[str, Any]:
        """Run ``call`` between an invoke and a complete event; ``always`` is
        written into the complete event whatever the outcome (last, so a
        refusal's own fields, such as the blocking holder, never replace it)."""
        from django.db import DatabaseError, InterfaceError

        from coordination.exceptions import (
            CoordinationError,
            GrantPointUnavailable,
            LeaseLost,
            LockHeld,
            StaleToken,
        )
        from coordination.stores.errors import StoreUnavailable

        self.ops += 1
        op_id = f"{self.name}-{self.ops}"
        self.history.write({"type": "invoke", "id": op_id, "op": op, "worker": self.name, **fields})
        done: dict[str, Any] = {"type": "complete", "id": op_id}
        try:
            result = call()
        except (GrantPointUnavailable, StoreUnavailable) as error:
            # The connection was cut under the call (to the grant point, or to an
            # object store or Redis): it may or may not have taken effect, exactly
            # like a database error below (not a refusal).
            done.update(outcome="unknown", error=f"{type(error).__name__}: {error}"[:300])
            self.history.write({**done, **(always or {})})
            self.reconnect()
            return "unknown", error
        except CoordinationError as error:
            done.update(outcome="refused", reason=error.code)
            if isinstance(error, LockHeld):
                done.update(holder=error.holder, expires_at=iso(error.expires_at))
            elif isinstance(error, StaleToken):
                done["watermark"] = [error.current_token, error.current_step]
            elif hasattr(error, "current_step"):
                done["watermark"] = [fields.get("token"), error.current_step]
            if isinstance(error, LeaseLost):
                done["db_time"] = self.database_time()
            self.history.write({**done, **(always or {})})
            return "refused", error
        except (DatabaseError, InterfaceError) as error:
            done.update(outcome="unknown", error=f"{type(error).__name__}: {error}"[:300])
            self.history.write({**done, **(always or {})})
            self.reconnect()
            return "unknown", error
        self.failures = 0
        done.update(outcome="ok", **result)
        self.history.write({**done, **(always or {})})
        return "ok", result

    def database_time(self) -> str | None:
        from django.db import DatabaseError, InterfaceError

        from coordination import locks

        try:
            return iso(locks.database_now())
        except (DatabaseError, InterfaceError):
            self.reconnect()
            return None

    def reconnect(self) -> None:
        # Django opens a new connection on the next query once this one is closed.
        with contextlib.suppress(Exception):
            self.connection.close()
        self.failures += 1
        time.sleep(min(1.0, 0.05 * 2 ** min(self.failures, 5)) * self.rng.uniform(0.5, 1.0))

    def set_phase(self, phase: bytes) -> None:
        os.pwrite(self.phase_fd, phase, 0)

    # --- the workload -------------------------------------------------------------

    def run(self) -> None:
        while not self.stopping:
            self.cycle()
        self.set_phase(IDLE)
        self.history.close()

    def cycle(self) -> None:
        if self.primitives:
            kind = self.rng.choice(["exclusive", "shared", "permit", "set"])
            if kind == "shared":
                return self.cycle_shared()
            if kind == "permit":
                return self.cycle_permit()
            if kind == "set":
                return self.cycle_set()
        self.cycle_exclusive()

    def cycle_exclusive(self) -> None:
        from coordination import locks

        pk = self.rng.choice(self.keys)
        key = f"account:{pk}"

        def acquire() -> dict[str, Any]:
            grant = locks.acquire(key, holder=self.name, ttl=self.ttl, wait=self.ttl * 2)
            holder["grant"] = grant
            return {
                "token": grant.token, "holder": grant.holder,
                "acquired_at": iso(grant.acquired_at), "expires_at": iso(grant.expires_at),
            }

        holder: dict[str, Any] = {}
        outcome, _ = self.perform("acquire", {"key": key}, acquire)
        if outcome != "ok":
            return
        grant = holder["grant"]
        self.work(grant, pk)
        self.release(grant)

    def cycle_shared(self) -> None:
        """A reader of an account's key: its ledger write is read-derived, so a
        writer's later token must refuse it once the writer has written."""
        from coordination.shared import acquire_shared

        pk = self.rng.choice(self.keys)
        key = f"account:{pk}"
        holder: dict[str, Any] = {}

        def acquire() -> dict[str, Any]:
            grant = acquire_shared(key, holder=self.name, ttl=self.ttl, wait=self.ttl * 2)
            holder["grant"] = grant
            return {**granted(grant), "mode": grant.mode}

        outcome, _ = self.perform("acquire", {"key": key, "mode": "shared"}, acquire)
        if outcome != "ok":
            return
        self.hold_then_write_ledger(holder["grant"], pk)

    def cycle_permit(self) -> None:
        """A permit of the run's semaphore; it writes the ledger of its slot."""
        from coordination.semaphores import acquire_permit

        holder: dict[str, Any] = {}

        def acquire() -> dict[str, Any]:
            permit = acquire_permit(
                self.semaphore, limit=self.limit, holder=self.name, ttl=self.ttl, wait=self.ttl * 2,
            )
            holder["grant"] = permit
            return {"key": permit.key, **granted(permit)}

        outcome, _ = self.perform(
            "acquire_permit", {"semaphore": self.semaphore, "limit": self.limit}, acquire
        )
        if outcome != "ok":
            return
        permit = holder["grant"]
        self.hold_then_write_ledger(permit, permit.key)

    def hold_then_write_ledger(self, grant: Any, ledger: int | str) -> None:
        """Hold ``grant`` a while (renewing it half the time), write ``ledger``
        under it, release it: a reader's or a permit holder's cycle."""
        self.set_phase(HOLDING)
        try:
            time.sleep(self.rng.uniform(0.0, self.ttl * 0.3))
            if self.rng.random() < 0.5:
                self.renew(grant)
            self.write_ledger(grant, ledger)
        finally:
            self.set_phase(IDLE)
        self.release(grant)

    def cycle_set(self) -> None:
        """Two keys at once (all or none), under a holder name of this set's own,
        so the checker can tell whether a refused set left a grant behind."""
        from coordination import locks

        pks = sorted(self.rng.sample(self.keys, min(2, len(self.keys))))
        keys = [f"account:{pk}" for pk in pks]
        set_holder = f"{self.name}-set{self.ops + 1}"
        holder: dict[str, Any] = {}

        def acquire() -> dict[str, Any]:
            grants = locks.acquire_many(keys, holder=set_holder, ttl=self.ttl, wait=self.ttl * 2)
            holder["grants"] = grants
            return {"grants": {key: lease.token for key, lease in grants.items()}}

        outcome, _ = self.perform(
            "acquire_many", {"keys": keys}, acquire, always={"keys": keys, "holder": set_holder}
        )
        if outcome != "ok":
            return
        grants = holder["grants"]
        self.set_phase(HOLDING)
        try:
            time.sleep(self.rng.uniform(0.0, self.ttl * 0.3))
            for pk in pks:
                grant = grants[f"account:{pk}"]
                self.write_account(grant, pk)
                self.write_ledger(grant, pk)
        finally:
            self.set_phase(IDLE)
        for pk in pks:
            self.release(grants[f"account:{pk}"])

    def work(self, grant: Any, pk: int) -> None:
        """The writes made under one grant."""
        self.set_phase(HOLDING)
        try:
            # "Work" before writing: a pause here is the seed's timeline, A holds
            # token 41, stops, its lease expires, B gets 42 and writes, A resumes.
            time.sleep(self.rng.uniform(0.0, self.ttl * 0.3))
            self.write_account(grant, pk)
            if self.rng.random() < 0.5:
                self.renew(grant)
            self.write_ledger(grant, pk)
            if self.documents:
                self.write_document(grant, pk)
            for resource, write in self.stores.writers(pk):
                self.write_store(grant, resource, write)
        finally:
            self.set_phase(IDLE)

    def fenced_task_execution(self, grant: Any, pk: int, invoked: float) -> None:
        """The Celery variant: the task decorator acquired ``grant`` (and releases it);
        log that acquire, then make the same writes."""
        self.ops += 1
        op_id = f"{self.name}-{self.ops}"
        self.history.write({"type": "invoke", "id": op_id, "op": "acquire", "worker": self.name,
                            "key": grant.key, "mono": invoked})
        self.history.write({
            "type": "complete", "id": op_id, "outcome": "ok", "token": grant.token,
            "holder": grant.holder, "acquired_at": iso(grant.acquired_at),
            "expires_at": iso(grant.expires_at),
        })
        self.work(grant, pk)

    def renew(self, grant: Any) -> None:
        from coordination import locks

        def renew() -> dict[str, Any]:
            locks.renew(grant, ttl=self.ttl)
            return {"expires_at": iso(grant.expires_at)}

        self.perform("renew", {"key": grant.key, "token": grant.token}, renew)

    def release(self, grant: Any) -> None:
        from coordination import locks

        def release() -> dict[str, Any]:
            locks.release(grant)
            return {"ended_at": iso(grant.ended_at), "end_reason": str(grant.end_reason)}

        self.perform("release", {"key": grant.key, "token": grant.token}, release)

    def next_value(self) -> int:
        self.writes += 1
        return self.number * 1_000_000 + self.writes

    def write_fields(self, grant: Any, resource: str, step: int, value: int, **extra: Any) -> dict[str, Any]:
        return {"key": grant.key, "token": grant.token, "step": step, "resource": resource,
                "value": value, **extra}

    def write_account(self, grant: Any, pk: int) -> None:
        from project.demo.models import Account

        step, value = grant.next_step(), self.next_value()

        def write() -> dict[str, Any]:
            rows = Account.objects.filter(pk=pk)
            if self.fencing:
                rows.fenced_update(grant, step=step, balance=value)
            else:
                rows.update(balance=value, **unchecked_watermark("fence", "fence_step", grant.token, step))
            return {}

        self.perform("write", self.write_fields(grant, f"account:{pk}", step, value), write)

    def write_ledger(self, grant: Any, pk: int | str) -> None:
        """A Fence-guarded side effect: a ledger record committed with the watermark
        (``ledger:<pk>`` for an account, ``ledger:<name>@<slot>`` for a permit)."""
        resource = f"ledger:{pk}"
        step, value = grant.next_step(), self.next_value()
        fields = self.write_fields(grant, resource, step, value)
        outcome, _ = self.perform("write", fields, lambda: self.ledger_write(grant, resource, step, value))
        if outcome == "unknown" and not self.stopping:
            # Same-token retry of the same step: the fence says whether the first
            # attempt committed (duplicate_write) or not (accepted now).
            retry = {**fields, "retry": True}
            self.perform("write", retry, lambda: self.ledger_write(grant, resource, step, value))

    def ledger_write(self, grant: Any, resource: str, step: int, value: int) -> dict[str, Any]:
        from django.db import transaction

        from coordination import fencing
        from coordination.models import Fence, IdempotencyRecord

        record = f"chaos:{resource}:{grant.token}:{step}"
        if self.fencing:
            with fencing.fence(resource, grant, step=step):
                fencing.idempotent(record, lambda: {"value": value})
            return {}
        with transaction.atomic():
            Fence.objects.get_or_create(resource=resource, defaults={"lock_key": grant.key})
            Fence.objects.filter(resource=resource).update(
                **unchecked_watermark("token", "step", grant.token, step)
            )
            IdempotencyRecord.objects.update_or_create(
                key=record, defaults={"result": {"value": value}, "completed": True}
            )
        return {}

    def write_store(
        self, grant: Any, resource: str, write: Callable[[Any, int, int], dict[str, Any]]
    ) -> None:
        """A write of an object or a Redis key (:mod:`.stores`): the store itself
        refuses a stale token, and records the refusal in the database."""
        step, value = grant.next_step(), self.next_value()
        self.perform("write", self.write_fields(grant, resource, step, value),
                     lambda: write(grant, step, value))

    def write_document(self, grant: Any, pk: int) -> None:
        """A write through the fenced document store (the REST fencing proxy's core)."""
        from django.db import transaction

        from coordination import documents
        from coordination.models import Document, Fence

        name = f"chaos-{pk}"
        resource = documents.document_resource(name)
        step, value = grant.next_step(), self.next_value()

        def write() -> dict[str, Any]:
            if self.fencing:
                documents.put_document(name, grant, {"value": value}, step=step)
                return {}
            with transaction.atomic():
                row, _ = Fence.objects.get_or_create(resource=resource, defaults={"lock_key": grant.key})
                Fence.objects.filter(pk=row.pk).update(
                    **unchecked_watermark("token", "step", grant.token, step)
                )
                Document.objects.update_or_create(
                    name=name, defaults={"fence": row, "data": {"value": value}}
                )
            return {}

        self.perform("write", self.write_fields(grant, resource, step, value), write)


def granted(grant: Any) -> dict[str, Any]:
    """What an acknowledged grant records in the history."""
    return {
        "token": grant.token, "holder": grant.holder,
        "acquired_at": iso(grant.acquired_at), "expires_at": iso(grant.expires_at),
    }


def unchecked_watermark(token_field: str, step_field: str, token: int, step: int) -> dict[str, Any]:
    """The watermark a write without fencing leaves: its own (token, step), or the
    higher one already there.

    Such a writer writes its data whatever the watermark says, but it cannot
    lower the watermark: the database refuses that (rule 8 of docs/rules.md).
    A SET sees the row as it was, so both columns compare the same old pair.
    """
    from django.db.models import BigIntegerField, Case, F, Q, Value, When

    raises = Q(**{f"{token_field}__lt": token}) | Q(**{token_field: token, f"{step_field}__lt": step})
    return {
        field: Case(
            When(raises, then=Value(value)), default=F(field), output_field=BigIntegerField()
        )
        for field, value in ((token_field, token), (step_field, step))
    }


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this worker when the controller dies, however it dies."""
    with contextlib.suppress(Exception):
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    with open(argv[0], encoding="utf-8") as source:
        config = json.load(source)
    die_with_parent()
    if os.getppid() != int(config["parent"]):
        return 1  # the controller is already gone
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", config["settings"])
    os.environ["COORDINATION_LOG_LEVEL"] = "ERROR"
    from django.conf import settings

    settings.DATABASES["default"] = config["database"]
    import django

    django.setup()
    worker = Worker(config)

    def stop(signum: int, frame: Any) -> None:
        worker.stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the controller decides when to stop
    worker.run()
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
