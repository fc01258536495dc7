"""The site's admin login answers 429 after repeated failures (project/login_throttle.py)."""

from __future__ import annotations

from typing import Any

import pytest
from django.contrib.auth.models import User
from django.test import Client

pytestmark = pytest.mark.django_db

LOGIN = "/admin/login/"


@pytest.fixture(autouse=True)
def quick(settings: Any) -> None:
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    settings.ADMIN_LOGIN_FAILURES = 3
    settings.ADMIN_LOGIN_WINDOW = 600


@pytest.fixture
def admin_user() -> User:
    return User.objects.create_user("boss", password="right-password", is_staff=True, is_superuser=True)


def log_in(password: str, username: str = "boss", address: str = "10.0.0.1") -> Any:
    return Client(REMOTE_ADDR=address).post(LOGIN, {"username": username, "password": password})


def test_failures_up_to_the_limit_are_the_form_again_then_429(admin_user: User) -> None:
    for _ in range(3):
        assert log_in("wrong").status_code == 200

    refused = log_in("right-password")  # the right password too: not even checked now

    assert refused.status_code == 429
    assert 0 < int(refused["Retry-After"]) <= 600
    assert b"Too many failed logins" in refused.content


def test_the_count_is_per_address_and_per_user_name(admin_user: User) -> None:
    User.objects.create_user("other", password="pw", is_staff=True)
    for number in range(3):
        log_in("wrong", username=f"nobody-{number}", address="10.0.0.1")
    assert log_in("right-password", address="10.0.0.1").status_code == 429  # that address
    assert log_in("right-password", address="10.0.0.2").status_code == 302  # another one

    for number in range(3):
        log_in("wrong", username="other", address=f"10.0.1.{number}")
    assert log_in("pw", username="OTHER ", address="10.0.2.1").status_code == 429  # that name


def test_a_successful_login_is_not_counted_and_the_page_stays_readable(admin_user: User) -> None:
    for _ in range(5):
        assert log_in("right-password", address=f"10.0.3.{_}").status_code == 302
    for _ in range(3):
        log_in("wrong")
    assert Client(REMOTE_ADDR="10.0.0.1").get(LOGIN).status_code == 200
