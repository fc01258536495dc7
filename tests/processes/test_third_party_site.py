"""A new user's site, built from the tutorial: the wheel of this checkout in a fresh
virtualenv, ``django-admin startproject shop``, the tutorial's "Installation" section
applied word for word, migrated on PostgreSQL, then the seed story with a real
``celery worker``, the system checks, the REST API and the admin dashboard.

Nothing here imports the shop: it is another project in another virtualenv, driven
through its own ``manage.py``, ``celery`` and HTTP, using the public API only.

The Installation section of docs/tutorial.md is a program this test runs. Each fenced code
block starts with a line saying what it is:

- ``# shell``: commands, one per line, run in order. The test knows each command it
  runs (``pip install``, ``django-admin startproject``, ``cd``, ``python manage.py ...``,
  ``celery -A ... worker``); an unknown one fails the test, so the README cannot
  grow a step this test does not take. Three are adapted, never rewritten:
  ``pip install`` installs the wheel built from this checkout in place of the
  package name (same extras, constrained to requirements/run.txt's pins; with
  this test's pip, as the fresh virtualenv is made without one),
  ``createsuperuser`` gets ``--noinput`` (its password from the environment), and
  ``runserver`` gets a free port and ``--noreload``; the worker and the server run
  in the background.
- ``# FILE (new file)`` / ``# FILE (append)``: the whole block, marker line
  included, is written to (or appended to) FILE, relative to the project directory.
  ``(append, on PostgreSQL)`` / ``(append, on SQLite)``: for that database only;
  this test applies the PostgreSQL ones.
- ``# python manage.py shell``: the block is fed to ``python manage.py shell``.

It runs on the PostgreSQL main leg (Python 3.12 + Django 6.1) only, and prints how
long each phase took.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.cookiejar import CookieJar
from pathlib import Path
from typing import Any

import pytest

from tests.support.celery_workers import events
from tests.support.legs import missing_service
from tests.support.pausing import paused

REPO = Path(__file__).resolve().parents[2]
# The tutorial holds the Installation section (the README points to it).
README = REPO / "docs" / "tutorial.md"
SUPERUSER_PASSWORD = "shop-admin-password-1"
STORY_TTL = 2.0  # seconds: worker A's lease, which its pause outlasts
# What a page that loads from outside contains. Not a bare "cdn": the page's random
# CSRF token (letters and digits) contains that now and then.
CDN_MARKERS = ("https://", "http://", "cdn.", "jsdelivr", "unpkg", "googleapis")


# --- the README's Installation section, as blocks -----------------------------------

FILE_MARKER = re.compile(
    r"^# (?P<path>[\w./-]+) \((?P<action>append|new file)(?:, on (?P<database>PostgreSQL|SQLite))?\)$"
)
SHELL_MARKER = "# shell"
PYTHON_SHELL_MARKER = "# python manage.py shell"


@dataclass(frozen=True)
class Block:
    kind: str  # "shell", "file" or "python-shell"
    text: str  # the whole block, marker line included
    path: str = ""
    action: str = ""
    database: str = ""

    @property
    def body(self) -> list[str]:
        return self.text.splitlines()[1:]


def installation_blocks(readme: str) -> list[Block]:
    """The code blocks of the tutorial's "## Installation" section, or a failure saying what changed."""
    match = re.search(r"^## Installation\n(?P<section>.*?)(?=^## )", readme, re.MULTILINE | re.DOTALL)
    if match is None:
        pytest.fail(f"{README} has no '## Installation' section (followed by another '## ' section)")
    fences = re.findall(r"^```[\w-]*\n(.*?)^```$", match["section"], re.MULTILINE | re.DOTALL)
    if not fences:
        pytest.fail(f"{README}'s Installation section has no code blocks")
    blocks: list[Block] = []
    for text in fences:
        first = text.splitlines()[0] if text.strip() else ""
        if first == SHELL_MARKER:
            blocks.append(Block("shell", text))
        elif first == PYTHON_SHELL_MARKER:
            blocks.append(Block("python-shell", text))
        elif marker := FILE_MARKER.match(first):
            blocks.append(
                Block("file", text, marker["path"], marker["action"], marker["database"] or "")
            )
        else:
            pytest.fail(
                f"A code block of {README.name}'s Installation section does not start with a marker this "
                f"test knows ('{SHELL_MARKER}', '{PYTHON_SHELL_MARKER}', '# FILE (new file)', "
                f"'# FILE (append)', '# FILE (append, on PostgreSQL|SQLite)'):\n{text}"
            )
    return blocks


