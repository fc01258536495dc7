"""coordination: lease locks with fencing tokens for Django.

The public API lives in documented modules:

- :mod:`coordination.locks`: the grant point (``acquire``, ``renew``, ``release``,
  ``revoke``, ``hold``); ``acquire`` returns a :class:`~coordination.leases.Lease`.
- :mod:`coordination.backends`: one grant-point backend per database
  (``get_backend``; ``COORDINATION["GRANT_POINT"]``).
- :mod:`coordination.fencing`: the resource side (``FencedModel``,
  ``fenced_update``, ``fence``, ``idempotent``).
- :mod:`coordination.exceptions`: ``CoordinationError`` and its subclasses.
"""

__version__ = "0.1.0"
