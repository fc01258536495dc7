"""Who may use which lock keys: the access rules, evaluated in one place.

An :class:`~coordination.models.AccessRule` gives a user, or a group's members,
actions (:class:`~coordination.models.AccessAction`: ``acquire``, ``write``,
``read``, ``revoke``) on the keys its pattern names (``billing:7``,
``billing:*``, ``*``). The REST API, the admin lists and the dashboard ask
here, and nowhere else, whether a user may act on a key
(docs/access-rules.md):

- ``COORDINATION["ACCESS_RULES"] = "auto"`` (the default): while no rule exists
  at all, nobody is limited by rules (only the Django permissions apply, as
  before rules existed). Once any rule exists, every user is limited to their
  own rules and their groups': outside them, default deny.
- ``"enforce"``: always limited, no rule means no key.
- ``"off"``: rules are ignored.

Superusers are never limited. Rules only narrow: the Django permission an
action needs (``coordination.acquire_lock``, ``view_lock``...) is checked as
well, by the caller. Code that imports the app (``coordination.locks``, a
Celery task) is trusted and not subject to rules; they bind API and admin users.

Cost: one query per user and request (:func:`for_request` keeps the answer
on the request), none for superusers or when rules are off.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from django.db.models import BooleanField, ExpressionWrapper, Model, Q, QuerySet, Subquery, Value
from django.db.models.functions import Left
from django.db.models.lookups import Exact

from .conf import app_settings
from .exceptions import KeyForbidden
from .models import PATTERN_WILDCARD, AccessAction, AccessRule, key_matches

__all__ = ["MODES", "UNRESTRICTED", "Access", "access_for", "allowed", "for_request"]

MODES = ("auto", "enforce", "off")
ACTIONS: tuple[str, ...] = tuple(AccessAction.values)

_Row = TypeVar("_Row", bound=Model)
_REQUEST_CACHE = "_coordination_access"


@dataclass(frozen=True)
class Access:
    """What one user may do with lock keys.

    ``patterns`` maps each action to the key patterns the user's rules give it;
    None means the user is not limited by rules (a superuser, rules off, or
    ``"auto"`` with no rule in the database).
    """

    patterns: Mapping[str, tuple[str, ...]] | None

    @property
    def limited(self) -> bool:
        return self.patterns is not None

    def allows(self, action: str, key: str) -> bool:
        """Whether the rules allow ``action`` on ``key`` (the Django permission aside)."""
        _check_action(action)
        if self.patterns is None:
            return True
        return any(key_matches(pattern, key) for pattern in self.patterns.get(action, ()))

    def require(self, action: str, key: str) -> None:
        """Raise ``KeyForbidden`` unless the rules allow ``action`` on ``key``."""
        if not self.allows(action, key):
            raise KeyForbidden(
                f"your access rules do not allow {action!r} on lock key {key!r}; "
                "an administrator grants keys with access rules (docs/access-rules.md)",
                action=action, key=key,
            )

    def condition(self, action: str, field: str) -> Q:
        """A filter matching the rows whose lock key (the column ``field``) allows ``action``.

        Case-sensitive on every database, like keys (SQLite's LIKE, and so its
        ``startswith``, ignores case: prefixes are compared with ``left()``).
        """
        _check_action(action)
        if self.patterns is None:
            return Q()
        patterns = self.patterns.get(action, ())
        if PATTERN_WILDCARD in patterns:
            return Q()
        matches = Q(pk__in=[])
        for pattern in patterns:
            if pattern.endswith(PATTERN_WILDCARD):
                prefix = pattern[:-1]
                matches |= Q(Exact(Left(field, len(prefix)), Value(prefix)))
            else:
                matches |= Q(**{field: pattern})
        return matches

    def filter(self, rows: QuerySet[_Row], action: str, field: str) -> QuerySet[_Row]:
        """``rows`` without those whose lock key (``field``) the rules do not allow ``action`` on."""
        condition = self.condition(action, field)
        return rows.filter(condition) if condition else rows


UNRESTRICTED = Access(None)


def access_for(user: Any) -> Access:
    """The access of ``user`` under the current rules and ``COORDINATION["ACCESS_RULES"]``.

    One query (none for a superuser or with rules off): the user's own rules,
    their groups' rules and, in ``"auto"`` mode, whether any rule exists at all.
    An anonymous or inactive user is limited to nothing once rules apply.
    """
    mode = app_settings.ACCESS_RULES
    if mode == "off":
        return UNRESTRICTED
    if getattr(user, "is_superuser", False) and getattr(user, "is_active", False):
        return UNRESTRICTED
    if user is None or not getattr(user, "is_authenticated", False):
        mine = Q(pk__in=[])
    else:
        mine = Q(user_id=user.pk)
        groups = getattr(user, "groups", None)
        if groups is not None:
            mine |= Q(group__in=groups.values("pk"))
    rows = AccessRule.objects.annotate(mine=ExpressionWrapper(mine, output_field=BooleanField()))
    if mode == "auto":
        # The first rule of all comes along, so that one query also says whether
        # any rule exists: with none, "auto" leaves everyone to Django permissions.
        first = AccessRule.objects.order_by("pk").values("pk")[:1]
        rows = rows.filter(Q(mine=True) | Q(pk=Subquery(first)))
    else:
        rows = rows.filter(mine=True)
    found = list(rows.values_list("pattern", "mine", *ACTIONS))
    if mode == "auto" and not found:
        return UNRESTRICTED
    patterns: dict[str, list[str]] = {action: [] for action in ACTIONS}
    for pattern, is_mine, *granted in found:
        if not is_mine:
            continue
        for action, yes in zip(ACTIONS, granted, strict=True):
            if yes:
                patterns[action].append(pattern)
    return Access({action: tuple(sorted(set(keys))) for action, keys in patterns.items()})


def for_request(request: Any) -> Access:
    """The access of the request's user, computed once per request.

    Accepts a Django ``HttpRequest`` or a DRF ``Request`` (kept on the
    ``HttpRequest`` beneath it, so both see one answer).
    """
    user = request.user
    base = getattr(request, "_request", request)
    # Keyed by who asked, in case the request's user changes (a login mid-request).
    who = (user.pk, getattr(user, "is_superuser", False))
    cached = getattr(base, _REQUEST_CACHE, None)
    if cached is not None and cached[0] == who:
        access: Access = cached[1]
        return access
    access = access_for(user)
    setattr(base, _REQUEST_CACHE, (who, access))
    return access


def allowed(user: Any, action: str, key: str) -> bool:
    """Whether ``user``'s access rules allow ``action`` on ``key``.

    The rules only: the Django permission of the action is for the caller to
    check too (``user.has_perm("coordination.acquire_lock")``...).
    """
    return access_for(user).allows(action, key)


def _check_action(action: str) -> None:
    if action not in ACTIONS:
        raise ValueError(f"unknown access action {action!r}; known: {', '.join(ACTIONS)}")