def test_the_installation_section_parses_into_known_blocks() -> None:
    blocks = installation_blocks(README.read_text())
    kinds = {block.kind for block in blocks}
    assert kinds == {"shell", "file", "python-shell"}
    assert {block.database for block in blocks} == {"", "PostgreSQL", "SQLite"}
    # The SQLite variant is not run here (this run is on PostgreSQL): at least it parses.
    for block in blocks:
        if block.kind != "shell":
            compile(block.text, block.path or "<README python block>", "exec")


# --- phases, timed ------------------------------------------------------------------


@dataclass
class Phases:
    report: Callable[[str], None]
    started: float = field(default_factory=time.monotonic)
    timings: list[tuple[str, float]] = field(default_factory=list)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        began = time.monotonic()
        try:
            yield
        finally:
            took = time.monotonic() - began
            self.timings.append((name, took))
            self.report(f"[third-party site] {name}: {took:.1f} s")

    def summary(self) -> str:
        width = max(len(name) for name, _ in self.timings) if self.timings else 0
        lines = [f"  {name:<{width}} {took:6.1f} s" for name, took in self.timings]
        lines.append(f"  {'total':<{width}} {time.monotonic() - self.started:6.1f} s")
        return "[third-party site] phases:\n" + "\n".join(lines)


# --- services -----------------------------------------------------------------------


def service_url(*names: str, what: str) -> str:
    for name in names:
        if value := os.environ.get(name, "").strip():
            return value
    missing_service(
        f"{' or '.join(names)} is not set: the third-party-site test needs {what} (bin/test starts one)"
    )


@contextlib.contextmanager
def fresh_database(server_url: str) -> Iterator[dict[str, str]]:
    """A new, empty database on the test server, dropped afterwards; libpq's environment for it."""
    import psycopg

    url = urllib.parse.urlsplit(server_url)
    name = f"shop_{uuid.uuid4().hex[:12]}"
    admin = psycopg.connect(server_url, autocommit=True)
    try:
        admin.execute(f'CREATE DATABASE "{name}"')
        yield {
            "PGHOST": url.hostname or "127.0.0.1",
            "PGPORT": str(url.port or 5432),
            "PGUSER": urllib.parse.unquote(url.username or ""),
            "PGPASSWORD": urllib.parse.unquote(url.password or ""),
            "PGDATABASE": name,
        }
    finally:
        with contextlib.suppress(psycopg.Error):
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.close()


DEFAULT_QUEUE_KEYS = ("celery", "unacked", "unacked_index", "unacked_mutex")


def clean_default_queue(redis_url: str) -> None:
    """Drop the broker keys of Celery's default queue (the shop's worker uses it, unprefixed)."""
    import redis

    client = redis.Redis.from_url(redis_url)
    keys = [*DEFAULT_QUEUE_KEYS, *client.scan_iter(match="_kombu.binding.celery*")]
    client.delete(*keys)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


# --- the shop: a project in its own virtualenv ----------------------------------------


