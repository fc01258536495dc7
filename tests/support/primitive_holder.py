"""A holder process for the primitives' real-process tests (docs/primitives.md).

Run as ``python -m tests.support.primitive_holder pair|permit|reader <name> <ttl>``
with the worker environment (``celery_workers.worker_environment``): it takes a
grant (``pair``: ``acquire_many`` of ``<name>:a`` and ``<name>:b``; ``permit``:
one permit of the semaphore ``<name>`` with limit 2; ``reader``: a shared grant
of ``<name>``), writes under it once,
prints ``{"pid", "grants": {key: [token, expires_at]}}`` as a JSON line, then
waits for a line on stdin (the test stops it with SIGSTOP meanwhile) and writes
again under the same grant, printing ``{"outcome": "accepted"}`` or the error's
code.
"""

from __future__ import annotations

import json
import os
import sys


def main(argv: list[str]) -> int:
    import django

    django.setup()
    from coordination import locks
    from coordination.exceptions import CoordinationError
    from coordination.fencing import fence
    from coordination.leases import Lease
    from coordination.semaphores import acquire_permit
    from coordination.shared import acquire_shared

    kind, name, ttl = argv[0], argv[1], float(argv[2])
    grants: dict[str, Lease]
    if kind == "pair":
        grants = locks.acquire_many([f"{name}:a", f"{name}:b"], holder="paused", ttl=ttl)
    elif kind == "reader":
        grants = {name: acquire_shared(name, holder="paused", ttl=ttl)}
    else:
        permit = acquire_permit(name, limit=2, holder="paused", ttl=ttl)
        grants = {permit.key: permit}
    resources = sorted(grants)
    with fence(resources, grants):
        pass
    report = {key: [lease.token, lease.expires_at.isoformat()] for key, lease in grants.items()}
    print(json.dumps({"pid": os.getpid(), "grants": report}), flush=True)
    sys.stdin.readline()  # paused here (SIGSTOP) until the test lets it go on
    try:
        with fence(resources, grants):
            pass
    except CoordinationError as error:
        print(json.dumps({"outcome": error.code}), flush=True)
    else:
        print(json.dumps({"outcome": "accepted"}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
