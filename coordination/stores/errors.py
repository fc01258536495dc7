"""The error every store raises when it cannot be reached."""

from __future__ import annotations

from ..exceptions import CoordinationError


class StoreUnavailable(CoordinationError):
    """The store did not answer (connection refused, a timeout, a 5xx): the write's
    outcome is unknown.

    A store's write is one request or one script, so it applied whole or not at
    all; a retry with the same (token, step) is then refused as a duplicate if it
    had applied, and a write with the lease's next step is accepted either way.
    """

    code = "store_unavailable"
    status_code = 503
    default_detail = "The store did not answer; the write may or may not have applied."

    def __init__(self, store: str, reason: str = "") -> None:
        self.store = store
        self.reason = reason
        super().__init__(
            f"{store} did not answer ({reason or 'no reason given'}): the write may or may "
            "not have applied; retry it with the lease's next step",
            store=store,
        )
