"""coordination: lease locks with fencing tokens for Django.

The public API lives in documented modules:

- :mod:`coordination.locks`: the grant point (``acquire``, ``renew``, ``release``,
  ``revoke``, ``hold``).
- :mod:`coordination.fencing`: the resource side (``FencedModel``,
  ``fenced_update``, ``fence``, ``idempotent``).
- :mod:`coordination.exceptions`: ``CoordinationError`` and its subclasses.
"""

__version__ = "0.1.0"
