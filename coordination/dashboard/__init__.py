"""What the admin dashboard shows, computed with the database clock.

Every "now" here is :func:`coordination.locks.database_now`, the clock leases
are decided with (rule 11 of docs/rules.md), so a bar ends where the grant point says the
lease ended. The pictures are plain geometry (pixel positions in dataclasses)
that the template draws as inline SVG: no JavaScript, no CDN.

What a viewer sees is what their permissions and access rules let them read
(:class:`Shown`): grant holders and tokens only with ``view_grant``, refused
writes only with ``view_rejection``, accepted writes only with
``view_acceptedwrite``, and only of the keys their rules allow reading. A part
they may not see is None, left out of the page rather than shown as zero.

The package, from the bottom up: ``geometry`` (pixel sizes, the time axis,
labels), ``data`` (the dataclasses the templates read), ``queries`` (the
reads, limited to what the viewer may see), ``pages`` (the lock dashboard)
and ``jobs_page`` (the jobs page).
"""

from .data import Dashboard, Shown, SlotRow, Timeline
from .geometry import _short_holder as _short_holder  # the tests read it here
from .jobs_page import JobRow, Jobs, build_jobs, registered_fenced_tasks
from .pages import TIMELINE_LOCKS, build_dashboard, build_semaphore_timeline, build_timeline
from .queries import recent_keys

__all__ = [
    "TIMELINE_LOCKS", "Dashboard", "JobRow", "Jobs", "Shown", "SlotRow", "Timeline",
    "build_dashboard", "build_jobs", "build_semaphore_timeline", "build_timeline", "recent_keys",
    "registered_fenced_tasks",
]
