"""Issue 36: `--allow-host 127.0.0.1:PORT` reaches a service on the host's loopback with
ordinary clients (urllib read NO_PROXY, which named 127.0.0.1, and connected to the
sandbox's own loopback: "Connection refused"); `localhost` is refused up front, saying what
to write. A real HTTP listener on the host's loopback, urllib in a real sandbox."""

from __future__ import annotations

import http.server
import secrets
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from tests._cli import codecage

from codecage import Sandbox
from codecage.errors import ConfigError

pytestmark = pytest.mark.timeout(180)

TOKEN = secrets.token_hex(16)


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = TOKEN.encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        return None


@pytest.fixture
def loopback() -> Iterator[int]:
    """A listener on the host's 127.0.0.1 that answers TOKEN; its port."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def _fetch(port: int) -> str:
    return (
        "import urllib.request\n"
        f"urllib.request.urlopen('http://127.0.0.1:{port}/', timeout=20).read().decode()\n"
    )


def test_the_cli_reaches_an_allowed_service_on_the_hosts_loopback(
    loopback: int, tmp_path: Path
) -> None:
    done = codecage(
        "run", "--json", "--allow-host", f"127.0.0.1:{loopback}", "--code", _fetch(loopback),
        cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert TOKEN in done.stdout


def test_the_library_reaches_it_and_another_port_stays_refused(loopback: int) -> None:
    with Sandbox(pool=False, allow_hosts=[f"127.0.0.1:{loopback}"]) as sandbox:
        allowed = sandbox.run(_fetch(loopback))
        other = sandbox.run(_fetch(loopback + 1 if loopback < 65535 else loopback - 1))
    assert allowed.status == "ok" and allowed.return_value == TOKEN, allowed.error
    assert other.status == "error" and TOKEN not in str(other.model_dump())


def test_the_loopback_is_not_reached_without_its_own_rule(loopback: int) -> None:
    with Sandbox(pool=False, allow_hosts=["example.com"]) as sandbox:
        result = sandbox.run(_fetch(loopback))
    assert result.status == "error" and TOKEN not in str(result.model_dump())


def test_localhost_is_refused_up_front_saying_what_to_write(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="localhost is its own loopback") as refused:
        Sandbox(pool=False, allow_hosts=["localhost:8000"])
    assert "allow 127.0.0.1:8000 in allow_hosts" in refused.value.hint_for("library")
    done = codecage("run", "--allow-host", "localhost:8000", "--code", "1", cwd=tmp_path)
    assert done.returncode == 2 and "allow 127.0.0.1:8000 in --allow-host" in done.stderr
