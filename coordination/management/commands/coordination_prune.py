"""``manage.py coordination_prune --older-than 30d``: delete old history in batches."""

from __future__ import annotations

from argparse import ArgumentParser
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from coordination import pruning
from coordination.exceptions import InvalidInput


class Command(BaseCommand):
    help = (
        "Delete ended grants (never a kept lock's latest grant), rejections, idempotency records, "
        "accepted-write records, execution records, ended unique-job claims and rate-limit starts "
        "no window counts older than --older-than, and the rows of locks unused for "
        "COORDINATION['PRUNE_LOCKS_AFTER'] (and --older-than) with their grants, after raising "
        "the token floor above their counters; in short batches, safe while the service runs. "
        "Fence rows are never deleted."
    )

    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.add_argument(
            "--older-than", required=True, metavar="AGE",
            help="age by the database clock: a whole number and s, m, h or d (30d, 12h, 90m)",
        )
        parser.add_argument(
            "--batch-size", type=int, default=1000, metavar="ROWS",
            help="rows deleted per transaction (default 1000)",
        )
        parser.add_argument(
            "--dry-run", action="store_true", help="count what would be deleted; delete nothing"
        )
        parser.add_argument("--database", help="the coordination database alias (default: setting)")

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            age = pruning.parse_age(options["older_than"])
            verbose = options["verbosity"] >= 1
            counts = pruning.prune(
                age,
                apply=not options["dry_run"],
                batch_size=options["batch_size"],
                using=options["database"],
                progress=(lambda line: self.stdout.write(line)) if verbose else (lambda line: None),
            )
        except InvalidInput as error:
            raise CommandError(error.detail) from error
        verb = "Would delete" if options["dry_run"] else "Deleted"
        summary = ", ".join(f"{count} {name}" for name, count in counts.items())
        self.stdout.write(f"{verb} {summary} older than {options['older_than']}.")
