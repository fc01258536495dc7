"""Any other path under the API: the API's error shape, never an HTML page."""

from __future__ import annotations

import json

from django.http import HttpRequest, HttpResponse, HttpResponsePermanentRedirect, JsonResponse
from django.urls import Resolver404, resolve
from django.views.decorators.csrf import csrf_exempt


@csrf_exempt
def no_endpoint(request: HttpRequest, rest: str = "") -> HttpResponse:
    """Unknown paths under the API get the API's error shape, not an HTML page,
    for every method.

    Exempt from the CSRF check, as the API's views are (they authenticate by
    token, or check CSRF themselves for a session): it changes nothing, and a
    POST or PUT to a wrong path must learn that the path is wrong, not that a
    CSRF cookie is missing. A path asked for without its trailing slash
    (``/api/locks``) is redirected to it with ``308 Permanent Redirect``, which
    keeps the method and body (a 301 turns a POST into a GET in most clients),
    and a JSON body in the error shape naming the ``location``.
    """
    if not request.path.endswith("/"):
        try:
            match = resolve(request.path + "/")
        except Resolver404:
            match = None
        if match is not None and match.url_name != "no-endpoint":
            query = request.META.get("QUERY_STRING", "")
            location = request.path + "/" + (f"?{query}" if query else "")
            body = {
                "code": "permanent_redirect",
                "detail": f"The endpoint is at {request.path}/ (with a trailing slash); "
                "repeat the request there.",
                "location": location,
            }
            return HttpResponsePermanentRedirect(
                location, preserve_request=True, content=json.dumps(body), content_type="application/json"
            )
    detail = f"No API endpoint at {request.path}; the OpenAPI schema lists them all."
    return JsonResponse({"code": "not_found", "detail": detail}, status=404)
