"""System checks: each id fires on the configuration it names, and only there."""

from __future__ import annotations

import importlib.util
from io import StringIO
from typing import Any

import pytest
from django.core.checks import ERROR, WARNING
from django.core.management import call_command
from django.core.management.base import SystemCheckError
from django.db import models
from django.test import override_settings
from django.test.utils import isolate_apps

from coordination import checks
from coordination.checks import fenced_models
from coordination.fencing import FencedModel, FencedQuerySet

SQLITE = {"ENGINE": "django.db.backends.sqlite3", "NAME": "x.sqlite3"}
POSTGRES = {"ENGINE": "django.db.backends.postgresql", "NAME": "x"}

# The database checks only read DATABASES; no connection is opened under the override.
pytestmark = pytest.mark.filterwarnings("ignore:Overriding setting DATABASES:UserWarning")


def ids(messages: list[Any]) -> list[str]:
    return [message.id for message in messages]


def databases(**default: Any) -> dict[str, Any]:
    return {"default": default}


# --- E001 / E004 / W002: the coordination database ----------------------------


def test_postgresql_without_atomic_requests_passes() -> None:
    with override_settings(DATABASES=databases(**POSTGRES)):
        assert checks.check_database() == []


def test_unsupported_database_is_e001() -> None:
    with override_settings(DATABASES=databases(ENGINE="django.db.backends.oracle", NAME="x")):
        assert ids(checks.check_database()) == ["coordination.E001"]


MARIADB = {"ENGINE": "django.db.backends.mysql", "NAME": "x"}


def test_mariadb_with_utf8mb4_and_read_committed_passes() -> None:
    for options in ({"charset": "utf8mb4"}, {"charset": "utf8mb4", "isolation_level": "read committed"}):
        with override_settings(DATABASES=databases(**MARIADB, OPTIONS=options)):
            assert checks.check_database() == []


def test_mariadb_under_another_isolation_level_is_e006() -> None:
    options = {"charset": "utf8mb4", "isolation_level": "repeatable read"}
    with override_settings(DATABASES=databases(**MARIADB, OPTIONS=options)):
        (message,) = checks.check_database()
    assert message.id == "coordination.E006" and message.level == ERROR
    assert "'repeatable read'" in message.msg and 'DATABASES["default"]' in message.hint


def test_mariadb_without_utf8mb4_is_w007() -> None:
    with override_settings(DATABASES=databases(**MARIADB)):
        (message,) = checks.check_database()
    assert message.id == "coordination.W007" and message.level == WARNING
    assert '["charset"] = "utf8mb4"' in message.hint


def test_coordination_alias_missing_from_databases_is_e001() -> None:
    with override_settings(COORDINATION={"DATABASE": "locks"}):
        messages = checks.check_database()
    assert ids(messages) == ["coordination.E001"]
    assert "'locks'" in messages[0].msg


def test_sqlite_without_immediate_transactions_is_e004_naming_the_options() -> None:
    with override_settings(DATABASES=databases(**SQLITE)):
        (message,) = checks.check_database()
    assert message.id == "coordination.E004"
    assert message.level == ERROR
    assert 'DATABASES["default"]["OPTIONS"] = {"transaction_mode": "IMMEDIATE", "timeout": 30' in message.hint


def test_e004_names_the_grant_points_database_not_the_default() -> None:
    config = {"default": {**POSTGRES}, "locks": {**SQLITE}}
    with override_settings(DATABASES=config, COORDINATION={"DATABASE": "locks"}):
        (message,) = checks.check_database()
    assert message.id == "coordination.E004"
    assert "'locks'" in message.msg
    assert 'DATABASES["locks"]["OPTIONS"]' in message.hint


def test_database_checks_run_under_plain_check(django_db_blocker: Any) -> None:
    # Not tagged "database": plain `check` (and runserver, and a worker's start) runs them.
    # Django's own model checks ask SQLite whether it supports JSONField, which opens
    # a connection: an in-memory database here, so the answer never depends on which
    # test opened (and cached) a connection before this one.
    in_memory = {**SQLITE, "NAME": ":memory:"}
    with (
        override_settings(DATABASES=databases(**in_memory)),
        django_db_blocker.unblock(),
        pytest.raises(SystemCheckError) as raised,
    ):
        call_command("check", stdout=StringIO(), stderr=StringIO())
    assert "coordination.E004" in str(raised.value)


