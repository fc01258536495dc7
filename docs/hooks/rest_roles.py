"""A griffe extension: the reST of the docstrings, read as Markdown by mkdocstrings.

The docstrings are written for Python's own tools: ``literal`` and roles such as
:class:`~coordination.leases.Lease`. Markdown reads ``literal`` as code already;
the roles become code too (``Lease`` for a ``~`` role, the full name otherwise),
instead of showing their raw markup on the reference pages.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

SHORT_ROLE = re.compile(r":[a-z]+:`~(?:[\w.]+\.)?(\w+)`")
ROLE = re.compile(r":[a-z]+:`([^`]+)`")


def markdown(text: str) -> str:
    return ROLE.sub(r"`\1`", SHORT_ROLE.sub(r"`\1`", text))


class RestRoles(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = markdown(obj.docstring.value)
