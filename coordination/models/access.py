"""Access rules: which users may do what to which keys (docs/access-rules.md)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import models
from django.db.models import Q
from django.db.models.functions import Now
from django.utils.translation import gettext_lazy as _

from ..keys import (
    KEY_MAX_LENGTH,
    _pattern_field_validator,
)

if TYPE_CHECKING:
    pass


class AccessAction(models.TextChoices):
    """What an access rule allows on the keys it names (docs/access-rules.md)."""

    ACQUIRE = "acquire", _("acquire, renew and release")
    WRITE = "write", _("write documents")
    READ = "read", _("read")
    REVOKE = "revoke", _("revoke leases, raise fences")


class AccessRule(models.Model):
    """Which lock keys a user, or a group's members, may use, and for what.

    Rules only ever narrow: the Django permission of an action is still needed,
    and superusers are not bound by rules. Whether rules are enforced at all is
    ``COORDINATION["ACCESS_RULES"]``; :mod:`coordination.access` evaluates them.
    """

    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, null=True, blank=True,
        related_name="+", help_text=_("Who the rule is for: a user, or a group (not both)."),
    )
    group = models.ForeignKey(
        "auth.Group", on_delete=models.CASCADE, null=True, blank=True, related_name="+",
        help_text=_("Every member of this group."),
    )
    pattern = models.CharField(
        _("keys"), max_length=KEY_MAX_LENGTH, validators=[_pattern_field_validator],
        help_text=_(
            "billing:7 (that key only), billing:* (every key starting with billing:) "
            "or * (every key)."
        ),
    )
    acquire = models.BooleanField(
        default=False, db_default=False, help_text=_("Acquire, renew and release the keys.")
    )
    write = models.BooleanField(
        default=False, db_default=False,
        help_text=_("Write documents with grants of the keys (and so bind new documents to them)."),
    )
    read = models.BooleanField(
        default=False, db_default=False,
        help_text=_("See the keys' locks, grants, fences, documents and refused writes."),
    )
    revoke = models.BooleanField(
        default=False, db_default=False,
        help_text=_("Revoke the keys' leases and raise their fences in the admin."),
    )
    created_at = models.DateTimeField(db_default=Now(), editable=False)

    class Meta:
        ordering = ["pattern", "id"]
        verbose_name = _("access rule")
        constraints = [
            models.CheckConstraint(
                condition=Q(user__isnull=False, group__isnull=True)
                | Q(user__isnull=True, group__isnull=False),
                name="coordination_accessrule_user_or_group",
                violation_error_message=_("An access rule is for a user or a group: one, not both."),
            ),
            models.CheckConstraint(
                condition=Q(acquire=True) | Q(write=True) | Q(read=True) | Q(revoke=True),
                name="coordination_accessrule_some_action",
                violation_error_message=_("An access rule allows at least one action."),
            ),
        ]

    def __str__(self) -> str:
        who = f"user {self.user}" if self.user_id else f"group {self.group}"
        return f"{who}: {', '.join(self.actions) or 'nothing'} on {self.pattern}"

    @property
    def actions(self) -> list[str]:
        return [action for action in AccessAction.values if getattr(self, action)]

    def clean(self) -> None:
        errors: dict[str, str] = {}
        if bool(self.user_id) == bool(self.group_id):
            errors["user"] = str(_("Choose a user or a group: one, not both."))
        if not self.actions:
            errors["acquire"] = str(_("Choose at least one action."))
        if errors:
            raise ValidationError(errors)
