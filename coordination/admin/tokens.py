"""The API tokens' admin, in place of Django REST framework's own."""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.db.models import QuerySet
from django.http import HttpRequest
from django.utils.translation import gettext_lazy as _


def replace_token_admin(site: admin.AdminSite) -> None:
    """Put :class:`TokenAdmin` in place of DRF's own token admin on ``site``.

    DRF's shows every token key in full to anyone with ``view_tokenproxy``, one
    of "all view permissions", and a key is a password: whoever reads it acts as
    its user. Its admin module is imported first here, so the replacement holds
    whatever the order of ``INSTALLED_APPS``.
    """
    import rest_framework.authtoken.admin as stock
    from rest_framework.authtoken.models import TokenProxy

    class TokenAdmin(stock.TokenAdmin):
        """Who has an API token, since when: a list without keys, nothing more.

        Keys are masked (their first four characters, enough to tell tokens
        apart in a conversation), and users other than superusers see only
        their own token, whatever their permissions on tokens. No page shows
        one token: Django's change, history and delete pages, and the admin log
        a deletion writes, name a token by its key. Tokens are created, rotated
        and revoked with ``manage.py drf_create_token`` (docs/security.md).
        """

        list_display = ("masked_key", "user", "created")
        list_display_links = None

        def get_queryset(self, request: HttpRequest) -> QuerySet[Any]:
            rows = super().get_queryset(request)
            user = request.user
            return rows if user.is_superuser else rows.filter(user_id=user.pk)

        def has_view_permission(self, request: HttpRequest, obj: Any = None) -> bool:
            return obj is None and super().has_view_permission(request)

        def has_add_permission(self, request: HttpRequest) -> bool:
            return False

        def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
            return False

        def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
            return False

        @admin.display(description=_("key"))
        def masked_key(self, token: Any) -> str:
            return f"{token.key[:4]}\u2026"

    if site.is_registered(TokenProxy):
        site.unregister(TokenProxy)
    site.register(TokenProxy, TokenAdmin)
