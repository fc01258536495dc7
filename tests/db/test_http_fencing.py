"""Fencing across services over HTTP: service A's holder calls service B (a Django
view, tests/support/fenced_service.py) with its grant in a ``Fencing-Token``
header. The paused holder whose lease expired is refused with 409 stale_token
once the new holder's call went through; the new holder gets 200."""

from __future__ import annotations

import json
from decimal import Decimal
from typing import Any

import pytest
from django.test import Client

from coordination import locks
from coordination.exceptions import InvalidInput
from coordination.http import FENCING_TOKEN_HEADER, fenced_view, fencing_token_header, parse_fencing_token
from coordination.models import Fence, Rejection, RejectionReason
from project.demo.models import Account
from tests.support.factories import AccountFactory
from tests.support.waiting import wait_until_database_time_passes

pytestmark = [pytest.mark.django_db, pytest.mark.urls("tests.support.fenced_service")]

PATHS = ["/accounts/{pk}/balance", "/drf/accounts/{pk}/balance"]


def call(client: Client, url: str, balance: str, headers: dict[str, str]) -> Any:
    method = client.post if url.startswith("/accounts") else client.put
    return method(url, json.dumps({"balance": balance}), content_type="application/json",
                  headers=headers)


@pytest.mark.parametrize("path", PATHS, ids=["fenced_view", "drf_mixin"])
def test_a_paused_holder_with_an_expired_lease_is_refused_and_the_new_holder_is_not(
    client: Client, path: str
) -> None:
    account = AccountFactory(balance=Decimal("10.00"))
    url = path.format(pk=account.pk)
    key = f"account:{account.pk}"
    a = locks.acquire(key, holder="service-a-worker-1", ttl=0.5)
    a_header = fencing_token_header(a)            # A prepares its call, then pauses
    wait_until_database_time_passes(a.expires_at)  # ...past its lease
    b = locks.acquire(key, holder="service-a-worker-2", ttl=30)

    accepted = call(client, url, "20.00", fencing_token_header(b))
    refused = call(client, url, "99.00", a_header)  # A wakes up and sends its old token

    assert accepted.status_code == 200, accepted.content
    assert accepted.json()["token"] == b.token
    assert refused.status_code == 409
    body = refused.json()
    assert body["code"] == "stale_token"
    assert body["current_token"] == b.token
    assert Account.objects.get(pk=account.pk).balance == Decimal("20.00")
    assert Fence.objects.get(resource=key).token == b.token
    assert Rejection.objects.get().reason == RejectionReason.STALE


@pytest.mark.parametrize("path", PATHS, ids=["fenced_view", "drf_mixin"])
def test_missing_forged_foreign_and_replayed_tokens_are_refused_in_the_api_error_shape(
    client: Client, path: str
) -> None:
    account = AccountFactory(balance=Decimal("10.00"))
    other = AccountFactory()
    url = path.format(pk=account.pk)
    grant = locks.acquire(f"account:{account.pk}", holder="a", ttl=30)
    foreign = locks.acquire(f"account:{other.pk}", holder="a", ttl=30)
    header = fencing_token_header(grant)
    forged = {FENCING_TOKEN_HEADER: f'key="account:{account.pk}", token=999, step=1, proof="guess"'}

    answers = {
        "missing": call(client, url, "1.00", {}),
        "malformed": call(client, url, "1.00", {FENCING_TOKEN_HEADER: "token=1"}),
        "forged": call(client, url, "1.00", forged),
        "foreign": call(client, url, "1.00", fencing_token_header(foreign)),
        "first": call(client, url, "11.00", header),
        "replayed": call(client, url, "12.00", header),
        "next step": call(client, url, "13.00", fencing_token_header(grant)),
    }

    codes = {name: (answer.status_code, answer.json()["code"] if answer.status_code != 200 else "ok")
             for name, answer in answers.items()}
    assert codes == {
        "missing": (400, "invalid"), "malformed": (400, "invalid"), "forged": (409, "lease_lost"),
        "foreign": (409, "wrong_lock"), "first": (200, "ok"), "replayed": (409, "duplicate_write"),
        "next step": (200, "ok"),
    }
    assert all(set(a.json()) >= {"code", "detail"} for a in answers.values() if a.status_code != 200)
    assert Account.objects.get(pk=account.pk).balance == Decimal("13.00")


def test_a_view_that_raises_rolls_back_its_writes_with_the_watermark(client: Client) -> None:
    account = AccountFactory(balance=Decimal("10.00"))
    grant = locks.acquire(f"account:{account.pk}", holder="a", ttl=30)
    client.raise_request_exception = False

    failed = call(client, f"/accounts/{account.pk}/balance", "-1.00", fencing_token_header(grant, step=1))
    retried = call(client, f"/accounts/{account.pk}/balance", "5.00", fencing_token_header(grant, step=1))

    assert failed.status_code == 500
    # The failed call's step was not consumed: the same step is accepted afterwards.
    assert retried.status_code == 200, retried.content
    assert Account.objects.get(pk=account.pk).balance == Decimal("5.00")


def test_the_header_round_trips_and_never_shows_the_proof() -> None:
    grant = locks.Lease(key="invoice:7", token=42, lease_id="s3cret-_x", holder="a",
                        acquired_at=None, expires_at=None)  # type: ignore[arg-type]
    value = fencing_token_header(grant)[FENCING_TOKEN_HEADER]
    presented = parse_fencing_token(value)
    assert (presented.key, presented.token, presented.step, presented.proof) == (
        "invoice:7", 42, 1, "s3cret-_x"
    )
    assert "s3cret" not in repr(presented)
    for bad in ('key="a", token=1, step=1', 'key="a", token=1, step=1, proof="x", token=2',
                'key=1, token=1, step=1, proof="x"', 'key="a", token=0, step=1, proof="x"'):
        with pytest.raises(InvalidInput):
            parse_fencing_token(bad)


def test_async_views_are_refused_when_decorated() -> None:
    async def view(request: Any, pk: int) -> Any: ...

    with pytest.raises(InvalidInput, match="async"):
        fenced_view(lock="account:{pk}")(view)