def test_sqlite_with_immediate_transactions_passes() -> None:
    config = {**SQLITE, "OPTIONS": {"transaction_mode": "IMMEDIATE"}}
    with override_settings(DATABASES=databases(**config)):
        assert checks.check_database() == []


def test_atomic_requests_on_the_coordination_database_is_w002() -> None:
    with override_settings(DATABASES=databases(**POSTGRES, ATOMIC_REQUESTS=True)):
        assert ids(checks.check_database()) == ["coordination.W002"]


# --- E008: the PostgreSQL driver -----------------------------------------------


def test_postgresql_without_psycopg_3_is_e008_naming_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    # A site that runs PostgreSQL on psycopg2 alone: find_spec("psycopg") is None there.
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "psycopg" else real_find_spec(name, *a)
    )
    with override_settings(DATABASES=databases(**POSTGRES)):
        (message,) = checks.check_database()
    assert message.id == "coordination.E008" and message.level == ERROR
    assert "django-coordination[postgres]" in message.hint
    with override_settings(DATABASES=databases(**SQLITE)):
        assert "coordination.E008" not in ids(checks.check_database())  # SQLite needs no driver


def test_postgresql_with_psycopg_3_passes() -> None:
    with override_settings(DATABASES=databases(**POSTGRES)):
        assert checks.check_database() == []


# --- E007: time zone support ----------------------------------------------------


def test_use_tz_off_is_e007_naming_the_setting() -> None:
    with override_settings(USE_TZ=False):
        (message,) = checks.check_time_zone_support()
    assert message.id == "coordination.E007" and message.level == ERROR
    assert "USE_TZ = True" in message.hint


def test_use_tz_on_passes() -> None:
    with override_settings(USE_TZ=True):
        assert checks.check_time_zone_support() == []


# --- E020-E022 / W020: the apps the REST API needs ------------------------------

SITE_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "coordination",
]
API_APPS = ["rest_framework", "rest_framework.authtoken", "drf_spectacular", "drf_spectacular_sidecar"]


def without(*missing: str) -> list[str]:
    return [app for app in SITE_APPS + API_APPS if app not in missing]


def test_the_test_site_mounts_the_api() -> None:
    assert checks.api_is_mounted()


@pytest.mark.parametrize(
    ("missing", "expected"),
    [
        ("rest_framework", "coordination.E020"),
        ("rest_framework.authtoken", "coordination.E021"),
        ("drf_spectacular", "coordination.E022"),
    ],
)
def test_an_api_app_missing_from_installed_apps_is_an_error_naming_it(missing: str, expected: str) -> None:
    with override_settings(INSTALLED_APPS=without(missing)):
        (message,) = checks.check_api_apps()
    assert message.id == expected
    assert message.level == ERROR
    assert repr(missing) in message.msg
    assert f'Add "{missing}" to INSTALLED_APPS' in message.hint


def test_only_coordination_installed_names_every_missing_api_app() -> None:
    # What the README used to say: "add coordination to INSTALLED_APPS".
    with override_settings(INSTALLED_APPS=SITE_APPS):
        assert ids(checks.check_api_apps()) == [
            "coordination.E020", "coordination.E021", "coordination.E022", "coordination.W020",
        ]


def test_docs_assets_app_missing_is_w020_naming_the_extra() -> None:
    with override_settings(INSTALLED_APPS=without("drf_spectacular_sidecar")):
        (message,) = checks.check_api_apps()
    assert message.id == "coordination.W020"
    assert message.level == WARNING
    assert "is installed but not in INSTALLED_APPS" in message.msg
    assert "django-coordination[api-docs]" in message.hint


def test_a_site_without_the_api_urls_needs_no_api_apps() -> None:
    with override_settings(INSTALLED_APPS=SITE_APPS, ROOT_URLCONF="tests.support.urls_without_api"):
        assert not checks.api_is_mounted()
        assert checks.check_api_apps() == []


