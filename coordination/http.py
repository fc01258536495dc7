"""Fencing across services over HTTP: the ``Fencing-Token`` header.

A holder in one service (a Celery task, an async job) calls an HTTP endpoint
of another Django service that shares the grant database. The sender puts its
grant in a header::

    import requests
    from coordination.http import fencing_token_header

    requests.post(url, json=..., headers=fencing_token_header(grant))
    # Fencing-Token: key="invoice:7", token=42, step=3, proof="<lease_id>"

and the receiving view checks it where its writes happen::

    from coordination.http import fenced_view

    @fenced_view(lock="invoice:{pk}")
    def set_total(request, pk):
        Invoice.objects.filter(pk=pk).update(total=...)   # inside the fence's transaction
        return JsonResponse({"ok": True})

The check (rule 4 of docs/rules.md) is :func:`coordination.fencing.fence` on a
Fence row named after the lock key (``resource=`` names another), taken in
the same transaction as the view's own writes: the row is locked, the
(token, step) is compared with its watermark and raised, the view runs, and
all of it commits together, or nothing does (the view raised). A refusal is
answered in the REST API's error shape, ``{"code": ..., "detail": ...}``:
``409 stale_token`` (a newer token has written; ``current_token`` says
which), ``409 duplicate_write`` (this token already sent this step),
``409 wrong_lock`` (the header's key is not the one the URL asks for),
``409 lease_lost`` (the proof does not match a grant of that token) or
``400 invalid`` (no header, or a malformed one).

The proof is the grant's ``lease_id``, checked against the grant database as
the REST API checks it (:func:`coordination.locks.grant_from_proof`, constant
time): a client cannot invent a high token to fence everyone else out. It is
the lease's secret (whoever holds it can also renew and release the lease),
so send it only over TLS, to services you would trust with the lease. A
service that does not share the grant database cannot check the proof; put
it behind the fenced document store of the REST API instead (rule 10).

For Django REST framework views, :class:`FencedViewMixin` does the same for
the unsafe methods.
"""

from __future__ import annotations

import functools
import inspect
import re
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from django.http import HttpRequest, HttpResponse, JsonResponse
from rest_framework.request import Request
from rest_framework.response import Response

from . import fencing, locks
from .exceptions import CoordinationError, InvalidInput, WrongLock
from .leases import Lease
from .models import MAX_TOKEN, Fence, validate_key

__all__ = [
    "FENCING_TOKEN_HEADER",
    "FencedRequest",
    "FencedViewMixin",
    "PresentedToken",
    "fenced_request",
    "fenced_view",
    "fencing_token_header",
    "parse_fencing_token",
]

FENCING_TOKEN_HEADER = "Fencing-Token"

_ITEM = re.compile(r'\s*(?P<name>[a-z]+)=(?:"(?P<text>[^"\\]*)"|(?P<number>[0-9]{1,19}))\s*')
_NAMES = ("key", "token", "step", "proof")
_View = TypeVar("_View", bound=Callable[..., HttpResponse])


@dataclass(frozen=True, slots=True)
class PresentedToken:
    """What a ``Fencing-Token`` header claims: not checked yet. ``proof`` is the
    lease's secret and never shown by ``repr()``."""

    key: str
    token: int
    step: int
    proof: str

    def __repr__(self) -> str:
        return f"PresentedToken(key={self.key!r}, token={self.token}, step={self.step})"


@dataclass(frozen=True, slots=True)
class FencedRequest:
    """A request whose token passed the fence: the proven grant, its step and the
    Fence row (locked, with its raised watermark, until the view's transaction ends)."""

    grant: Lease
    step: int
    fence: Fence


