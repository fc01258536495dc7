"""The admin login's lockout is exact under concurrency: at most the configured
number of passwords are checked per user name and per address in a window,
however many login requests arrive at once (project/login_throttle.py)."""

from __future__ import annotations

from typing import Any

import pytest
from django.contrib.auth.models import User
from django.core.cache import cache
from django.test import Client

from tests.support import slow_hasher
from tests.support.hostile import Tally, tally_requests  # noqa: F401  (the module's fixture)
from tests.support.waiting import run_in_threads

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("tally_requests")]

LIMIT = 5
PARALLEL = 8


@pytest.fixture(autouse=True)
def slow_passwords(settings: Any) -> None:
    settings.PASSWORD_HASHERS = ["tests.support.slow_hasher.SlowCountingHasher"]
    settings.ADMIN_LOGIN_FAILURES = LIMIT
    settings.ADMIN_LOGIN_WINDOW = 600
    cache.clear()
    slow_hasher.reset()


def log_in(username: str, password: str, address: str) -> int:
    response = Client(REMOTE_ADDR=address).post(
        "/admin/login/", {"username": username, "password": password}
    )
    return response.status_code


def test_parallel_wrong_passwords_for_one_name_check_at_most_the_limit() -> None:
    User.objects.create_user("boss", password="right-password", is_staff=True)
    slow_hasher.reset()

    answers = run_in_threads(PARALLEL, lambda i: log_in("boss", f"wrong-{i}", f"10.1.0.{i}"))

    assert slow_hasher.checks == LIMIT, answers  # not PARALLEL: the count is taken before the check
    assert sorted(answers) == [200] * LIMIT + [429] * (PARALLEL - LIMIT)
    # The name stays locked, for the right password too, and nothing is checked.
    assert log_in("boss", "right-password", "10.1.1.1") == 429
    assert slow_hasher.checks == LIMIT


def test_parallel_wrong_passwords_from_one_address_check_at_most_the_limit() -> None:
    for number in range(PARALLEL):
        User.objects.create_user(f"user-{number}", password="pw", is_staff=True)
    slow_hasher.reset()

    answers = run_in_threads(PARALLEL, lambda i: log_in(f"user-{i}", "wrong", "10.2.0.1"))

    assert slow_hasher.checks == LIMIT, answers
    assert sorted(answers) == [200] * LIMIT + [429] * (PARALLEL - LIMIT)


def test_refused_attempts_do_not_spend_the_other_count() -> None:
    # An address that spent its count cannot lock a name out by trying it further.
    User.objects.create_user("victim", password="pw", is_staff=True)
    for number in range(LIMIT):
        assert log_in(f"nobody-{number}", "wrong", "10.3.0.1") == 200
    for _ in range(LIMIT + 2):
        assert log_in("victim", "wrong", "10.3.0.1") == 429
    assert log_in("victim", "pw", "10.3.0.2") == 302  # the name's count was not spent
