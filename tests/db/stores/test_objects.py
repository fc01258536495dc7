"""Fenced object storage on moto's S3 server: FencedS3Storage."""

from __future__ import annotations

import threading
from typing import Any
from urllib.parse import urlsplit

import pytest
from django.core.checks import Tags, run_checks
from django.core.files.base import ContentFile
from django.db import connections

from coordination.exceptions import DuplicateWrite, LeaseLost, NoGrant, StaleToken, WrongLock
from coordination.leases import use_grant
from coordination.models import Rejection, RejectionReason
from coordination.stores import StoreUnavailable
from coordination.stores.checks import check_fenced_storages, probe_fenced_storages_before_deploy
from coordination.stores.objects import MARKER_SIZE, FencedS3Storage
from tests.db.stores.conftest import lease, s3_client
from tests.support.reply_losing_proxy import reply_losing_proxy

pytestmark = pytest.mark.django_db(transaction=True)


def storage(endpoint: str, bucket: str, **options: Any) -> FencedS3Storage:
    return FencedS3Storage(
        bucket_name=bucket, endpoint_url=endpoint, access_key="test", secret_key="test",
        region_name="us-east-1", **options,
    )


def read(store: FencedS3Storage, name: str) -> bytes:
    with store.open(name) as file:
        data: bytes = file.read()
    return data


def test_stale_token_is_refused_and_the_newer_object_stays(s3_endpoint: str, bucket: str) -> None:
    store = storage(s3_endpoint, bucket)
    old, new = lease("report:1", 41), lease("report:1", 42)
    with use_grant(new):
        assert store.save("reports/1.csv", ContentFile(b"new")) == "reports/1.csv"
    with use_grant(old), pytest.raises(StaleToken) as caught:
        store.save("reports/1.csv", ContentFile(b"old"))
    assert caught.value.current_token == 42
    assert read(store, "reports/1.csv") == b"new"
    mark = store.watermark("reports/1.csv")
    assert (mark.token, mark.step, mark.key) == (42, 1, "report:1")
    rejection = Rejection.objects.get()
    assert rejection.reason == RejectionReason.STALE
    assert rejection.resource == f"s3:{bucket}/reports/1.csv"
    assert (rejection.token, rejection.watermark_token) == (41, 42)


def test_same_token_steps_follow_the_rule(s3_endpoint: str, bucket: str) -> None:
    store = storage(s3_endpoint, bucket)
    grant = lease("report:2", 7)
    written = store.save_fenced("r.txt", b"one", grant=grant)  # the lease's first step: 1
    assert (written.token, written.step) == (7, 1)
    assert written.etag == store.watermark("r.txt").etag
    with pytest.raises(DuplicateWrite):  # a retry of step 1: already stored
        store.save_fenced("r.txt", b"retry", grant=grant, step=1)
    assert read(store, "r.txt") == b"one"
    store.under(grant).save("r.txt", ContentFile(b"two"))  # the lease's next step: 2
    assert read(store, "r.txt") == b"two"
    assert store.watermark("r.txt").step == 2
    assert Rejection.objects.get().reason == RejectionReason.DUPLICATE
    # A step numbered by hand does not move the lease's count: the next write the
    # lease numbers (3) is below it, and the refusal says which step would pass.
    store.save_fenced("r.txt", b"five", grant=grant, step=5)
    with pytest.raises(DuplicateWrite) as numbered_twice:
        store.under(grant).save("r.txt", ContentFile(b"three"))
    assert "needs a step above 5" in str(numbered_twice.value)
    assert read(store, "r.txt") == b"five"


def test_concurrent_writers_end_at_the_highest_token(s3_endpoint: str, bucket: str) -> None:
    tokens = list(range(1, 13))
    barrier = threading.Barrier(len(tokens))
    outcomes: dict[int, str] = {}

    def write(token: int) -> None:
        own = storage(s3_endpoint, bucket)
        barrier.wait()
        try:
            own.save_fenced("race.bin", f"token {token}".encode(), grant=lease("race", token))
            outcomes[token] = "written"
        except StaleToken:
            outcomes[token] = "stale"
        finally:
            connections.close_all()  # the refusal's record used this thread's connection

    threads = [threading.Thread(target=write, args=(token,)) for token in tokens]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    store = storage(s3_endpoint, bucket)
    assert read(store, "race.bin") == b"token 12"
    assert store.watermark("race.bin").token == 12
    assert outcomes[12] == "written" and len(outcomes) == len(tokens)
    assert Rejection.objects.count() == list(outcomes.values()).count("stale")


