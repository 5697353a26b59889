"""Egress end to end: real sandboxes, the real host proxy, local HTTP servers on the host's
loopback whose names come from the config's test resolver table (there is no DNS here).

The servers listen on 127.0.0.1, a special address the proxy refuses for a name; the runs
that should reach them allow that IP literal with its port too (docs/configuration.md)."""

from __future__ import annotations

import base64
import contextlib
import functools
import hashlib
import http.server
import json
import os
import socket
import ssl
import threading
import time
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from tests._certs import self_signed
from tests._forking import in_forked_child
from tests._runsc import needs_runsc
from tests._web import QuietHandler, serving_http_on_loopback, start_http

from codecage import ExecutionResult, Options, Sandbox
from codecage.engine import workspace as workspaces
from codecage.errors import ConfigError
from containment._support import held_run


class _Handler(QuietHandler):
    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if self.path.startswith("/redirect"):
            self.send_response(302)
            self.send_header("Location", self.server.redirect_to)  # type: ignore[attr-defined]
            self.end_headers()
            return
        body = json.dumps(
            {"path": self.path, "host": self.headers.get("Host"), "server": self.server.name}  # type: ignore[attr-defined]
        ).encode()
        self.reply(body, "application/json")


@dataclass
class _Server:
    name: str
    port: int
    httpd: http.server.ThreadingHTTPServer


def _serve(name: str) -> _Server:
    httpd = start_http(_Handler)
    httpd.name = name  # type: ignore[attr-defined]
    httpd.redirect_to = ""  # type: ignore[attr-defined]
    return _Server(name, httpd.server_address[1], httpd)


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, _Server]]:
    made = {name: _serve(name) for name in ("api", "other")}
    yield made
    for s in made.values():
        s.httpd.shutdown()
        s.httpd.server_close()


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("egress") / "config.toml"
    path.write_text(
        "[network.resolve]\n"
        '"api.test" = ["127.0.0.1"]\n'
        '"other.test" = ["127.0.0.1"]\n'
        '"metadata.test" = ["169.254.169.254"]\n'
        '"private.test" = ["10.1.2.3"]\n'
        "[network.limits]\n"
        "connect_timeout = 2\n"
    )
    return path


_MADE: list[Sandbox] = []


@pytest.fixture(autouse=True, scope="module")
def _closed_after() -> Iterator[None]:
    """Each Sandbox's proxy (a loop thread, its sockets) goes with its close()."""
    yield
    while _MADE:
        _MADE.pop().close()


def _allowing(config: Path, *hosts: str) -> Sandbox:
    sandbox = Sandbox(
        config=config, allow_hosts=list(hosts), options=Options(import_policy=False, scrub=False)
    )
    _MADE.append(sandbox)
    return sandbox


def _get(url: str) -> str:
    return (
        "import urllib.request, urllib.error\n"
        "try:\n"
        f"    print(urllib.request.urlopen({url!r}, timeout=10).read().decode())\n"
        "except urllib.error.HTTPError as e:\n"
        "    print('HTTP', e.code, e.read().decode()[:200])\n"
        "except Exception as e:\n"
        "    print('FAILED', type(e).__name__, e)\n"
    )


def _kinds(result: ExecutionResult, kind: str) -> list[dict[str, Any]]:
    return [e.data or {} for e in result.events if e.kind == kind]


def test_an_allowed_host_is_reached_by_name_through_the_proxy(
    config: Path, servers: dict[str, _Server]
) -> None:
    api = servers["api"]
    sandbox = _allowing(config, f"api.test:{api.port}", f"127.0.0.1:{api.port}")
    r = sandbox.run(_get(f"http://api.test:{api.port}/hello"))
    assert r.status == "ok", r.stderr
    answer = json.loads(r.stdout)
    assert answer == {"path": "/hello", "host": f"api.test:{api.port}", "server": "api"}
    (allowed,) = _kinds(r, "network_allowed")
    assert (allowed["host"], allowed["port"], allowed["address"]) == (
        "api.test",
        api.port,
        "127.0.0.1",
    )
    assert allowed["bytes_in"] > 0


def test_without_allowed_hosts_a_run_has_no_network_and_no_proxy(
    config: Path, servers: dict[str, _Server]
) -> None:
    api = servers["api"]
    r = Sandbox(config=config, options=Options(import_policy=False)).run(
        "import os\nprint(sorted(k for k in os.environ if 'PROXY' in k.upper()))\n"
        + _get(f"http://127.0.0.1:{api.port}/")
    )
    assert r.status == "ok", r.stderr
    first, second = r.stdout.splitlines()[:2]
    assert first == "[]"
    assert second.startswith("FAILED"), second


