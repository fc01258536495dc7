from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("boto3")
pytest.importorskip("moto")

from tests.support.s3_server import s3_server


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """A moto server that answers one request at a time: its conditional writes are atomic."""
    with s3_server(serial=True) as endpoint:
        yield endpoint


def s3_client(endpoint: str) -> Any:
    import boto3

    return boto3.client(
        "s3", endpoint_url=endpoint, region_name="us-east-1",
        aws_access_key_id="test", aws_secret_access_key="test",
    )


@pytest.fixture
def bucket(s3_endpoint: str) -> str:
    name = f"b-{uuid.uuid4().hex[:12]}"
    s3_client(s3_endpoint).create_bucket(Bucket=name)
    return name


def lease(key: str, token: int, holder: str = "") -> Any:
    """A lease as its holder keeps it, of any token: the stores compare tokens, not
    ask the grant point, so a test makes the history it needs directly."""
    import datetime as dt

    from coordination.leases import Lease

    now = dt.datetime.now(dt.UTC)
    return Lease(key=key, token=token, lease_id=f"id-{token}", holder=holder or f"holder-{token}",
                 acquired_at=now, expires_at=now + dt.timedelta(seconds=30))