@dataclass
class Background:
    name: str
    process: subprocess.Popen[bytes]
    log: Path

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGCONT)  # a paused child must be able to die
            os.killpg(self.process.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(15)


@dataclass
class Shop:
    """The new user's machine: a work directory, a virtualenv and the project's processes."""

    root: Path
    venv: Path
    wheel: Path
    constraints: Path
    env: dict[str, str]
    cwd: Path
    port: int = 0
    token: str = ""
    background: list[Background] = field(default_factory=list)

    def bin(self, name: str) -> str:
        return str(self.venv / "bin" / name)

    def run(
        self, command: list[str], *, timeout: float = 300, check: bool = True, stdin: str | None = None,
        env: dict[str, str] | None = None,
    ) -> subprocess.CompletedProcess[str]:
        finished = subprocess.run(
            command, cwd=self.cwd, env={**self.env, **(env or {})}, input=stdin, capture_output=True,
            text=True, timeout=timeout, check=False,
        )
        if check and finished.returncode != 0:
            pytest.fail(
                f"{shlex.join(command)} (in {self.cwd}) exited {finished.returncode}:\n"
                f"{finished.stdout[-4000:]}\n{finished.stderr[-4000:]}"
            )
        return finished

    def manage(self, *arguments: str, **options: Any) -> subprocess.CompletedProcess[str]:
        return self.run([self.bin("python"), "manage.py", *arguments], **options)

    def python(self, code: str, *, timeout: float = 180) -> Any:
        """Run ``code`` in the shop's Django (``manage.py shell -c``); its last output line, as JSON."""
        output = self.manage("shell", "-c", code, timeout=timeout).stdout
        lines = [line for line in output.splitlines() if line.strip()]
        try:
            return json.loads(lines[-1])
        except (IndexError, ValueError):
            pytest.fail(f"no JSON line at the end of the shop's shell output:\n{output}")

    def start(self, name: str, command: list[str], **env: str) -> Background:
        log = self.root / f"{name}.log"
        with open(log, "wb") as out:
            process = subprocess.Popen(
                command, cwd=self.cwd, env={**self.env, **env}, stdin=subprocess.DEVNULL, stdout=out,
                stderr=subprocess.STDOUT, start_new_session=True,
            )
        started = Background(name, process, log)
        self.background.append(started)
        return started

    def stop_all(self) -> None:
        for process in reversed(self.background):
            process.stop()
        self.background.clear()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def shop_environment(database: dict[str, str], broker_url: str, venv: Path) -> dict[str, str]:
    """The user's shell: this machine's environment without anything of this repository's site."""
    env = {
        name: value
        for name, value in os.environ.items()
        if not name.startswith(("DJANGO_", "COORDINATION_", "CELERY_", "PYTEST_", "PG"))
        and name not in {"DATABASE_URL", "PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP"}
    }
    env.update(database)
    env.update(
        PATH=os.pathsep.join([str(venv / "bin"), env.get("PATH", "/usr/bin:/bin")]),
        VIRTUAL_ENV=str(venv),
        CELERY_BROKER_URL=broker_url,
        CELERY_RESULT_BACKEND=broker_url,  # the tutorial keeps task outcomes in Redis too
        DJANGO_SUPERUSER_PASSWORD=SUPERUSER_PASSWORD,
        PYTHONUNBUFFERED="1",
    )
    return env


def build_wheel(into: Path) -> Path:
    """The wheel of this checkout as it is (tracked and new files, not ignored ones), built
    from a copy so a stale build/ directory of the checkout cannot leak into it."""
    source = into / "source"
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO, capture_output=True, check=True,
    ).stdout.decode().split("\0")
    for name in filter(None, listed):
        path = REPO / name
        if path.is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, source / name)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(into / "dist"), str(source)],
        check=True, capture_output=True, timeout=300,
    )
    (wheel,) = (into / "dist").glob("django_coordination-*.whl")
    return wheel


def pinned_constraints(into: Path) -> Path:
    """requirements/run.txt's pins as a pure constraints file (pip would install a ``-r``
    inside a constraints file as requirements)."""
    pins: list[str] = []

    def read(path: Path) -> None:
        for line in path.read_text().splitlines():
            line = line.split("#", 1)[0].strip()
            if line.startswith(("-r ", "-c ")):
                read(path.parent / line.split(None, 1)[1])
            elif "==" in line:
                pins.append(line)

    read(REPO / "requirements" / "run.txt")
    target = into / "constraints.txt"
    target.write_text("\n".join(pins) + "\n")
    return target


# --- running the README -------------------------------------------------------------


