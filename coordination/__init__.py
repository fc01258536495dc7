"""coordination: lease locks with fencing tokens for Django.

The public API lives in documented modules:

- :mod:`coordination.locks`: the grant point (``acquire``, ``renew``, ``release``,
  ``revoke``, ``hold``); ``acquire`` returns a :class:`~coordination.leases.Lease`.
  For async code, beside them: ``aacquire``, ``arenew``, ``arelease``, ``ahold``
  (run on the app's threads, :mod:`coordination.aio`).
- :mod:`coordination.keepalive`: keeping a lease alive, ``KeepAlive`` (a thread)
  and ``AsyncKeepAlive`` (an asyncio task), one schedule for both.
- :mod:`coordination.backends`: one grant-point backend per database
  (``get_backend``; ``COORDINATION["GRANT_POINT"]``).
- :mod:`coordination.fencing`: the resource side (``FencedModel``,
  ``fenced_update`` and ``afenced_update``, ``fence`` and ``afence``, ``idempotent``).
- :mod:`coordination.http`: fencing across services, the ``Fencing-Token`` header
  (``fencing_token_header``, ``fenced_view``, ``FencedViewMixin``).
- :mod:`coordination.testing`: a pytest plugin for your own tests
  (``pytest_plugins = ["coordination.testing"]``; the ``fencing_race`` fixture).
- :mod:`coordination.exceptions`: ``CoordinationError`` and its subclasses.

And here, for operators and data migrations: ``coordination.unfenced(reason=...)``,
the audited way to save stale instances of fenced models
(:func:`coordination.fencing.unfenced`).
"""

# The audited escape hatch, importable before Django's apps are ready: it
# imports nothing of the app's models.
from .fenced.unfenced import unfenced

__version__ = "0.1.0"

__all__ = ["__version__", "unfenced"]
