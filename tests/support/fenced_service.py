"""Service B of the cross-service example: endpoints that accept a write only from
the current holder of the account's lock, proven by its ``Fencing-Token`` header.
Mounted by the HTTP fencing tests (``@pytest.mark.urls``), as a user mounts them."""

from __future__ import annotations

import json
from decimal import Decimal

from django.http import HttpRequest, JsonResponse
from django.urls import path
from django.views.decorators.csrf import csrf_exempt
from rest_framework.permissions import AllowAny
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from coordination.http import FencedViewMixin, fenced_view
from project.demo.models import Account


@csrf_exempt
@fenced_view(lock="account:{pk}")
def set_balance(request: HttpRequest, pk: int) -> JsonResponse:
    # Inside the fence's transaction: a plain update is enough, the fence row is
    # locked and its watermark raised in the same transaction.
    balance = Decimal(json.loads(request.body)["balance"])
    Account.objects.filter(pk=pk).update(balance=balance)
    if balance < 0:
        raise ValueError("negative balance")  # the update above rolls back with the fence
    return JsonResponse({"balance": str(balance), "token": request.fencing.grant.token})  # type: ignore[attr-defined]


class AccountBalance(FencedViewMixin, APIView):
    fence_lock = "account:{pk}"
    permission_classes = [AllowAny]
    authentication_classes: list[type] = []

    def put(self, request: Request, pk: int) -> Response:
        Account.objects.filter(pk=pk).update(balance=Decimal(str(request.data["balance"])))
        assert self.fencing is not None
        return Response({"balance": request.data["balance"], "token": self.fencing.grant.token})


urlpatterns = [
    path("accounts/<int:pk>/balance", set_balance),
    path("drf/accounts/<int:pk>/balance", AccountBalance.as_view()),
]
