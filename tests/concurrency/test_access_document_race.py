"""Two tenants racing for a new document: the loser learns nothing of the winner.

Alice may use ``tenant-a:*`` only, Bob ``tenant-b:*`` only. Each acquires a
lock of their own and both PUT the same new document name at the same moment,
on their own threads and database connections. The first write binds the
document to its key; the other is refused with ``403 key_forbidden``, which
names no key, and leaves no rejection carrying the winner's watermark, however
the two requests interleave. The document's binding is read under the fence's
row lock, in the write's own transaction.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
from django.contrib.auth.models import User

from coordination.models import AccessRule, Document, Rejection
from tests.support.api_support import ALL_PERMISSIONS, client_for, make_user, post, put
from tests.support.waiting import run_in_threads

PAIRS = 120
TENANTS = ("tenant-a", "tenant-b")


def tenant_user(tenant: str) -> User:
    user = make_user(*ALL_PERMISSIONS)
    AccessRule.objects.create(user=user, pattern=f"{tenant}:*", acquire=True, write=True, read=True)
    return user


@pytest.mark.django_db(transaction=True)
def test_racing_first_writes_refuse_the_loser_without_naming_the_winners_key() -> None:
    users = [tenant_user(tenant) for tenant in TENANTS]
    both_ready = threading.Barrier(2)

    def writer(index: int) -> list[tuple[int, dict[str, Any], str]]:
        tenant, client = TENANTS[index], client_for(users[index])
        answers = []
        for pair in range(PAIRS):
            key = f"{tenant}:race-{pair}"
            grant = post(client, f"/api/locks/{key}/acquire", {"holder": f"{tenant}-writer", "ttl": 60})
            assert grant.status_code == 201, grant.content
            proof = {name: grant.json()[name] for name in ("token", "lease_id")}
            both_ready.wait(timeout=60)
            response = put(client, f"/api/documents/race-{pair}",
                           {"lock_key": key, **proof, "data": {"by": tenant}})
            answers.append((response.status_code, response.json(), response.content.decode()))
        return answers

    per_tenant = run_in_threads(2, writer, timeout=600)

    lost_by = {tenant: 0 for tenant in TENANTS}
    for pair in range(PAIRS):
        document = Document.objects.select_related("fence").get(name=f"race-{pair}")
        winner = document.fence.lock_key.split(":")[0]
        assert document.data == {"by": winner}
        for index, tenant in enumerate(TENANTS):
            status, body, text = per_tenant[index][pair]
            other = TENANTS[1 - index]
            assert other not in text, (pair, tenant, text)  # no key, holder or data of theirs
            if tenant == winner:
                assert status == 200, (pair, tenant, body)
                continue
            lost_by[tenant] += 1
            assert (status, body["code"]) == (403, "key_forbidden"), (pair, tenant, body)
        # Refused before the fence compared tokens: no rejection carries the winner's watermark.
        assert not Rejection.objects.filter(resource=f"document:race-{pair}").exists()
    assert sum(lost_by.values()) == PAIRS


@pytest.mark.django_db(transaction=True)
def test_the_loser_reads_no_rejection_of_the_race() -> None:
    users = [tenant_user(tenant) for tenant in TENANTS]
    both_ready = threading.Barrier(2)

    def writer(index: int) -> None:
        tenant, client = TENANTS[index], client_for(users[index])
        for pair in range(PAIRS // 4):
            key = f"{tenant}:race-{pair}"
            grant = post(client, f"/api/locks/{key}/acquire", {"holder": f"{tenant}-writer", "ttl": 60})
            proof = {name: grant.json()[name] for name in ("token", "lease_id")}
            both_ready.wait(timeout=60)
            put(client, f"/api/documents/race-{pair}", {"lock_key": key, **proof, "data": 1})

    run_in_threads(2, writer, timeout=600)

    for index in range(2):
        listed = client_for(users[index]).get("/api/rejections/", {"limit": 1000})
        assert listed.status_code == 200, listed.content
        payload = listed.json()
        rows = payload["results"] if isinstance(payload, dict) else payload
        # A rejection of the race would carry the winner's watermark (a token of their key).
        assert [row for row in rows if row["resource"].startswith("document:race-")] == []
        assert TENANTS[1 - index] not in listed.content.decode()
