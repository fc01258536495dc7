"""A process that queues for a permit and is killed while it waits (a dead waiter).

Run as ``python -m tests.support.permit_waiter <name> <ticket_ttl>`` with the
worker environment (``celery_workers.worker_environment``): it waits up to two
minutes for the one permit of semaphore ``<name>`` (limit 1), keeping its queue
ticket alive for ``<ticket_ttl>`` seconds at a time, and prints the holder it
got the permit as if it ever does. The test kills it (SIGKILL) while it waits,
so its ticket is left in the queue, never deleted.
"""

from __future__ import annotations

import sys


def main(argv: list[str]) -> int:
    import django

    django.setup()
    from django.conf import settings
    from django.test import override_settings

    name, ticket_ttl = argv[0], float(argv[1])
    override_settings(COORDINATION={**settings.COORDINATION, "TICKET_TTL": ticket_ttl}).enable()
    from coordination.semaphores import acquire_permit

    permit = acquire_permit(name, limit=1, holder="doomed", ttl=30, wait=120)
    print(permit.holder, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