@dataclass
class ReadmeRun:
    shop: Shop
    phases: Phases
    before_worker: Callable[[], None]
    worker: Background | None = None
    server: Background | None = None
    shell_outputs: list[str] = field(default_factory=list)

    def apply(self, blocks: list[Block]) -> None:
        for block in blocks:
            if block.kind == "file":
                self.write_file(block)
            elif block.kind == "python-shell":
                with self.phases.phase("README: worker and server up, python manage.py shell block"):
                    self.wait_until_up()
                    finished = self.shop.manage("shell", stdin="\n".join(block.body) + "\n", timeout=120)
                    self.shell_outputs.append(finished.stdout)
            else:
                for line in block.body:
                    if line.strip() and not line.lstrip().startswith("#"):
                        with self.phases.phase(f"README: {line.strip()}"):
                            self.command(shlex.split(line))

    def write_file(self, block: Block) -> None:
        if block.database == "SQLite":
            return  # this run is on PostgreSQL
        target = self.shop.cwd / block.path
        if block.action == "new file":
            assert not target.exists(), f"the README creates {block.path}, which already exists"
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(block.text)
        else:
            assert target.exists(), f"the README appends to {block.path}, which does not exist"
            with target.open("a") as out:
                out.write("\n\n" + block.text)

    def command(self, words: list[str]) -> None:
        shop = self.shop
        match words:
            case ["pip", "install", requirement]:
                name, _, extras = requirement.partition("[")
                assert name == "django-coordination", f"the README installs {requirement!r}"
                wheel = f"{shop.wheel}[{extras}" if extras else str(shop.wheel)
                # This test's own pip installs into the shop's virtualenv (made without
                # one: a quarter of a minute saved), and leaves byte-compiling to imports.
                shop.run(
                    [sys.executable, "-m", "pip", "--python", shop.bin("python"), "install", "-q",
                     "--no-compile", "--disable-pip-version-check", wheel, "-c", str(shop.constraints)],
                    timeout=900,
                )
            case ["django-admin", "startproject", name]:
                shop.run([shop.bin("django-admin"), "startproject", name])
            case ["cd", directory]:
                shop.cwd = shop.cwd / directory
                assert shop.cwd.is_dir(), f"the README changes to {directory}, which does not exist"
            case ["python", "manage.py", "createsuperuser", *options]:
                shop.manage("createsuperuser", *options, "--noinput")
            case ["python", "manage.py", "drf_create_token", user]:
                output = shop.manage("drf_create_token", user).stdout
                found = re.search(r"Generated token (\w+) for user", output)
                assert found, output
                shop.token = found[1]
            case ["python", "manage.py", "check"]:
                output = shop.manage("check").stdout
                assert "System check identified no issues" in output, output
            case ["python", "manage.py", "runserver"]:
                shop.port = free_port()
                self.server = shop.start(
                    "runserver", [shop.bin("python"), "manage.py", "runserver", f"127.0.0.1:{shop.port}",
                                  "--noreload"],
                )
            case ["python", "manage.py", *arguments]:
                shop.manage(*arguments)
            case ["celery", *arguments] if "worker" in arguments:
                self.before_worker()
                self.worker = shop.start("worker", [shop.bin("celery"), *arguments])
            case _:
                pytest.fail(
                    f"README.md's Installation section runs {shlex.join(words)!r}, a command this test "
                    "does not know: teach tests/processes/test_third_party_site.py what it does"
                )

    def wait_until_up(self, timeout: float = 120) -> None:
        assert self.worker is not None and self.server is not None, "the README starts no worker or server"
        deadline = time.monotonic() + timeout
        while " ready." not in self.worker.text():
            if self.worker.process.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"the shop's worker did not start:\n{self.worker.text()[-4000:]}")
            time.sleep(0.1)
        while True:
            with contextlib.suppress(OSError):
                urllib.request.urlopen(f"{self.shop.base_url}/admin/login/", timeout=5).close()
                return
            if self.server.process.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"the shop's runserver did not answer:\n{self.server.text()[-4000:]}")
            time.sleep(0.1)


# The seed's paused writer, added to the README's orders/tasks.py by this test (the
# README's own task keeps its lease alive; this one holds a plain lease, as the seed's
# client does, and waits for a file after reading, where the test pauses it).
STORY_TASK = f'''

# --- added by tests/processes/test_third_party_site.py, not part of the README ---
import json as _json
import os as _os
import time as _time
from pathlib import Path as _Path

from coordination import locks as _locks
from coordination.exceptions import CoordinationError as _CoordinationError


@fenced_task(lock="order:{{order_id}}", ttl={STORY_TTL}, keepalive=False, on_busy="raise")
def late_writer(order_id, status, report, resume_file):
    order = Order.objects.get(pk=order_id)
    grant = _locks.current_grant()
    _note(report, "read", pid=_os.getpid(), token=grant.token, status=order.status)
    deadline = _time.monotonic() + 300
    while not _Path(resume_file).exists():
        if _time.monotonic() > deadline:
            raise TimeoutError("never resumed")
        _time.sleep(0.05)
    try:
        Order.objects.filter(pk=order_id).fenced_update(status=status)
    except _CoordinationError as refused:
        _note(report, "refused", token=grant.token, code=refused.code)
        return
    _note(report, "written", token=grant.token)


def _note(report, event, **fields):
    with open(report, "a") as out:
        out.write(_json.dumps({{"event": event, **fields}}) + "\\n")
'''