def fencing_token_header(grant: Lease, *, step: int | None = None) -> dict[str, str]:
    """The ``Fencing-Token`` header for one call made under ``grant``, as a dict to
    pass as an HTTP client's headers.

    ``step`` defaults to the grant's next write number (``grant.next_step()``),
    so successive calls under one token are distinct steps and a repeated call
    is refused as a duplicate: retry with the same step only through an
    idempotent endpoint. Carries the lease's secret as the proof: see the
    module's docstring.
    """
    number = grant.next_step() if step is None else step
    if isinstance(number, bool) or not isinstance(number, int) or not 0 < number <= MAX_TOKEN:
        raise InvalidInput(f"step must be an integer from 1 to {MAX_TOKEN}")
    value = f'key="{grant.key}", token={grant.token}, step={number}, proof="{grant.lease_id}"'
    return {FENCING_TOKEN_HEADER: value}


def parse_fencing_token(value: str | None) -> PresentedToken:
    """The claim of a ``Fencing-Token`` header value; ``InvalidInput`` if it is
    missing or malformed (each of ``key``, ``token``, ``step``, ``proof`` once)."""
    if not value:
        raise InvalidInput(
            f"this endpoint needs a {FENCING_TOKEN_HEADER} header "
            '(key="...", token=N, step=N, proof="..."), sent by the lock\'s holder'
        )
    items: dict[str, str | int] = {}
    for part in value.split(","):
        match = _ITEM.fullmatch(part)
        name = match.group("name") if match else None
        if match is None or name not in _NAMES or name in items:
            raise InvalidInput(f"malformed {FENCING_TOKEN_HEADER} header near {part.strip()[:40]!r}")
        text, number = match.group("text"), match.group("number")
        if (name in ("key", "proof")) != (text is not None):
            raise InvalidInput(f"{FENCING_TOKEN_HEADER}: {name} must be a "
                               f"{'quoted string' if name in ('key', 'proof') else 'number'}")
        items[name] = text if text is not None else int(number)
    missing = [name for name in _NAMES if name not in items]
    if missing:
        raise InvalidInput(f"{FENCING_TOKEN_HEADER} header lacks {', '.join(missing)}")
    token, step = int(items["token"]), int(items["step"])
    if not 0 < token <= MAX_TOKEN or not 0 < step <= MAX_TOKEN:
        raise InvalidInput(f"{FENCING_TOKEN_HEADER}: token and step must be from 1 to {MAX_TOKEN}")
    return PresentedToken(
        key=validate_key(str(items["key"])), token=token, step=step, proof=str(items["proof"])
    )


@contextmanager
def fenced_request(
    header: str | None, *, lock: str, resource: str | None = None, using: str | None = None
) -> Iterator[FencedRequest]:
    """Check a ``Fencing-Token`` header value for the lock key ``lock``, and run the
    block inside the fence's transaction.

    Raises ``InvalidInput`` (no or a malformed header), ``WrongLock`` (a grant
    of another key), ``LeaseLost`` (the proof does not match) or the fence's
    refusals (``StaleToken``, ``DuplicateWrite``) before the block runs; the
    fence's refusals are recorded as Rejections. The block's database writes
    (on ``using``, the grant database by default) commit with the new watermark,
    or roll back with it if the block raises.
    """
    presented = parse_fencing_token(header)
    if presented.key != lock:
        # Rule 7: a token of another key is refused, never compared.
        raise WrongLock(
            f"the {FENCING_TOKEN_HEADER} is a grant of {presented.key!r}; this resource is "
            f"guarded by {lock!r}"
        )
    grant = locks.grant_from_proof(presented.key, presented.token, presented.proof, using=using)
    with fencing.fence(resource or lock, grant, step=presented.step, using=using) as row:
        yield FencedRequest(grant=grant, step=presented.step, fence=row)


def _error_response(error: CoordinationError) -> JsonResponse:
    return JsonResponse(error.as_dict(), status=error.status_code)


def _lock_key(template: str, kwargs: Mapping[str, Any]) -> str:
    try:
        return validate_key(template.format(**kwargs))
    except (KeyError, IndexError) as error:
        raise InvalidInput(f"lock template {template!r} names {error}, not in the URL") from None


