"""`codecage audit web`: Datasette over a real audit store, seen by headless Chromium with the
network cut off (the page and its chart need nothing from outside), read-only, and behind a
token on every address, loopback included (`--insecure-no-token` waives it on loopback)."""

from __future__ import annotations

import base64
import contextlib
import datetime
import os
import shutil
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from codecage import Options, Sandbox
from codecage.audit import Query, open_store
from codecage.audit.web import CHART_FRAGMENT
from test_server import CODECAGE, free_port, server_env

CHROMIUM = shutil.which("chromium")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed")

WIDTH, HEIGHT = 1200, 900
TOKEN = uuid.uuid4().hex
BEARER = {"Authorization": f"Bearer {TOKEN}"}


@dataclass
class Store:
    db: Path
    run_ids: list[str]


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Store:
    """Real runs, and copies of one spread over the last day (a chart needs several hours)."""
    db = tmp_path_factory.mktemp("web") / "audit.db"
    with Sandbox(pool=False, profile="basic", options=Options(audit=db)) as sandbox:
        runs = [sandbox.run("print('fine')"), sandbox.run("1 / 0"), sandbox.run("import socket")]
    trail = open_store(db)
    template = trail.query(Query(limit=1))[0]
    now = datetime.datetime.now(datetime.UTC)
    spread = [
        template.model_copy(
            update={
                "execution_id": uuid.uuid4().hex,
                "started_at": now - datetime.timedelta(hours=hours),
                "status": "error" if hours % 3 == 0 else "ok",
            }
        )
        for hours in range(1, 25)
        for _ in range(hours % 4 + 1)
    ]
    trail.write(spread)
    trail.close()
    return Store(db, [r.execution_id for r in runs])


