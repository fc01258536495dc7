"""Fixtures shared by the database tests of job policies and fenced executions."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from coordination import jobs


@pytest.fixture
def uncached_policies(settings: Any) -> Iterator[None]:
    """Every execution reads the job policies afresh, and nothing read before leaks in."""
    settings.COORDINATION = {**settings.COORDINATION, "JOB_POLICY_REFRESH": 0}
    jobs.clear_cache()
    yield
    jobs.clear_cache()