def fenced_view(
    *, lock: str, resource: str | None = None, using: str | None = None
) -> Callable[[_View], _View]:
    """Decorate a Django view so that it runs only for the current holder of ``lock``.

    ``lock`` is a key template over the URL's keyword arguments
    (``"invoice:{pk}"``); ``resource`` names the Fence row (a template too;
    default: the lock key). The request's ``Fencing-Token`` header is checked
    by :func:`fenced_request`; the view runs inside the fence's transaction and
    gets the result as ``request.fencing`` (a :class:`FencedRequest`). Refusals
    are answered ``{"code", "detail", ...}`` with their status (409, or 400
    for a missing or malformed header), as are coordination errors the view
    itself raises (its writes rolled back). A response the view returns
    commits, whatever its status, as with ``ATOMIC_REQUESTS``.

    Only for sync views: the fence's transaction and the view's writes must
    share one connection, which an ``async def`` view's ORM calls do not.
    """

    def decorate(view: _View) -> _View:
        if inspect.iscoroutinefunction(view):
            raise InvalidInput(
                f"fenced_view cannot wrap the async view {view.__qualname__}: its ORM calls run "
                "on other threads, outside the fence's transaction; make it a sync view"
            )

        @functools.wraps(view)
        def wrapped(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
            try:
                key = _lock_key(lock, kwargs)
                name = _lock_key(resource, kwargs) if resource else None
                with fenced_request(
                    request.headers.get(FENCING_TOKEN_HEADER), lock=key, resource=name, using=using
                ) as fenced:
                    request.fencing = fenced  # type: ignore[attr-defined]
                    return view(request, *args, **kwargs)
            except CoordinationError as error:
                return _error_response(error)

        return wrapped  # type: ignore[return-value]

    return decorate


class FencedViewMixin:
    """For DRF views: unsafe methods run only for the current holder of ``fence_lock``.

    Set ``fence_lock`` (a key template over the URL's keyword arguments) and,
    optionally, ``fence_resource`` and ``fence_using``. After DRF's
    authentication, permissions and throttles, the ``Fencing-Token`` header of
    a ``POST``, ``PUT``, ``PATCH`` or ``DELETE`` (``fenced_methods``) is
    checked as :func:`fenced_view` does, and the handler runs inside the
    fence's transaction (``self.fencing`` is the :class:`FencedRequest`): it
    commits when the response is finalized, and rolls back if the handler
    raises. Coordination refusals are answered in the REST API's error shape,
    whatever the site's ``EXCEPTION_HANDLER``. Put it first among the bases::

        class InvoiceTotal(FencedViewMixin, APIView):
            fence_lock = "invoice:{pk}"
    """

    fence_lock: ClassVar[str]
    fence_resource: ClassVar[str | None] = None
    fence_using: ClassVar[str | None] = None
    fenced_methods: ClassVar[tuple[str, ...]] = ("POST", "PUT", "PATCH", "DELETE")

    fencing: FencedRequest | None = None
    _fence_stack: ExitStack | None = None

    def initial(self, request: Request, *args: Any, **kwargs: Any) -> None:
        super().initial(request, *args, **kwargs)  # type: ignore[misc]
        if request.method not in self.fenced_methods:
            return
        key = _lock_key(self.fence_lock, kwargs)
        name = _lock_key(self.fence_resource, kwargs) if self.fence_resource else None
        stack = ExitStack()
        self.fencing = stack.enter_context(
            fenced_request(
                request.headers.get(FENCING_TOKEN_HEADER), lock=key, resource=name,
                using=self.fence_using,
            )
        )
        self._fence_stack = stack

    def handle_exception(self, exc: Exception) -> Response:
        stack, self._fence_stack = self._fence_stack, None
        if stack is not None:
            stack.__exit__(type(exc), exc, exc.__traceback__)  # roll back the handler's writes
        if isinstance(exc, CoordinationError):
            return Response(exc.as_dict(), status=exc.status_code)
        response: Response = super().handle_exception(exc)  # type: ignore[misc]
        return response

    def finalize_response(
        self, request: Request, response: Any, *args: Any, **kwargs: Any
    ) -> Any:
        stack, self._fence_stack = self._fence_stack, None
        if stack is not None:
            stack.close()  # commit the handler's writes with the new watermark
        return super().finalize_response(request, response, *args, **kwargs)  # type: ignore[misc]
