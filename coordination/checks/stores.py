"""The fenced stores' settings (E101-E103): a storage that cannot fence refuses to start.

The checks themselves live with the stores (:mod:`coordination.stores.checks`); they
read only settings, so they carry no ``database`` tag. Under ``check --deploy`` the
stores are also probed (E102), unless a storage's options say otherwise.
"""

from __future__ import annotations

from django.core.checks import Tags, register

from ..stores.checks import check_fenced_storages, probe_fenced_storages_before_deploy

register(Tags.compatibility)(check_fenced_storages)
register(Tags.compatibility, deploy=True)(probe_fenced_storages_before_deploy)

__all__ = ["check_fenced_storages", "probe_fenced_storages_before_deploy"]