BROKEN_SETTINGS = """\
# Added by tests/processes/test_third_party_site.py: two mistakes the checks must name.
from .settings import *  # noqa: F403

INSTALLED_APPS = [app for app in INSTALLED_APPS if app != "rest_framework.authtoken"]  # noqa: F405
DATABASES = {
    "default": {"ENGINE": "django.db.backends.sqlite3", "NAME": BASE_DIR / "broken.sqlite3"}  # noqa: F405
}
"""


def wait_for_event(path: Path, event: str, worker: Background, timeout: float = 90) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        for item in events(path):
            if item["event"] == event:
                return item
        if time.monotonic() > deadline:
            pytest.fail(f"no {event!r} event in time; events: {events(path)}\n{worker.text()[-4000:]}")
        time.sleep(0.05)


# --- HTTP ---------------------------------------------------------------------------


def fetch(
    url: str, *, method: str = "GET", body: Any = None, token: str = "",
    opener: urllib.request.OpenerDirector | None = None, data: bytes | None = None,
) -> tuple[int, str, dict[str, str]]:
    # The API client asks for JSON; the logged-in browser for pages (as a browser does).
    headers = {"Accept": "text/html,*/*;q=0.8" if opener else "application/json"}
    if token:
        headers["Authorization"] = f"Token {token}"
    if body is not None:
        data = json.dumps(body).encode()
        headers["Content-Type"] = "application/json"
    request = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with (opener or urllib.request.build_opener()).open(request, timeout=60) as response:
            return response.status, response.read().decode(errors="replace"), dict(response.headers)
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode(errors="replace"), dict(error.headers)


def logged_in(base_url: str, username: str, password: str) -> urllib.request.OpenerDirector:
    """A browser-like client with the admin's session cookie (login form and CSRF token)."""
    opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(CookieJar()))
    status, page, _ = fetch(f"{base_url}/admin/login/?next=/admin/", opener=opener)
    assert status == 200, page[-2000:]
    csrf = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page)
    assert csrf, page[-2000:]
    form = urllib.parse.urlencode(
        {"csrfmiddlewaretoken": csrf[1], "username": username, "password": password, "next": "/admin/"}
    ).encode()
    request = urllib.request.Request(f"{base_url}/admin/login/?next=/admin/", data=form, method="POST")
    with opener.open(request, timeout=60) as response:
        assert response.url.endswith("/admin/"), f"login failed: ended at {response.url}"
    return opener


# --- the test -----------------------------------------------------------------------


@pytest.fixture
def report_line(capsys: pytest.CaptureFixture[str]) -> Callable[[str], None]:
    def report(line: str) -> None:
        with capsys.disabled():
            sys.stdout.write(f"\n{line}")
            sys.stdout.flush()

    return report


