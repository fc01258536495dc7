"""Helpers for the REST API tests: users with chosen permissions, as token clients."""

from __future__ import annotations

import itertools
from typing import Any

from django.contrib.auth.models import Permission, User
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

ALL_PERMISSIONS = (
    "acquire_lock",
    "view_lock",
    "view_grant",
    "view_fence",
    "view_document",
    "write_document",
    "view_rejection",
)

_users = itertools.count(1)


def make_user(*codenames: str) -> User:
    """A user holding the given ``coordination`` permissions (codenames)."""
    # No password: hashing one costs a third of a second per user.
    user = User.objects.create_user(f"api-user-{next(_users)}")
    if codenames:
        perms = Permission.objects.filter(content_type__app_label="coordination", codename__in=codenames)
        assert perms.count() == len(set(codenames)), f"unknown permissions in {codenames}"
        user.user_permissions.add(*perms)
    return user


def token_for(user: User) -> str:
    return Token.objects.get_or_create(user=user)[0].key


def client_for(user: User) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {token_for(user)}")
    return client


def client_with(*codenames: str) -> APIClient:
    return client_for(make_user(*codenames))


def full_client() -> APIClient:
    return client_with(*ALL_PERMISSIONS)


def post(client: APIClient, path: str, body: Any, **extra: Any) -> Any:
    return client.post(path, body, format="json", **extra)


def put(client: APIClient, path: str, body: Any, **extra: Any) -> Any:
    return client.put(path, body, format="json", **extra)
