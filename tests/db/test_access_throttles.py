"""The throttles hold against the tricks a client controls: the name it types, the headers it sends.

The admin login counts failures by the user name as the login form
authenticates it (NFKC-normalized, case-folded), so a compatibility form of a
name (fullwidth, ligatures, superscripts) shares the name's count. The API's
failed-login throttle and the admin login count clients by one address rule:
``REMOTE_ADDR``, unless ``REST_FRAMEWORK["NUM_PROXIES"]`` names trusted proxies
whose ``X-Forwarded-For`` entries are then believed, and only those.
"""

from __future__ import annotations

from typing import Any

import pytest
from django.contrib.auth.models import User
from django.test import Client
from rest_framework.test import APIClient

from coordination.models import Lock
from tests.support.hostile import tally_requests  # noqa: F401  (the module's fixture)

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("tally_requests")]

LOGIN = "/admin/login/"
ACQUIRE = "/api/locks/job:1/acquire"


@pytest.fixture(autouse=True)
def quick(settings: Any) -> None:
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    settings.ADMIN_LOGIN_FAILURES = 5
    settings.ADMIN_LOGIN_WINDOW = 600


def log_in(username: str, password: str, address: str = "10.0.0.1", **headers: str) -> Any:
    return Client(REMOTE_ADDR=address, **headers).post(
        LOGIN, {"username": username, "password": password}
    )


# --- the admin login: names ------------------------------------------------------


# Each logs in as "ops2" through the login form (NFKC), and each got a count of its own.
COMPATIBILITY_FORMS = [
    "\uff4f\uff50\uff53\uff12",  # fullwidth letters and digit
    "ops\u00b2",  # superscript two
    "ops\u2082",  # subscript two
    "\U0001d428\U0001d429\U0001d42c\U0001d7d0",  # mathematical bold
    "ops\u2461",  # circled two
    " ops2\u3000",  # an ideographic space after it
]


@pytest.mark.parametrize("form", COMPATIBILITY_FORMS)
def test_a_compatibility_form_of_a_locked_out_name_is_locked_out_too(form: str) -> None:
    User.objects.create_user("ops2", password="right-password", is_staff=True)
    assert log_in(form, "right-password", address="10.9.0.1").status_code == 302  # it is the name
    for number in range(5):
        assert log_in("ops2", "wrong", address=f"10.0.0.{number}").status_code == 200

    refused = log_in(form, "right-password", address="10.1.0.1")

    assert refused.status_code == 429, form
    assert "_auth_user_id" not in refused.client.session


@pytest.mark.parametrize("form", [*COMPATIBILITY_FORMS, "\uff2f\uff30\uff33\uff12"])  # + capitals
def test_failures_under_a_compatibility_form_count_for_the_name(form: str) -> None:
    User.objects.create_user("ops2", password="right-password", is_staff=True)
    for number in range(5):
        log_in(form if number % 2 else "OPS2", "wrong", address=f"10.0.0.{number}")
    assert log_in("ops2", "right-password", address="10.1.0.1").status_code == 429


def test_another_name_keeps_its_own_count() -> None:
    User.objects.create_user("ops3", password="right-password", is_staff=True)
    for number in range(5):
        log_in("ops2", "wrong", address=f"10.0.0.{number}")
    assert log_in("ops3", "right-password", address="10.1.0.1").status_code == 302


# --- the admin login: addresses --------------------------------------------------


def test_the_login_ignores_x_forwarded_for_without_trusted_proxies() -> None:
    User.objects.create_user("ops2", password="right-password", is_staff=True)
    for number in range(5):
        answer = log_in(f"nobody-{number}", "wrong", HTTP_X_FORWARDED_FOR=f"203.0.113.{number}")
        assert answer.status_code == 200
    refused = log_in("ops2", "right-password", HTTP_X_FORWARDED_FOR="203.0.113.99")
    assert refused.status_code == 429


def test_behind_one_trusted_proxy_the_login_counts_the_address_it_saw(settings: Any) -> None:
    settings.REST_FRAMEWORK = {"NUM_PROXIES": 1}
    User.objects.create_user("ops2", password="right-password", is_staff=True)
    # The client prepends what it likes; the proxy appends the address it saw.
    for number in range(5):
        forwarded = f"198.51.100.{number}, 203.0.113.7"
        assert log_in(f"nobody-{number}", "wrong", HTTP_X_FORWARDED_FOR=forwarded).status_code == 200
    assert log_in("ops2", "right-password", HTTP_X_FORWARDED_FOR="1.2.3.4, 203.0.113.7").status_code == 429
    # Another client behind the same proxy is not held back.
    assert log_in("ops2", "right-password", HTTP_X_FORWARDED_FOR="203.0.113.8").status_code == 302


# --- the API's failed-login throttle ---------------------------------------------


def wrong_token(number: int, **headers: str) -> Any:
    client = APIClient(REMOTE_ADDR="10.0.0.1")
    client.credentials(HTTP_AUTHORIZATION=f"Token wrong-{number:036d}")
    return client.post(ACQUIRE, {"holder": "h", "ttl": 5}, format="json", **headers)


def test_a_new_x_forwarded_for_per_request_does_not_reset_the_api_count(settings: Any) -> None:
    settings.COORDINATION = {**settings.COORDINATION, "API_ANON_THROTTLE_RATE": "10/minute"}
    answers = [
        wrong_token(number, HTTP_X_FORWARDED_FOR=f"198.51.100.{number}").status_code
        for number in range(30)
    ]
    assert answers == [401] * 10 + [429] * 20
    assert not Lock.objects.exists()


def test_behind_trusted_proxies_the_api_counts_the_address_they_saw(settings: Any) -> None:
    settings.COORDINATION = {**settings.COORDINATION, "API_ANON_THROTTLE_RATE": "10/minute"}
    settings.REST_FRAMEWORK = {"NUM_PROXIES": 2}
    # Two proxies append two addresses; whatever the client put before them is not believed.
    answers = [
        wrong_token(number, HTTP_X_FORWARDED_FOR=f"198.51.100.{number}, 203.0.113.7, 10.0.0.2").status_code
        for number in range(30)
    ]
    assert answers == [401] * 10 + [429] * 20
    other = wrong_token(99, HTTP_X_FORWARDED_FOR="203.0.113.8, 10.0.0.2")
    assert other.status_code == 401  # another client behind the same proxies