@pytest.mark.legs("pg", reason="a fresh virtualenv with the main Django installs once per run")
def test_a_new_site_installed_from_the_readme_refuses_the_paused_workers_late_write(
    tmp_path: Path, report_line: Callable[[str], None]
) -> None:
    server_url = service_url("COORDINATION_TEST_DATABASE_URL", "DATABASE_URL", what="a PostgreSQL server")
    broker_url = service_url("COORDINATION_TEST_REDIS_URL", what="a Redis server")
    blocks = installation_blocks(README.read_text())
    phases = Phases(report_line)

    with phases.phase("build the wheel from the checkout"):
        wheel = build_wheel(tmp_path / "build")
    with phases.phase("fresh virtualenv (Python 3.12)"):
        venv = tmp_path / "venv"
        subprocess.run(
            [sys.executable, "-m", "venv", "--without-pip", str(venv)],
            check=True, capture_output=True, timeout=300,
        )
    home = tmp_path / "home"
    home.mkdir()
    clean_default_queue(broker_url)
    with fresh_database(server_url) as database:
        shop = Shop(
            root=tmp_path, venv=venv, wheel=wheel, constraints=pinned_constraints(tmp_path),
            env=shop_environment(database, broker_url, venv), cwd=home,
        )
        try:
            run = ReadmeRun(shop, phases, before_worker=lambda: append_story_task(shop))
            run.apply(blocks)
            assert shop.token and run.worker and run.server, "the README made no token, worker or server"

            with phases.phase("the README's task ran: the order is paid"):
                paid = shop.python(WAIT_FOR_PAID)
                assert paid["status"] == "paid", (paid, run.worker.text()[-4000:])
                assert paid["fence"] >= 1

            with phases.phase("seed story: paused worker A, newer token B, A's late write"):
                story = seed_story(shop, run.worker, tmp_path)

            with phases.phase("system checks name a bad setting (check, worker start)"):
                checks_name_bad_settings(shop)

            with phases.phase("REST API with a DRF token, schema, docs"):
                rest_api(shop, story)

            with phases.phase("admin dashboard and metrics, logged in"):
                dashboard(shop, story)
        except BaseException:
            for process in shop.background:
                report_line(f"--- {process.name} log (tail)\n{process.text()[-3000:]}")
            raise
        finally:
            shop.stop_all()
            clean_default_queue(broker_url)
    report_line(phases.summary())


def append_story_task(shop: Shop) -> None:
    tasks = shop.cwd / "orders" / "tasks.py"
    assert tasks.exists(), "the README makes no orders/tasks.py"
    with tasks.open("a") as out:
        out.write(STORY_TASK)


WAIT_FOR_PAID = """
import json, time
from orders.models import Order
deadline = time.monotonic() + 90
order = Order.objects.order_by("pk").first()  # the task's; the tutorial's later blocks add more
while order.status != "paid" and time.monotonic() < deadline:
    time.sleep(0.1)
    order.refresh_from_db()
print(json.dumps({"status": order.status, "fence": order.fence}))
"""


@dataclass(frozen=True)
class Story:
    order_id: int
    key: str
    token_a: int
    token_b: int


def seed_story(shop: Shop, worker: Background, tmp_path: Path) -> Story:
    """Rule 2 of docs/rules.md with real processes: A reads and pauses past its lease, the
    lease expires by the database clock, B takes a newer token and writes, A resumes and
    its write with the older token is refused; B's value stays."""
    report, resume = tmp_path / "story.jsonl", tmp_path / "resume-a"
    order_id = shop.python(
        "import json\nfrom orders.models import Order\n"
        "print(json.dumps(Order.objects.create(total='99.00').pk))"
    )
    key = f"order:{order_id}"
    shop.python(
        "from orders.tasks import late_writer\n"
        f"late_writer.delay({order_id}, 'paid-by-a', {str(report)!r}, {str(resume)!r})\nprint('{{}}')"
    )
    read = wait_for_event(report, "read", worker)
    try:
        with paused(read["pid"]):  # the task's own process: the seed's pause
            # B waits for A's lease to run out by the database clock (A cannot release it).
            b = shop.python(
                "import json\nfrom coordination import locks\nfrom orders.models import Order\n"
                f"grant = locks.acquire({key!r}, holder='writer-b', ttl=30, wait=120)\n"
                f"Order.objects.filter(pk={order_id}).fenced_update(grant, status='refunded-by-b')\n"
                "locks.release(grant)\n"
                "print(json.dumps({'token': grant.token}))"
            )
            assert b["token"] > read["token"]
    finally:
        resume.touch()
    refused = wait_for_event(report, "refused", worker)
    assert refused == {"event": "refused", "token": read["token"], "code": "stale_token"}
    assert not [item for item in events(report) if item["event"] == "written"]
    final = shop.python(
        "import json\nfrom orders.models import Order\n"
        f"order = Order.objects.get(pk={order_id})\n"
        "print(json.dumps({'status': order.status, 'fence': order.fence}))"
    )
    assert final == {"status": "refunded-by-b", "fence": b["token"]}
    return Story(order_id, key, read["token"], b["token"])


