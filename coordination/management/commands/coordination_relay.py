"""``manage.py coordination_relay``: send the outbox's calls, one relay among many.

Every machine may run it: they campaign for the role ``coordination-relay``
(:mod:`coordination.election`) and only the leader sends. A new term first
recovers the calls an earlier relay left in ``sending`` (docs/outbox.md).
"""

from __future__ import annotations

import os
import socket
import time
from argparse import ArgumentParser
from typing import Any

from django.core.management.base import BaseCommand

from coordination import election
from coordination.exceptions import CoordinationError, LockHeld
from coordination.stores.outbox import Relay

ROLE = "coordination-relay"


class Command(BaseCommand):
    help = (
        "Send the outbox's recorded calls with their idempotency keys, as the elected relay "
        "(role coordination-relay); standbys wait for the leader's term to end."
    )

    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.add_argument("--candidate", default=f"{socket.gethostname()}:{os.getpid()}",
                            help="this relay's name in the election (default host:pid)")
        parser.add_argument("--ttl", type=float, default=10.0,
                            help="the relay term's lease, renewed every ttl/3 (default 10)")
        parser.add_argument("--interval", type=float, default=1.0,
                            help="seconds between polls when nothing is due (default 1)")
        parser.add_argument("--retry-delay", type=float, default=5.0,
                            help="first delay before a retryable call is sent again, doubled each time")
        parser.add_argument("--once", action="store_true",
                            help="win the election (waiting up to --wait), send what is due, exit")
        parser.add_argument("--wait", type=float, default=60.0,
                            help="seconds to wait for the role in each campaign (default 60)")
        parser.add_argument("--database", help="the coordination database alias (default: setting)")

    def handle(self, *args: Any, **options: Any) -> None:
        while True:
            try:
                leadership = election.campaign(
                    ROLE, candidate=options["candidate"], ttl=options["ttl"],
                    wait=options["wait"], using=options["database"],
                )
            except LockHeld:
                if options["once"]:
                    self.stderr.write("another relay leads; nothing sent")
                    return
                continue
            self.stdout.write(f"relay term {leadership.term}: {options['candidate']}")
            relay = Relay(leadership.lease, retry_delay=options["retry_delay"],
                          using=options["database"])
            try:
                recovered = relay.recover()
                if recovered:
                    self.stdout.write(f"recovered {recovered} call(s) left in sending")
                while not leadership.lost:
                    sent = relay.run_once()
                    if sent:
                        self.stdout.write(f"sent {sent} call(s)")
                    elif options["once"]:
                        return
                    else:
                        time.sleep(options["interval"])
            except CoordinationError as error:  # a newer term wrote: this one is over
                self.stderr.write(f"relay term {leadership.term} ended: {error}")
                if options["once"]:
                    return
            finally:
                leadership.resign()