@contextlib.contextmanager
def serving(db: Path, *args: str, **env: str) -> Iterator[str]:
    """The view on a free port; its token is TOKEN unless `args` say otherwise."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    given = args or ("--token-env", "WEB_TOKEN")
    with subprocess.Popen(
        [CODECAGE, "audit", "web", "--store", str(db), "--port", str(port), *given],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=server_env(**({"WEB_TOKEN": TOKEN} | env)),
    ) as proc:
        try:
            deadline = time.monotonic() + 30
            while fetch(url + "/-/versions.json")[0] == 0:
                assert proc.poll() is None, "codecage audit web exited"
                assert time.monotonic() < deadline, "codecage audit web did not listen"
                time.sleep(0.1)
            yield url
        finally:
            proc.terminate()
            proc.wait(timeout=10)


def fetch(url: str, **headers: str) -> tuple[int, str]:
    """(status, body) of a GET; status 0 when nothing answered."""
    request = urllib.request.Request(url, headers=headers)  # noqa: S310 - http only
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:  # noqa: S310 - http only
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, str(exc.headers.get("WWW-Authenticate", ""))
    except OSError:
        return 0, ""


def chromium(*args: str) -> subprocess.CompletedProcess[str]:
    assert CHROMIUM is not None
    return subprocess.run(
        [
            CHROMIUM,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            f"--window-size={WIDTH},{HEIGHT}",
            "--virtual-time-budget=8000",
            # Nothing but this machine resolves: a page that needed a CDN would break.
            "--host-resolver-rules=MAP * ~NOTFOUND , EXCLUDE 127.0.0.1",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_runs_page_lists_the_runs(store: Store) -> None:
    with serving(store.db) as url:
        done = chromium("--dump-dom", f"{url}/audit/recent_runs?token={TOKEN}")
    assert done.returncode == 0, done.stderr[-2000:]
    for run_id in store.run_ids:
        assert run_id in done.stdout
    assert "import_blocked" in done.stdout


def test_the_chart_of_runs_per_hour_renders_offline(store: Store, tmp_path: Path) -> None:
    from PIL import Image

    shot = tmp_path / "chart.png"
    with serving(store.db) as url:
        page = f"{url}/audit/runs_per_hour?token={TOKEN}{CHART_FRAGMENT}"
        done = chromium(f"--screenshot={shot}", page)
    assert done.returncode == 0 and shot.exists(), done.stderr[-2000:]
    with Image.open(shot) as image:
        assert image.size == (WIDTH, HEIGHT)
        chart_area = image.convert("HSV").crop((60, 540, 700, 770))
        saturation = chart_area.getchannel("S").histogram()
        coloured = sum(saturation[81:])
    # The bars fill much of that area; without a chart it holds the table's text on white.
    assert coloured > 10_000, f"no chart drawn ({coloured} coloured pixels)"


def test_browsing_never_changes_the_store(store: Store) -> None:
    before = (store.db.stat().st_mtime_ns, store.db.read_bytes())
    with serving(store.db) as url:
        for page in ("/audit/recent_runs", "/audit/failures", "/audit/denials", "/audit"):
            assert fetch(url + page, **BEARER)[0] == 200
    assert (store.db.stat().st_mtime_ns, store.db.read_bytes()) == before


def test_another_address_needs_a_token(store: Store) -> None:
    done = subprocess.run(
        [CODECAGE, "audit", "web", "--store", str(store.db), "--host", "0.0.0.0"],  # noqa: S104
        capture_output=True,
        text=True,
        env=server_env(),
        timeout=60,
    )
    assert done.returncode == 2 and "--token-env" in done.stderr


def test_on_loopback_too_a_token_is_required_one_made_and_printed_with_its_url(
    store: Store,
) -> None:
    """The store is root-only; a view on loopback without a token would give every local
    user SQL over the whole trail. Started with no token, the view makes one."""
    port = free_port()
    with subprocess.Popen(
        [CODECAGE, "audit", "web", "--store", str(store.db), "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=server_env(),
    ) as proc:
        try:
            assert proc.stderr is not None
            line = next(x for x in proc.stderr if "codecage audit web on" in x)
            printed = line.split()[4]
            base, _, token = printed.partition("/?token=")
            assert base == f"http://127.0.0.1:{port}" and len(token) >= 32
            deadline = time.monotonic() + 30
            while fetch(base + "/-/versions.json")[0] == 0:
                assert time.monotonic() < deadline, "codecage audit web did not listen"
                time.sleep(0.1)
            assert fetch(base + "/audit/recent_runs")[0] == 401
            assert fetch(base + "/audit.json?sql=select+code+from+executions")[0] == 401
            assert fetch(base + "/audit/recent_runs", Authorization=f"Bearer {token}")[0] == 200
            assert fetch(base + "/audit/recent_runs?token=" + "x" * len(token))[0] == 401
            # The printed URL: a redirect that sets the cookie and drops the token from it.
            opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor())
            with opener.open(f"{base}/audit/recent_runs?token={token}", timeout=30) as page:
                assert page.status == 200 and "token=" not in page.url
                assert store.run_ids[0] in page.read().decode()
            with opener.open(f"{base}/audit/failures", timeout=30) as page:  # the cookie
                assert page.status == 200
        finally:
            proc.terminate()
            proc.wait(timeout=10)


def test_no_token_only_when_waived_explicitly_and_only_on_loopback(store: Store) -> None:
    with serving(store.db, "--insecure-no-token") as url:
        assert fetch(url + "/audit/recent_runs")[0] == 200
    anywhere = "0.0.0.0"  # noqa: S104
    done = subprocess.run(
        [
            CODECAGE,
            "audit",
            "web",
            "--store",
            str(store.db),
            "--insecure-no-token",
            "--host",
            anywhere,
        ],
        capture_output=True,
        text=True,
        env=server_env(),
        timeout=60,
    )
    assert done.returncode == 2 and "--token" in done.stderr


def test_with_a_token_every_request_must_carry_it(store: Store) -> None:
    token = uuid.uuid4().hex
    page = "/audit/recent_runs"
    with serving(store.db, "--token-env", "WEB_TOKEN", WEB_TOKEN=token) as url:
        status, challenge = fetch(url + page)
        assert status == 401 and "Basic" in challenge
        wrong = base64.b64encode(b"x:" + b"0" * 32).decode()
        assert fetch(url + page, Authorization=f"Basic {wrong}")[0] == 401
        assert fetch(url + page, Authorization=f"Bearer {token[:-1]}")[0] == 401
        basic = base64.b64encode(f"operator:{token}".encode()).decode()
        for header in (f"Basic {basic}", f"Bearer {token}"):
            status, body = fetch(url + page, Authorization=header)
            assert status == 200 and store.run_ids[0] in body


def test_a_postgresql_store_is_refused_with_what_to_use(tmp_path: Path) -> None:
    done = subprocess.run(
        [CODECAGE, "audit", "web", "--store", "postgresql://nobody@127.0.0.1:1/none"],
        capture_output=True,
        text=True,
        env=server_env(),
        timeout=60,
    )
    assert done.returncode == 2 and "Grafana" in done.stderr
    assert os.environ.get("WEB_TOKEN") is None


def test_a_page_that_rebinds_its_name_to_loopback_cannot_read_the_view(store: Store) -> None:
    """DNS rebinding: the operator's browser, on a hostile page, asks 127.0.0.1 with the
    page's own name in Host. The view answers loopback names only, with a token or without."""
    with serving(store.db, "--insecure-no-token") as url:
        assert fetch(url + "/audit/recent_runs", Host="evil.example")[0] == 403
        assert fetch(url + "/audit/recent_runs", Host="localhost:8001")[0] == 200
    with serving(store.db) as url:
        assert fetch(url + "/audit/recent_runs", Host="evil.example", **BEARER)[0] == 403
        assert fetch(url + "/audit/recent_runs", Host="localhost:8001", **BEARER)[0] == 200