def checks_name_bad_settings(shop: Shop) -> None:
    (shop.cwd / "shop" / "settings_broken.py").write_text(BROKEN_SETTINGS)
    broken = shop.manage("check", "--settings", "shop.settings_broken", check=False)
    output = broken.stdout + broken.stderr
    assert broken.returncode != 0, output
    assert "coordination.E021" in output and "'rest_framework.authtoken'" in output, output
    assert "coordination.E004" in output and '"transaction_mode": "IMMEDIATE"' in output, output
    # A worker of the broken project refuses to start, naming them (Celery drops Django's
    # own check results).
    worker = shop.run(
        [shop.bin("celery"), "-A", "shop", "worker", "-l", "INFO"], check=False, timeout=120,
        env={"DJANGO_SETTINGS_MODULE": "shop.settings_broken"},
    )
    output = worker.stdout + worker.stderr
    assert worker.returncode != 0, output[-4000:]
    assert "coordination.E004" in output and "coordination.E021" in output, output[-4000:]


def rest_api(shop: Shop, story: Story) -> None:
    api = f"{shop.base_url}/api"
    status, body, _ = fetch(f"{api}/locks/report:7/acquire", method="POST", token=shop.token,
                           body={"holder": "curl", "ttl": 30})
    assert status == 201, body
    grant = json.loads(body)
    assert grant["token"] == 1
    status, body, _ = fetch(f"{api}/locks/report:7/release", method="POST", token=shop.token,
                           body={"token": grant["token"], "lease_id": grant["lease_id"]})
    assert status == 200, body
    assert json.loads(body)["end_reason"] == "released"

    status, body, _ = fetch(f"{api}/locks/{story.key}/grants", token=shop.token)
    assert status == 200, body
    grants = {row["token"]: row for row in json.loads(body)["results"]}
    assert grants[story.token_a]["end_reason"] == "expired"
    assert grants[story.token_b]["end_reason"] == "released"
    # B was granted only after A's lease had run out, by the database clock.
    assert grants[story.token_b]["acquired_at"] >= grants[story.token_a]["expires_at"]
    status, body, _ = fetch(f"{api}/rejections/?lock_key={story.key}", token=shop.token)
    assert status == 200, body
    (rejection,) = json.loads(body)["results"]
    assert (rejection["token"], rejection["reason"]) == (story.token_a, "stale_token")
    assert rejection["watermark_token"] == story.token_b

    status, body, _ = fetch(f"{api}/schema/?format=json", token=shop.token)
    assert status == 200, body
    assert "/api/locks/{key}/acquire" in json.loads(body)["paths"]
    status, body, headers = fetch(f"{api}/locks/")
    assert (status, headers.get("WWW-Authenticate")) == (401, "Token"), body

    browser = logged_in(shop.base_url, "admin", SUPERUSER_PASSWORD)
    for page_path in ("/api/docs/", "/api/docs/redoc/"):
        status, page, _ = fetch(f"{shop.base_url}{page_path}", opener=browser)
        assert status == 200, page[-2000:]
        assert not [marker for marker in CDN_MARKERS if marker in page.lower()], page
        assets = re.findall(r'(?:src|href)="(/static/drf_spectacular_sidecar/[^"]+)"', page)
        assert assets, page
        for asset in assets:
            status, _, _ = fetch(f"{shop.base_url}{asset}", opener=browser)
            assert status == 200, asset


def dashboard(shop: Shop, story: Story) -> None:
    browser = logged_in(shop.base_url, "admin", SUPERUSER_PASSWORD)
    status, page, _ = fetch(f"{shop.base_url}/admin/coordination/lock/dashboard/", opener=browser)
    assert status == 200, page[-2000:]
    assert f'data-key="{story.key}"' in page
    status, page, _ = fetch(
        f"{shop.base_url}/admin/coordination/lock/dashboard/?key={urllib.parse.quote(story.key)}",
        opener=browser,
    )
    assert status == 200, page[-2000:]
    status, metrics, _ = fetch(f"{shop.base_url}/metrics", opener=browser)
    assert status == 200, metrics[-2000:]
    assert "coordination_grants_total" in metrics