def test_api_urls_included_at_any_depth_count() -> None:
    with override_settings(ROOT_URLCONF="tests.support.urls_api_nested"):
        assert checks.api_is_mounted()


# --- W021: check --deploy, the API throttles need a shared cache ---------------

LOCMEM = {"default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}}
DUMMY = {"default": {"BACKEND": "django.core.cache.backends.dummy.DummyCache"}}
SHARED = {"default": {"BACKEND": "django.core.cache.backends.redis.RedisCache",
                      "LOCATION": "redis://127.0.0.1:6379/0"}}


def test_the_api_throttles_on_a_local_memory_cache_are_w021_under_deploy() -> None:
    with override_settings(CACHES=LOCMEM):
        (message,) = checks.check_api_throttle_cache()
    assert message.id == "coordination.W021" and message.level == WARNING
    assert "LocMemCache" in message.msg and "API_THROTTLE_RATE" in message.msg
    assert "shared by every process" in message.hint
    with override_settings(CACHES=DUMMY):
        (message,) = checks.check_api_throttle_cache()
    assert "no rate is ever enforced" in message.msg


def test_a_shared_cache_no_throttle_or_no_api_is_no_w021() -> None:
    with override_settings(CACHES=SHARED):
        assert checks.check_api_throttle_cache() == []
    with override_settings(
        CACHES=LOCMEM,
        COORDINATION={"API_THROTTLE_RATE": None, "API_ANON_THROTTLE_RATE": None},
    ):
        assert checks.check_api_throttle_cache() == []
    with override_settings(CACHES=LOCMEM, ROOT_URLCONF="tests.support.urls_without_api"):
        assert checks.check_api_throttle_cache() == []


def test_w021_runs_under_check_deploy_only() -> None:
    from django.core.checks.registry import registry

    assert checks.check_api_throttle_cache in registry.get_checks(include_deployment_checks=True)
    assert checks.check_api_throttle_cache not in registry.get_checks()
    out = StringIO()
    with override_settings(CACHES=LOCMEM):
        call_command("check", deploy=True, stdout=out, stderr=out)
    assert "coordination.W021" in out.getvalue()


# --- E002: FencedModel declares its lock --------------------------------------


@pytest.fixture
def isolated_models(monkeypatch: pytest.MonkeyPatch) -> Any:
    with isolate_apps("project.demo") as registry:
        monkeypatch.setattr(fenced_models, "apps", registry)
        yield registry


def test_fenced_model_without_fence_lock_is_e002(isolated_models: Any) -> None:
    class Unguarded(FencedModel):
        class Meta(FencedModel.Meta):
            app_label = "demo"

    assert ids(checks.check_fenced_models()) == ["coordination.E002"]


def test_fence_lock_naming_a_missing_field_is_e002(isolated_models: Any) -> None:
    class Misnamed(FencedModel):
        fence_lock = "thing:{missing}"

        class Meta(FencedModel.Meta):
            app_label = "demo"

    messages = checks.check_fenced_models()
    assert ids(messages) == ["coordination.E002"]
    assert "'missing'" in messages[0].msg


def test_fence_lock_over_fields_passes(isolated_models: Any) -> None:
    class Guarded(FencedModel):
        owner = models.CharField(max_length=10)
        fence_lock = "thing:{owner}"

        class Meta(FencedModel.Meta):
            app_label = "demo"

    assert checks.check_fenced_models() == []


# --- W008: a FencedModel's managers make fenced querysets ------------------------


def test_a_manager_of_ones_own_is_w008_naming_the_fix(isolated_models: Any) -> None:
    class ShipmentManager(models.Manager["Shipment"]):
        def pending(self) -> models.QuerySet[Shipment]:
            return self.filter(state="pending")

    class Shipment(FencedModel):
        state = models.CharField(max_length=10)
        fence_lock = "shipment:{pk}"
        objects = ShipmentManager()

        class Meta(FencedModel.Meta):
            app_label = "demo"

    # The fix the hint names passes, and keeps the manager's own methods.
    class Delivery(FencedModel):
        state = models.CharField(max_length=10)
        fence_lock = "delivery:{pk}"
        objects = ShipmentManager.from_queryset(FencedQuerySet)()

        class Meta(FencedModel.Meta):
            app_label = "demo"

    (message,) = checks.check_fenced_models()
    assert message.id == "coordination.W008" and message.level == WARNING
    assert message.obj is Shipment and "demo.Shipment.objects" in message.msg
    assert "objects = ShipmentManager.from_queryset(FencedQuerySet)()" in message.hint
    assert hasattr(Delivery.objects, "pending") and hasattr(Delivery.objects.all(), "fenced_update")


def test_a_fenced_queryset_of_ones_own_passes(isolated_models: Any) -> None:
    class ShipmentQuerySet(FencedQuerySet["Parcel"]):
        def pending(self) -> ShipmentQuerySet:
            return self.filter(state="pending")

    class Parcel(FencedModel):
        state = models.CharField(max_length=10)
        fence_lock = "parcel:{pk}"
        objects = ShipmentQuerySet.as_manager()

        class Meta(FencedModel.Meta):
            app_label = "demo"

    assert checks.check_fenced_models() == []


# --- E003: settings -------------------------------------------------------------


def test_unknown_coordination_setting_is_e003() -> None:
    with override_settings(COORDINATION={"MAX_TTLS": 5}):
        assert ids(checks.check_settings()) == ["coordination.E003"]


def test_a_misspelt_setting_is_e003_with_the_key_meant_not_a_crash() -> None:
    with override_settings(COORDINATION={"RECORD_WRITE": True}):
        (message,) = checks.check_settings()
        assert message.id == "coordination.E003"
        assert "RECORD_WRITE" in message.msg
        assert "Did you mean 'RECORD_WRITES'?" in (message.hint or "")
        # The whole check run reports it instead of raising ImproperlyConfigured
        # from a check that reads the settings.
        with pytest.raises(SystemCheckError, match=r"coordination\.E003"):
            call_command("check", stdout=StringIO(), stderr=StringIO())


def test_code_reading_a_misspelt_setting_still_fails_clearly() -> None:
    from django.core.exceptions import ImproperlyConfigured

    from coordination.conf import app_settings

    with (
        override_settings(COORDINATION={"RECORD_WRITE": True}),
        pytest.raises(ImproperlyConfigured, match=r"did you mean 'RECORD_WRITES'"),
    ):
        assert app_settings.RECORD_WRITES is None  # never reached: the read raises


def test_ttl_bounds_out_of_order_is_e003() -> None:
    with override_settings(COORDINATION={"MIN_TTL": 10.0, "DEFAULT_TTL": 5.0}):
        assert ids(checks.check_settings()) == ["coordination.E003"]


@pytest.mark.parametrize("threads", [0, -1, 2.5, True, "8"])
def test_async_threads_not_a_positive_integer_is_e003(threads: object) -> None:
    with override_settings(COORDINATION={"ASYNC_THREADS": threads}):
        assert ids(checks.check_settings()) == ["coordination.E003"]
    with override_settings(COORDINATION={"ASYNC_THREADS": 4}):
        assert checks.check_settings() == []


@pytest.mark.parametrize("value", [-1, "30d", True, 10**12])
def test_a_bad_prune_locks_after_is_e003(value: object) -> None:
    with override_settings(COORDINATION={"PRUNE_LOCKS_AFTER": value}):
        assert ids(checks.check_settings()) == ["coordination.E003"]


@pytest.mark.parametrize("value", [None, 0, 86400, 2592000.0])
def test_prune_locks_after_takes_seconds_or_none(value: object) -> None:
    with override_settings(COORDINATION={"PRUNE_LOCKS_AFTER": value}):
        assert checks.check_settings() == []


@pytest.mark.parametrize("value", [0, -1, "5", True, 10**7])
def test_a_bad_fence_idle_timeout_is_e003(value: object) -> None:
    with override_settings(COORDINATION={"FENCE_IDLE_TIMEOUT": value}):
        assert ids(checks.check_settings()) == ["coordination.E003"]
    for good in (None, 0.5, 30):
        with override_settings(COORDINATION={"FENCE_IDLE_TIMEOUT": good}):
            assert checks.check_settings() == []


@pytest.mark.parametrize(
    "beat",
    [
        {"BEAT_ROLE": "has space"},
        {"BEAT_ROLE": ""},
        {"BEAT_LEASE": 0.01},         # under MIN_TTL
        {"BEAT_LEASE": 10**9},        # over MAX_TTL
        {"BEAT_LEASE": "15"},
        {"BEAT_LOCK_DELAY": -1},
        {"BEAT_LOCK_DELAY": True},
    ],
)
def test_a_beat_setting_the_scheduler_would_refuse_is_e003(beat: dict[str, object]) -> None:
    with override_settings(COORDINATION=beat):
        assert ids(checks.check_settings()) == ["coordination.E003"]


@pytest.mark.parametrize(
    "beat", [{}, {"BEAT_ROLE": "nightly-beat", "BEAT_LEASE": 5, "BEAT_LOCK_DELAY": 2.5}]
)
def test_good_beat_settings_pass(beat: dict[str, object]) -> None:
    with override_settings(COORDINATION=beat):
        assert checks.check_settings() == []


# --- W003: Celery visibility timeout against the longest lease -------------------


@pytest.mark.parametrize(
    ("broker", "options", "max_ttl", "expected"),
    [
        ("redis://localhost:6379/0", {"visibility_timeout": 600}, 3600.0, ["coordination.W003"]),
        ("rediss://cache:6380/0", {"visibility_timeout": 600}, 3600.0, ["coordination.W003"]),
        ("redis://localhost:6379/0", {}, 7200.0, ["coordination.W003"]),  # default 1 h
        ("redis://localhost:6379/0", {}, 3600.0, []),
        ("redis://localhost:6379/0", {"visibility_timeout": 7200}, 7200.0, []),
        ("sqs://", {}, 3600.0, ["coordination.W003"]),  # default 30 min
        ("sqs://", {"visibility_timeout": 43200}, 3600.0, []),
        ("amqp://guest@localhost//", {"visibility_timeout": 1}, 3600.0, []),  # acks, no timeout
        ("filesystem://", {}, 3600.0, []),
    ],
)
def test_visibility_timeout_shorter_than_max_ttl_is_w003(
    broker: str, options: dict[str, Any], max_ttl: float, expected: list[str]
) -> None:
    with override_settings(
        CELERY_BROKER_URL=broker,
        CELERY_BROKER_TRANSPORT_OPTIONS=options,
        COORDINATION={"MAX_TTL": max_ttl},
    ):
        assert ids(checks.check_celery_visibility_timeout()) == expected


def test_w003_names_both_numbers_and_the_fix() -> None:
    with override_settings(
        CELERY_BROKER_URL="redis://localhost:6379/0",
        CELERY_BROKER_TRANSPORT_OPTIONS={"visibility_timeout": 600},
    ):
        (message,) = checks.check_celery_visibility_timeout()
    assert "visibility_timeout=600 s" in message.msg
    assert "MAX_TTL']=3600 s" in message.msg
    assert "visibility_timeout" in message.hint


# --- E023: a Redis broker needs the redis client ---------------------------------


def test_redis_broker_without_the_redis_package_is_e023(monkeypatch: pytest.MonkeyPatch) -> None:
    real_find_spec = importlib.util.find_spec

    def find_spec(name: str, *args: Any) -> Any:
        return None if name == "redis" else real_find_spec(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with override_settings(CELERY_BROKER_URL="redis://localhost:6379/0"):
        (message,) = checks.check_celery_broker_client()
    assert message.id == "coordination.E023"
    assert "django-coordination[celery]" in message.hint


def test_redis_broker_with_the_redis_package_passes() -> None:
    with override_settings(CELERY_BROKER_URL="redis://localhost:6379/0"):
        assert checks.check_celery_broker_client() == []


@pytest.mark.parametrize("value", [-1, "2", True, None, 3601])
def test_a_bad_job_policy_refresh_is_e003(value: object) -> None:
    with override_settings(COORDINATION={"JOB_POLICY_REFRESH": value}):
        assert ids(checks.check_settings()) == ["coordination.E003"]
    for good in (0, 0.5, 2, 3600):
        with override_settings(COORDINATION={"JOB_POLICY_REFRESH": good}):
            assert checks.check_settings() == []
