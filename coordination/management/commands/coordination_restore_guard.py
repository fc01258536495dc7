"""``manage.py coordination_restore_guard``: keep tokens and watermarks ahead after a restore.

A dry run by default: it prints what it would change. ``--apply`` changes it.
See :mod:`coordination.restore` and docs/operations-tools.md for the procedures.
"""

from __future__ import annotations

from argparse import ArgumentParser, ArgumentTypeError
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from coordination import restore
from coordination.conf import app_settings
from coordination.exceptions import CoordinationError
from coordination.models import MAX_TOKEN, Lock


def _positive(text: str) -> int:
    try:
        value = int(text)  # accepts 1_000_000 too
    except ValueError:
        raise ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise ArgumentTypeError(f"must be at least 1, not {value}")
    return value


class Command(BaseCommand):
    help = (
        "After restoring the lock database from a backup, --bump N raises the token floor by N "
        "(covering keys the backup never saw) and every lock's token counter by N. After "
        "restoring a resource store, --raise-fences raises every watermark "
        "to its lock's last issued token and revokes the current leases. Both when one database "
        "holds locks and resources. Prints the plan; changes nothing without --apply."
    )

    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.add_argument(
            "--bump", type=_positive, metavar="N",
            help="raise the token floor and every lock's token counter by N: more than any key "
            "can have issued since the backup was taken, keys first granted since included "
            "(e.g. 1000000000)",
        )
        parser.add_argument(
            "--raise-fences", action="store_true",
            help="raise Fence watermarks and FencedModel fence columns to their lock's last "
            "issued token, and revoke every current lease",
        )
        parser.add_argument(
            "--apply", action="store_true", help="make the changes (default: dry run)"
        )
        parser.add_argument(
            "--batch-size", type=_positive, default=1000, metavar="ROWS",
            help="rows per transaction (default 1000)",
        )
        parser.add_argument("--database", help="the coordination database alias (default: setting)")

    def handle(self, *args: Any, **options: Any) -> None:
        bump: int | None = options["bump"]
        if bump is None and not options["raise_fences"]:
            raise CommandError("say what was restored: --bump N (the lock database), "
                               "--raise-fences (a resource store), or both")
        apply: bool = options["apply"]
        verbosity: int = options["verbosity"]
        report = restore.RestoreReport(applied=apply)
        kwargs: dict[str, Any] = {
            "apply": apply, "batch_size": options["batch_size"], "using": options["database"],
            "report": report, "say": self._say(verbosity), "progress": self._progress(verbosity),
        }
        if not apply:
            self.stdout.write("Dry run: nothing will be changed (add --apply to change it).")
        live = Lock.objects.using(options["database"] or app_settings.DATABASE).held().count()
        if live:
            # Leases restored from a backup have long run out by the database
            # clock; live ones mean clients are acquiring right now.
            self.stderr.write(
                f"WARNING: {live} lease(s) are live by the database clock: are all clients "
                "stopped? A grant made between the restore and the guard is not protected."
            )
        try:
            if bump is not None:
                restore.bump_tokens(bump, **kwargs)
            if options["raise_fences"]:
                restore.raise_fences(pending_bump=bump or 0, **kwargs)
        except CoordinationError as error:
            raise CommandError(error.detail) from error
        self._summarise(report, bump)

    def _say(self, verbosity: int) -> restore.Say:
        """Each change at -v 2; warnings always, on stderr."""

        def say(line: str) -> None:
            if line.startswith("WARNING"):
                self.stderr.write(line)
            elif verbosity >= 2:
                self.stdout.write(line)

        return say

    def _progress(self, verbosity: int) -> restore.Say:
        def progress(line: str) -> None:
            if verbosity >= 1:
                self.stdout.write(line)

        return progress

    def _summarise(self, report: restore.RestoreReport, bump: int | None) -> None:
        def verb(done: str, planned: str) -> str:
            return done if report.applied else planned

        parts = []
        if report.floor_after is not None:
            parts.append(
                f"{verb('raised', 'would raise')} the token floor from {report.floor_before} "
                f"to {report.floor_after}"
            )
        if bump is not None:
            parts.append(
                f"{verb('bumped', 'would bump')} {report.locks_bumped} lock counter(s) by {bump}"
            )
        if report.fences_raised or report.rows_raised or bump is None:
            rows = ", ".join(f"{count} {label} row(s)" for label, count in report.rows_raised.items())
            parts.append(
                f"{verb('raised', 'would raise')} {report.fences_raised} fence(s)"
                + (f" and {rows}" if rows else "")
                + " to their lock's last token, closed to it"
            )
        parts.append(f"{verb('revoked', 'would revoke')} {report.leases_revoked} lease(s)")
        self.stdout.write("; ".join(parts) + ".")
        for label, count in report.rows_unsupported.items():
            self.stderr.write(
                f"{label}: {count} row(s) have no computable lock key (fence_lock values "
                "containing ':', or a template over non-column fields); no grant can write "
                "them, so they were left alone."
            )
        if report.ahead_of_lock:
            self.stderr.write(
                f"{len(report.ahead_of_lock)} watermark(s) are above their lock's counter: "
                "the lock database is behind. Run --bump N as well."
            )
        if report.applied and not report.changed:
            self.stdout.write("Nothing to change: already guarded.")
        if not report.applied:
            self.stdout.write("Dry run: nothing was changed. Run again with --apply.")
        if bump is not None and bump > MAX_TOKEN // 1024:
            self.stderr.write(
                f"A bump of {bump} spends a large share of the 64-bit token space; "
                "choose N just above the grants a key can make between backup and restore."
            )