def test_delete_is_fenced_and_keeps_the_watermark(s3_endpoint: str, bucket: str) -> None:
    store = storage(s3_endpoint, bucket)
    store.save_fenced("d.txt", b"data", grant=lease("d", 3))
    with pytest.raises(StaleToken):
        store.delete("d.txt", grant=lease("d", 2))
    assert store.exists("d.txt")
    store.delete("d.txt", grant=lease("d", 5))
    assert not store.exists("d.txt")
    with pytest.raises(FileNotFoundError):
        store.open("d.txt")
    assert store.listdir("")[1] == []
    assert s3_client(s3_endpoint).head_object(Bucket=bucket, Key="d.txt")["ContentLength"] == MARKER_SIZE
    with pytest.raises(StaleToken):  # the paused holder of token 4 cannot create it again
        store.save_fenced("d.txt", b"late", grant=lease("d", 4))
    store.save_fenced("d.txt", b"back", grant=lease("d", 6))
    assert read(store, "d.txt") == b"back"
    assert store.listdir("")[1] == ["d.txt"]


def test_another_key_and_a_lost_lease_are_refused(s3_endpoint: str, bucket: str) -> None:
    store = storage(s3_endpoint, bucket)
    store.save_fenced("k.txt", b"a", grant=lease("key:a", 1))
    with pytest.raises(WrongLock) as wrong:
        store.save_fenced("k.txt", b"b", grant=lease("key:b", 99))
    assert str(wrong.value) == f"s3:{bucket}/k.txt is guarded by lock 'key:a', not 'key:b'"
    lost = lease("key:a", 2)
    lost.mark_lost()
    with pytest.raises(LeaseLost):
        store.save_fenced("k.txt", b"c", grant=lost)
    with pytest.raises(NoGrant):
        store.save("k.txt", ContentFile(b"d"))
    assert read(store, "k.txt") == b"a"
    assert sorted(Rejection.objects.values_list("reason", flat=True)) == [
        RejectionReason.LEASE_LOST, RejectionReason.WRONG_LOCK,
    ]


def test_unreachable_store_is_a_clear_error_and_writes_nothing(s3_endpoint: str, bucket: str) -> None:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    from botocore.config import Config

    down = storage(f"http://127.0.0.1:{port}", bucket, max_attempts=1,
                   client_config=Config(retries={"max_attempts": 1}, connect_timeout=2))
    grant = lease("u", 1)
    with pytest.raises(StoreUnavailable) as caught:
        down.save_fenced("u.txt", b"x", grant=grant)
    assert caught.value.code == "store_unavailable"
    store = storage(s3_endpoint, bucket)
    assert not store.exists("u.txt")
    store.save_fenced("u.txt", b"y", grant=grant)  # the lease's next step
    assert store.watermark("u.txt").step == 2


