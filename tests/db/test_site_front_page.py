"""The site's front page, the address ``bin/run`` prints, leads to the dashboard."""

from __future__ import annotations

import pytest
from django.contrib.auth.models import User
from django.test import Client
from django.urls import reverse

pytestmark = pytest.mark.django_db


def test_the_front_page_redirects_to_the_dashboard_through_the_login() -> None:
    dashboard = reverse("admin:coordination_dashboard")
    client = Client()
    answer = client.get("/")
    assert answer.status_code == 302 and answer["Location"] == dashboard
    assert client.get(dashboard).status_code == 302  # anonymous: to the login first
    User.objects.create_superuser("boss", password="x")
    client.force_login(User.objects.get(username="boss"))
    landed = client.get("/", follow=True)
    assert landed.status_code == 200 and landed.redirect_chain[-1][0] == dashboard
