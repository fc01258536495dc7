"""``manage.py coordination_asgi_bench``: concurrent ``async with ahold(...)`` requests
under uvicorn, with the server's event-loop lag (see project/lab/asgi_bench.py)."""

from __future__ import annotations

import json
from typing import Any

from django.core.management.base import BaseCommand, CommandParser
from django.db import connections

from project.lab import asgi_bench


class Command(BaseCommand):
    help = (
        "Send N concurrent requests whose async views hold a lock with ahold() (and, to "
        "compare, with sync_to_async(acquire)) to a uvicorn server; report throughput, "
        "latency and the event-loop lag p50/p99."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--requests", type=int, default=500, help="concurrent requests (500)")
        parser.add_argument("--rounds", type=int, default=3, help="bursts per mode (3)")
        parser.add_argument(
            "--ramp", type=float, default=1.0, help="seconds over which the requests arrive (1)"
        )
        parser.add_argument(
            "--hold", type=float, default=1.0,
            help="seconds each request holds its lock, so all are in flight at once (1)",
        )
        parser.add_argument(
            "--mode", choices=["baseline", "ahold", "sync_to_async"], action="append",
            help="measure only this way of calling the grant point (repeatable)",
        )
        parser.add_argument(
            "--server", choices=sorted(asgi_bench.SERVERS), default="uvloop-httptools",
            help="uvicorn's event loop and HTTP parser: uvloop-httptools (uvicorn[standard]'s, "
            "the default) or asyncio-h11 (pure Python)",
        )
        parser.add_argument("--json", dest="json_path", help="write the results as JSON here")

    def handle(self, *args: Any, **options: Any) -> None:
        results = asgi_bench.run(
            requests=options["requests"], rounds=options["rounds"], ramp=options["ramp"],
            hold=options["hold"], modes=options["mode"], server_kind=options["server"],
        )
        # The async API's threads keep their connections, as the server's do.
        for alias in connections:
            connections.settings[alias].setdefault("CONN_MAX_AGE", 0)
            connections.settings[alias]["CONN_MAX_AGE"] = max(
                connections.settings[alias]["CONN_MAX_AGE"] or 0, 60
            )
        results["in_process"] = asgi_bench.in_process(
            requests=options["requests"], ramp=options["ramp"], hold=options["hold"]
        )
        self.stdout.write(asgi_bench.table(results))
        if options["json_path"]:
            with open(options["json_path"], "w") as out:
                json.dump(results, out, indent=2)