def test_a_write_whose_reply_is_lost_applied_whole_and_its_retry_is_a_duplicate(
    s3_endpoint: str, bucket: str
) -> None:
    """The store applied the PUT, then the connection dropped before its answer: the
    caller gets ``StoreUnavailable`` (outcome unknown), the object holds the data with
    its watermark (one version: both or neither), a retry of the same step is
    refused as already stored, and a stale token stays refused."""
    from botocore.config import Config

    host, port = urlsplit(s3_endpoint).hostname, urlsplit(s3_endpoint).port
    assert host is not None and port is not None
    store = storage(s3_endpoint, bucket)
    with reply_losing_proxy(host, port) as proxy:
        once = Config(retries={"max_attempts": 1, "mode": "standard"})
        through = storage(f"http://127.0.0.1:{proxy.port}", bucket, max_attempts=1, client_config=once)
        through.save_fenced("lost.txt", b"old", grant=lease("lost", 5))
        # Every answer to a PUT of it lost: the HTTP client resends a request whose
        # connection dropped (the resend's precondition fails at the store).
        proxy.lose_reply_to(b"PUT ", b"/lost.txt", times=10)
        with pytest.raises(StoreUnavailable) as caught:
            through.save_fenced("lost.txt", b"new", grant=lease("lost", 6))
        assert proxy.lost >= 1 and caught.value.code == "store_unavailable"
        proxy.lose_reply_to()
        assert read(store, "lost.txt") == b"new"
        mark = store.watermark("lost.txt")
        assert (mark.token, mark.step) == (6, 1)
        with pytest.raises(DuplicateWrite):
            store.save_fenced("lost.txt", b"new again", grant=lease("lost", 6), step=1)
        with pytest.raises(StaleToken):
            store.save_fenced("lost.txt", b"stale", grant=lease("lost", 5), step=2)
        assert read(store, "lost.txt") == b"new"

        # One answer lost, with the client's own retries (botocore's default): the
        # resent PUT's precondition fails, and the write is found stored.
        retrying = storage(f"http://127.0.0.1:{proxy.port}", bucket)
        proxy.lose_reply_to(b"PUT ", b"/lost.txt")
        with pytest.raises(DuplicateWrite):
            retrying.save_fenced("lost.txt", b"newer", grant=lease("lost", 7))
        assert proxy.lost == 1
        assert read(store, "lost.txt") == b"newer" and store.watermark("lost.txt").token == 7


def test_system_check_refuses_a_store_without_conditional_writes(
    s3_endpoint: str, bucket: str, settings: Any
) -> None:
    base = {"bucket_name": bucket, "endpoint_url": s3_endpoint, "access_key": "test",
            "secret_key": "test", "region_name": "us-east-1"}
    backend = "coordination.stores.objects.FencedS3Storage"
    settings.STORAGES = {**settings.STORAGES, "reports": {
        "BACKEND": backend, "OPTIONS": {**base, "conditional_writes": False}}}
    assert [message.id for message in check_fenced_storages()] == ["coordination.E101"]
    settings.STORAGES = {**settings.STORAGES, "reports": {
        "BACKEND": backend, "OPTIONS": {**base, "probe_at_check": True}}}
    assert [m.msg for m in check_fenced_storages()] == []  # moto refuses failed preconditions
    assert not storage(s3_endpoint, bucket).exists(".coordination-probe")


def test_check_deploy_probes_a_fenced_storage_unless_its_options_say_otherwise(
    s3_endpoint: str, bucket: str, settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store nobody declared without conditional writes is still found before a
    deploy: ``check --deploy`` probes it; a plain check makes no request."""
    options = {"bucket_name": bucket, "endpoint_url": s3_endpoint, "access_key": "test",
               "secret_key": "test", "region_name": "us-east-1"}
    backend = "coordination.stores.objects.FencedS3Storage"
    settings.STORAGES = {**settings.STORAGES, "reports": {"BACKEND": backend, "OPTIONS": options}}
    assert probe_fenced_storages_before_deploy() == []  # moto refuses failed preconditions
    probed: list[str] = []

    def ignoring(self: FencedS3Storage) -> str:  # a store that applies them anyway
        probed.append(self.bucket_name)
        return "a PUT with If-None-Match: * replaced an existing object"

    monkeypatch.setattr(FencedS3Storage, "probe_conditional_writes", ignoring)
    assert check_fenced_storages() == [] and probed == []
    found = run_checks(include_deployment_checks=True, tags=[Tags.compatibility])
    assert [message.id for message in found if message.id.startswith("coordination.E10")] == [
        "coordination.E102"
    ]
    assert probed == [bucket]
    settings.STORAGES["reports"]["OPTIONS"] = {**options, "probe_at_check": False}
    assert probe_fenced_storages_before_deploy() == [] and probed == [bucket]


def test_probe_reports_a_store_that_ignores_preconditions(
    s3_endpoint: str, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = storage(s3_endpoint, bucket)
    client = store.connection.meta.client
    real_put = client.put_object

    def ignoring(**params: Any) -> Any:
        params.pop("IfMatch", None)
        params.pop("IfNoneMatch", None)
        return real_put(**params)

    monkeypatch.setattr(client, "put_object", ignoring)
    assert store.probe_conditional_writes() == "a PUT with If-None-Match: * replaced an existing object"
