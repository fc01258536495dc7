"""The fenced stores' settings (E101-E103): a storage that cannot fence refuses to start.

The check itself lives with the stores (:mod:`coordination.stores.checks`); it reads
only settings, so it carries no ``database`` tag.
"""

from __future__ import annotations

from django.core.checks import Tags, register

from ..stores.checks import check_fenced_storages

register(Tags.compatibility)(check_fenced_storages)

__all__ = ["check_fenced_storages"]
