"""A producer process of the unique jobs' tests: ``python -m tests.support.unique_producer
<run> <n> <queue> <report> <barrier dir> [<folder>]`` with the worker environment
(``celery_workers.worker_environment``). Connected to the database, it says it is
ready (``<barrier>/ready-<n>``), waits for ``<barrier>/go`` so that every producer
enqueues at once, enqueues ``unique_tasks.until_succeeded(run, n)`` once and prints
``{"n", "id", "duplicate"}`` as a JSON line. With a ``folder``, the message goes
to a filesystem broker in that folder (the embedded default's transport).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any


def main(argv: list[str]) -> int:
    import django

    django.setup()
    from django.db import connection

    from tests.support.unique_tasks import until_succeeded

    run, n, queue, report, barrier = argv[0], int(argv[1]), argv[2], argv[3], Path(argv[4])
    connection.ensure_connection()
    (barrier / f"ready-{n}").touch()
    deadline = time.monotonic() + 60
    while not (barrier / "go").exists():
        if time.monotonic() > deadline:
            return 2
        time.sleep(0.002)
    options: dict[str, Any] = {}
    if len(argv) > 5:
        from project.celery import app

        options["connection"] = app.connection_for_write(
            "filesystem://", transport_options={"data_folder_in": argv[5], "data_folder_out": argv[5]}
        )
    result: Any = until_succeeded.apply_async((run, n), {"report": report}, queue=queue, **options)
    duplicate = bool(getattr(result, "duplicate", False))  # False where nothing says so
    print(json.dumps({"n": n, "id": result.id, "duplicate": duplicate}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