def test_a_host_not_allowed_is_refused_with_a_reason(
    config: Path, servers: dict[str, _Server]
) -> None:
    api, other = servers["api"], servers["other"]
    sandbox = _allowing(config, f"api.test:{api.port}", f"127.0.0.1:{api.port}")
    r = sandbox.run(_get(f"http://other.test:{other.port}/"))
    assert r.stdout.startswith("HTTP 403"), r.stdout
    (denied,) = _kinds(r, "network_denied")
    assert denied["host"] == "other.test"
    assert "not in this run's allowed hosts" in denied["reason"]


@pytest.mark.parametrize("name", ["metadata.test", "private.test"])
def test_an_allowed_name_that_resolves_to_a_special_address_is_refused(
    config: Path, name: str
) -> None:
    r = _allowing(config, f"{name}:80").run(_get(f"http://{name}/latest/meta-data/"))
    assert r.stdout.startswith("HTTP 403"), r.stdout
    (denied,) = _kinds(r, "network_denied")
    assert "resolved to" in denied["reason"]


def test_a_redirect_to_a_host_not_allowed_is_refused(
    config: Path, servers: dict[str, _Server]
) -> None:
    api, other = servers["api"], servers["other"]
    api.httpd.redirect_to = f"http://other.test:{other.port}/stolen"  # type: ignore[attr-defined]
    sandbox = _allowing(config, f"api.test:{api.port}", f"127.0.0.1:{api.port}")
    r = sandbox.run(_get(f"http://api.test:{api.port}/redirect"))
    assert r.stdout.startswith("HTTP 403"), r.stdout
    assert [d["host"] for d in _kinds(r, "network_allowed")] == ["api.test"]
    assert [d["host"] for d in _kinds(r, "network_denied")] == ["other.test"]


def test_nothing_leaves_but_through_the_proxy(config: Path, servers: dict[str, _Server]) -> None:
    """Allowed hosts or not, a direct connection, UDP and name resolution inside reach
    nothing: the sandbox's namespace has only its loopback."""
    api = servers["api"]
    code = (
        "import socket\n"
        "def attempt(f):\n"
        "    try:\n"
        "        f(); return 'reached'\n"
        "    except OSError as e:\n"
        "        return type(e).__name__\n"
        f"print(attempt(lambda: socket.create_connection(('127.0.0.1', {api.port}), timeout=3)))\n"
        "print(attempt(lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM)"
        ".sendto(b'x', ('8.8.8.8', 53))))\n"
        "print(attempt(lambda: socket.getaddrinfo('api.test', 80)))\n"
        "print(attempt(lambda: socket.socket(socket.AF_PACKET, socket.SOCK_RAW)))\n"
    )
    r = _allowing(config, f"api.test:{api.port}", f"127.0.0.1:{api.port}").run(code)
    assert r.status == "ok", r.stderr
    assert "reached" not in r.stdout.split(), r.stdout


def test_concurrent_runs_with_different_hosts_cannot_use_each_others(
    config: Path, servers: dict[str, _Server]
) -> None:
    api, other = servers["api"], servers["other"]
    to_api = _allowing(config, f"api.test:{api.port}", f"127.0.0.1:{api.port}")
    to_other = _allowing(config, f"other.test:{other.port}", f"127.0.0.1:{other.port}")
    code = (
        "import time\n"
        "time.sleep(0.5)\n"
        + _get(f"http://api.test:{api.port}/a")
        + _get(f"http://other.test:{other.port}/b")
    )
    results: dict[str, ExecutionResult] = {}
    threads = [
        threading.Thread(target=lambda n=n, s=s: results.__setitem__(n, s.run(code)))
        for n, s in (("api", to_api), ("other", to_other))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    api_lines = [line for line in results["api"].stdout.splitlines() if line]
    other_lines = [line for line in results["other"].stdout.splitlines() if line]
    assert json.loads(api_lines[0])["server"] == "api"
    assert api_lines[1].startswith("HTTP 403")
    assert other_lines[0].startswith("HTTP 403")
    assert json.loads(other_lines[1])["server"] == "other"


# --- credentials at the edge ----------------------------------------------------------------

_SECRET = "cc-test-secret-7f3a9b2e51d04c6e"  # noqa: S105 - the test's own value


class _EchoHandler(QuietHandler):
    """Answers with the Authorization header it got, and the secret itself in the body (a
    server that echoes a credential: the proxy must scrub it before the sandbox sees it)."""

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self.server.seen.append(self.headers.get("Authorization"))  # type: ignore[attr-defined]
        body = json.dumps(
            {"authorization": self.headers.get("Authorization"), "echo": _SECRET}
        ).encode()
        self.reply(body, "application/json")


@pytest.fixture(scope="module")
def secure(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, Path, list[str]]]:
    directory = tmp_path_factory.mktemp("secure")
    cert, key = self_signed("secure.test")
    (directory / "cert.pem").write_bytes(cert)
    (directory / "key.pem").write_bytes(key)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(directory / "cert.pem", directory / "key.pem")
    with serving_http_on_loopback(_EchoHandler, context) as httpd:
        httpd.seen = []  # type: ignore[attr-defined]
        yield httpd.server_address[1], directory, httpd.seen  # type: ignore[attr-defined]


def test_a_credential_is_added_at_the_edge_and_never_visible_inside(
    secure: tuple[int, Path, list[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    port, directory, seen = secure
    monkeypatch.setenv("CODECAGE_TEST_TOKEN", _SECRET)
    config = directory / "config.toml"
    config.write_text(
        "[network]\n"
        f'upstream_ca_file = "{directory / "cert.pem"}"\n'
        f'ca_dir = "{directory / "ca"}"\n'
        "[network.resolve]\n"
        '"secure.test" = ["127.0.0.1"]\n'
        f'[network.credentials."secure.test:{port}"]\n'
        'header = "Authorization"\n'
        'env = "CODECAGE_TEST_TOKEN"\n'
        'format = "Bearer {}"\n'
    )
    code = (
        "import json, os, pathlib, urllib.request\n"
        "names = [k for k in os.environ if k.startswith('CODECAGE_CREDENTIAL_')]\n"
        "req = urllib.request.Request(\n"
        f"    'https://secure.test:{port}/data',\n"
        "    headers={'Authorization': 'Bearer ' + os.environ[names[0]]},\n"
        ")\n"
        "print(urllib.request.urlopen(req, timeout=10).read().decode())\n"
        "seen = pathlib.Path('/proc/self/environ').read_bytes().decode(errors='replace')\n"
        "for root in ('/run/codecage', '/etc', '/workspace', '/tmp'):\n"
        "    for p in pathlib.Path(root).rglob('*'):\n"
        "        if p.is_file():\n"
        "            try:\n"
        "                seen += p.read_text(errors='replace')\n"
        "            except OSError:\n"
        "                pass\n"
        "print('INSIDE', len(names), " + repr(_SECRET) + " in seen)\n"
    )
    sandbox = _allowing(config, f"secure.test:{port}", f"127.0.0.1:{port}")
    r = sandbox.run(code)
    assert r.status == "ok", r.stderr
    answer = json.loads(r.stdout.splitlines()[0])
    assert answer == {"authorization": "Bearer [CREDENTIAL]", "echo": "[CREDENTIAL]"}
    assert r.stdout.splitlines()[1] == "INSIDE 1 False"
    assert seen[-1] == f"Bearer {_SECRET}"  # the server got the real value
    assert _SECRET not in r.model_dump_json()


# --- backends -------------------------------------------------------------------------------


@needs_runsc
def test_egress_works_the_same_under_gvisor(config: Path, servers: dict[str, _Server]) -> None:
    api, other = servers["api"], servers["other"]
    hosts = [f"api.test:{api.port}", f"127.0.0.1:{api.port}"]
    with Sandbox(
        config=config, backend="gvisor", allow_hosts=hosts, options=Options(import_policy=False)
    ) as sb:
        r = sb.run(_get(f"http://api.test:{api.port}/g") + _get(f"http://other.test:{other.port}/"))
    assert r.backend == "gvisor"
    lines = [line for line in r.stdout.splitlines() if line]
    assert json.loads(lines[0])["server"] == "api", r.stdout + r.stderr
    assert lines[1].startswith("HTTP 403")


def test_the_landlock_fallback_refuses_egress_with_what_to_use(config: Path) -> None:
    with (
        Sandbox(
            config=config,
            backend="landlock",
            allow_hosts=["api.test"],
            options=Options(import_policy=False),
        ) as sb,
        pytest.raises(ConfigError, match="own network namespace") as refused,
    ):
        sb.run("1")
    assert "bwrap or gvisor" in (refused.value.hint or "")


# --- pip through the proxy ------------------------------------------------------------------


def _wheel(directory: Path) -> Path:
    """A one-module wheel, cc_hello 1.0, made by hand (no build tool needed)."""
    name, dist = "cc_hello", "cc_hello-1.0.dist-info"
    files = {
        f"{name}/__init__.py": b"GREETING = 'hello from the local index'\n",
        f"{dist}/METADATA": b"Metadata-Version: 2.1\nName: cc-hello\nVersion: 1.0\n",
        f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: hand\nRoot-Is-Purelib: true\n"
        b"Tag: py3-none-any\n",
    }
    record = [f"{path},sha256={_b64_digest(data)},{len(data)}" for path, data in files.items()] + [
        f"{dist}/RECORD,,"
    ]
    files[f"{dist}/RECORD"] = ("\n".join(record) + "\n").encode()
    path = directory / "cc_hello-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as whl:
        for member, data in files.items():
            whl.writestr(member, data)
    return path


def _b64_digest(data: bytes) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


@pytest.fixture(scope="module")
def package_index(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """A PEP 503 simple index serving the one wheel."""
    directory = tmp_path_factory.mktemp("index")
    wheel = _wheel(directory)
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    (directory / "simple" / "cc-hello").mkdir(parents=True)
    (directory / "simple" / "cc-hello" / "index.html").write_text(
        f'<a href="/{wheel.name}#sha256={digest}">{wheel.name}</a>\n'
    )
    handler = functools.partial(_QuietFiles, directory=str(directory))
    with serving_http_on_loopback(handler) as httpd:
        yield httpd.server_address[1]


class _QuietFiles(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args: Any) -> None:  # the test's output stays the test's
        pass


def test_pip_installs_from_an_allowed_index_into_the_run_s_own_place(
    package_index: int, tmp_path: Path
) -> None:
    config = tmp_path / "config.toml"
    config.write_text(
        "[network]\n"
        f'pip_index_url = "http://pypi.test:{package_index}/simple"\n'
        "[network.resolve]\n"
        '"pypi.test" = ["127.0.0.1"]\n'
    )
    code = (
        "import subprocess, sys\n"
        "done = subprocess.run([sys.executable, '-m', 'pip', 'install', '--no-deps',\n"
        "    '--target', '/workspace/pkgs', '--trusted-host', 'pypi.test', 'cc-hello'],\n"
        "    capture_output=True, text=True)\n"
        "print('pip exit', done.returncode, done.stderr[-1500:])\n"
        "sys.path.insert(0, '/workspace/pkgs')\n"
        "import cc_hello\n"
        "print(cc_hello.GREETING)\n"
    )
    hosts = [f"pypi.test:{package_index}", f"127.0.0.1:{package_index}"]
    with Sandbox(config=config, allow_hosts=hosts, options=Options(import_policy=False)) as sb:
        r = sb.run(code, limits={"timeout": 120})
    assert r.status == "ok", r.stdout + r.stderr
    assert r.stdout.splitlines()[0].startswith("pip exit 0"), r.stdout
    assert r.stdout.splitlines()[-1] == "hello from the local index"
    assert {"pypi.test"} == {d["host"] for d in _kinds(r, "network_allowed")}


def test_a_forked_child_gets_a_proxy_of_its_own(config: Path, servers: dict[str, _Server]) -> None:
    """The parent's proxy thread is not in a forked child (a pre-forking server): its runs
    must neither hang on it nor close it."""
    api = servers["api"]
    sandbox = _allowing(config, f"api.test:{api.port}", f"127.0.0.1:{api.port}")
    assert json.loads(sandbox.run(_get(f"http://api.test:{api.port}/p")).stdout)["path"] == "/p"

    def child_run() -> bytes:
        return sandbox.run(_get(f"http://api.test:{api.port}/c")).stdout.encode()

    answer = in_forked_child(child_run, timeout=60)
    assert answer is not None, "the child's run hung"
    assert json.loads(answer)["path"] == "/c"
    assert json.loads(sandbox.run(_get(f"http://api.test:{api.port}/q")).stdout)["path"] == "/q"


def test_a_session_s_runs_reach_its_hosts_and_keep_state(
    config: Path, servers: dict[str, _Server], tmp_path: Path
) -> None:
    api, other = servers["api"], servers["other"]
    hosts = [f"api.test:{api.port}", f"127.0.0.1:{api.port}"]
    with_ceiling = tmp_path / "config.toml"
    with_ceiling.write_text(f"[network]\nceiling = {json.dumps(hosts)}\n" + config.read_text())
    sandbox = _allowing(with_ceiling)
    with sandbox.session(allow_hosts=hosts) as session:
        first = session.run("import urllib.request\n" + _get(f"http://api.test:{api.port}/1"))
        second = session.run(_get(f"http://api.test:{api.port}/2"))
        third = session.run(_get(f"http://other.test:{other.port}/3"))
    assert json.loads(first.stdout)["path"] == "/1", first.stderr
    assert json.loads(second.stdout)["path"] == "/2", second.stderr
    assert third.stdout.startswith("HTTP 403"), third.stdout
    assert [d["host"] for d in _kinds(second, "network_allowed")] == ["api.test"]
    assert [d["host"] for d in _kinds(third, "network_denied")] == ["other.test"]
    outside = sandbox.session  # asking for more than the ceiling is an error, not a clamp
    with pytest.raises(ConfigError, match="outside"):
        outside(allow_hosts=[f"other.test:{other.port}"])


def test_a_warm_pool_keeps_egress_sandboxes_for_a_sandbox_allowed_hosts(
    config: Path, servers: dict[str, _Server]
) -> None:
    api = servers["api"]
    hosts = [f"api.test:{api.port}", f"127.0.0.1:{api.port}"]
    with Sandbox(
        config=config, allow_hosts=hosts, pool=True, options=Options(import_policy=False)
    ) as sb:
        assert sb.warm(60)
        r = sb.run(_get(f"http://api.test:{api.port}/warm"))
        pool = sb.info().pool
    assert json.loads(r.stdout)["path"] == "/warm", r.stderr
    assert [d["host"] for d in _kinds(r, "network_allowed")] == ["api.test"]
    assert pool is not None
    assert sum(key.hits for key in pool.keys) == 1, pool


@pytest.mark.skipif(os.geteuid() != 0, reason="switching to another user needs root")
def test_another_local_user_cannot_use_a_run_s_proxy_socket(
    config: Path, servers: dict[str, _Server], tmp_path: Path
) -> None:
    """The socket is the run's identity: only the sandbox's own host id may connect."""
    api = servers["api"]
    sandbox = _allowing(config, f"api.test:{api.port}", f"127.0.0.1:{api.port}")
    started = threading.Event()
    thread = threading.Thread(
        target=lambda: (started.set(), sandbox.run("import time\ntime.sleep(3)")), daemon=True
    )
    thread.start()
    started.wait()
    own = f"codecage-run-{os.getpid()}-"
    deadline = time.monotonic() + 10
    sockets: list[Path] = []
    while not sockets and time.monotonic() < deadline:
        sockets = list(workspaces.private_parent().glob(f"{own}*/egress/egress.sock"))
        time.sleep(0.05)
    assert sockets, "no egress socket appeared for the run"
    pid = os.fork()
    if pid == 0:  # another user (nobody) tries the socket
        code = 3
        try:
            os.setgid(65534)
            os.setuid(65534)
            with socket.socket(socket.AF_UNIX) as sock:
                sock.connect(str(sockets[0]))
            code = 0
        except PermissionError:
            code = 1
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    thread.join(30)
    assert os.waitstatus_to_exitcode(status) == 1, "another user could connect"


# --- fair shares on the proxy (issue 33, item 5) ---------------------------------------

_CHURN = """
import os, socket, time
port = int(os.environ["HTTP_PROXY"].rsplit(":", 1)[1])
held, opened, end = [], 0, time.monotonic() + 25
while time.monotonic() < end:
    try:
        held.append(socket.create_connection(("127.0.0.1", port), timeout=2))
        opened += 1
    except OSError:
        time.sleep(0.01)
    if len(held) > 60:  # idle connections, never a byte sent, renewed all the time
        held.pop(0).close()
print("opened", opened)
"""


def test_a_run_flooding_the_proxy_with_idle_connections_cannot_fail_another_runs_request(
    tmp_path: Path, servers: dict[str, _Server], caplog: pytest.LogCaptureFixture
) -> None:
    """A proxy of 8 connections, 2 per run: a real run keeps opening idle connections
    through its relay for 25 s; once the proxy holds its share, a second run on the same
    host makes a request."""
    api = servers["api"]
    config = tmp_path / "config.toml"
    config.write_text(
        '[network]\nmax_connections = 8\n[network.resolve]\n"api.test" = ["127.0.0.1"]\n'
        "[network.limits]\nmax_connections = 2\n"
    )
    sandbox = _allowing(config, f"api.test:{api.port}", f"127.0.0.1:{api.port}")
    flood: list[ExecutionResult] = []
    flooder = threading.Thread(
        target=lambda: flood.append(sandbox.run(_CHURN, limits={"timeout": 60}))
    )
    flooder.start()
    try:
        proxy = sandbox.host._egress_setup().proxy
        deadline = time.monotonic() + 60  # the flood has begun: the run holds its share
        while proxy.open_connections < 2 and time.monotonic() < deadline and not flood:
            time.sleep(0.05)
        served = sandbox.run(_get(f"http://api.test:{api.port}/fair"), limits={"timeout": 60})
    finally:
        flooder.join(120)
    assert served.status == "ok", served.stderr
    assert served.stdout.startswith("{"), served.stdout  # not "HTTP 503 ..."
    assert json.loads(served.stdout)["path"] == "/fair"
    (flooded,) = flood
    assert flooded.status == "ok", flooded.stderr
    (used,) = _kinds(flooded, "network_usage")
    assert used["refused_at_accept"] > 0 and used["connections"] > 0, (flooded.stdout, used)
    assert not [r for r in caplog.records if r.exc_info and "egress" in r.name]


# --- one run's socket is its own: another run (another host id) cannot use its grant --------


@pytest.mark.skipif(os.geteuid() != 0, reason="as an ordinary user every run is the caller")
def test_a_run_of_another_id_cannot_use_a_runs_egress_socket(
    config: Path, servers: dict[str, _Server]
) -> None:
    """Run A (bwrap) is allowed api.test and holds; run B, on the Landlock fallback with no
    network (it sees the host's paths), connects to A's socket by its host path and asks
    for api.test. A's socket is A's host id's alone: B is refused, and the server is never
    reached through it."""
    api = servers["api"]
    a_sandbox = _allowing(config, f"api.test:{api.port}", f"127.0.0.1:{api.port}")
    b_sandbox = Sandbox(
        config=config, backend="landlock", options=Options(import_policy=False, scrub=False)
    )
    _MADE.append(b_sandbox)
    token = "eg" + hashlib.sha256(os.urandom(8)).hexdigest()[:12]
    code_a = (
        "import ctypes, time\n"
        f"ctypes.CDLL(None).prctl(15, {token!r}.encode(), 0, 0, 0)\n"
        "print('READY', flush=True)\n"
        "while True:\n"
        "    time.sleep(1)\n"
    )
    with held_run(a_sandbox, code_a) as a:
        socket_path = _run_dir_of(token) / "egress" / "egress.sock"
        assert socket_path.exists(), socket_path
        code_b = (
            "import socket\n"
            "s = socket.socket(socket.AF_UNIX)\n"
            "s.settimeout(20)\n"
            "try:\n"
            f"    s.connect({str(socket_path)!r})\n"
            f"    s.sendall(b'GET http://api.test:{api.port}/stolen HTTP/1.1\\r\\n'\n"
            "              b'Host: x\\r\\n\\r\\n')\n"
            "    print('GOT', s.recv(4096).decode(errors='replace'))\n"
            "except OSError as e:\n"
            "    print('REFUSED', type(e).__name__, e.errno)\n"
        )
        b = b_sandbox.run(code_b, limits={"timeout": 60})
        assert b.status == "ok", b.stderr
        assert '"server": "api"' not in b.stdout, b.stdout
        assert b.stdout.startswith("REFUSED") or "403" in b.stdout, b.stdout
        assert a.thread.is_alive(), "run A ended before run B: they did not overlap"
    assert not [e for e in a.release().events if e.kind == "network_allowed"], "A's grant was used"


def _run_dir_of(token: str) -> Path:
    """The host run directory of the sandbox whose guest is named `token`: the parent of
    the mount point of its workspace (a tmpfs of its own)."""
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError):
            if entry.name.isdigit() and (entry / "comm").read_text().strip() == token:
                st = os.stat(entry / "cwd")
                device = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
                for line in Path("/proc/self/mountinfo").read_text().splitlines():
                    fields = line.split()
                    if fields[2] == device and fields[3] == "/":
                        return Path(fields[4]).parent
    raise AssertionError(f"no run named {token} was found on the host")
