"""`codecage session` with no --server: the user's own local server (cli/local.py), started
on demand on a Unix socket in a private directory and ended when idle. Each command is a real
`codecage` process with nothing set up but a fresh XDG_RUNTIME_DIR (and a config file for
the idle time); every test stops the server it caused and checks that none is left."""

from __future__ import annotations

import os
import shutil
import socket
import stat
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from tests._cli import CODECAGE, codecage


@dataclass(frozen=True)
class Home:
    """A user's environment with nothing running: its runtime dir and its env."""

    runtime: Path
    env: dict[str, str]

    @property
    def dir(self) -> Path:
        return self.runtime / "codecage"

    @property
    def socket(self) -> Path:
        return self.dir / "server.sock"

    def session(self, *args: str) -> subprocess.CompletedProcess[str]:
        return codecage("session", *args, env=self.env, timeout=300)

    def servers(self) -> list[int]:
        """The pids of live server processes of this home (their command line names its
        socket), zombies left out."""
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                cmdline = (entry / "cmdline").read_bytes().split(b"\0")
                state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if str(self.socket).encode() in cmdline and state != "Z":
                found.append(int(entry.name))
        return found


def _home(idle_exit: float) -> Iterator[Home]:
    # Short: a Unix socket's path holds at most 107 bytes (pytest's tmp_path can be longer).
    runtime = Path(tempfile.mkdtemp(prefix="cc-rt-", dir="/tmp"))
    conf = runtime / "config.toml"
    conf.write_text(f"[sessions]\nlocal_idle_exit = {idle_exit}\n", encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if not k.startswith("CODECAGE_")}
    env |= {"XDG_RUNTIME_DIR": str(runtime), "CODECAGE_CONFIG": str(conf)}
    home = Home(runtime, env)
    try:
        yield home
    finally:
        home.session("stop-server")
        left = home.servers()
        shutil.rmtree(runtime, ignore_errors=True)
        assert left == [], f"server processes left behind: {left}"


@pytest.fixture
def home() -> Iterator[Home]:
    yield from _home(idle_exit=600)


@pytest.fixture
def quick_home() -> Iterator[Home]:
    yield from _home(idle_exit=2)


def test_three_commands_share_a_session_with_nothing_set_up(home: Home) -> None:
    done = home.session("open")
    assert done.returncode == 0, done.stderr
    sid = done.stdout.strip()
    done = home.session("run", sid, "--code", "x = 41")
    assert done.returncode == 0, done.stderr
    done = home.session("run", sid, "--code", "x + 1")
    assert done.returncode == 0, done.stderr
    assert "42" in done.stdout

    # Private: the directory is the user's alone, the token readable by the user only.
    assert stat.S_IMODE(home.dir.stat().st_mode) == 0o700
    assert stat.S_IMODE((home.dir / "token").stat().st_mode) == 0o600
    assert len(home.servers()) == 1

    done = home.session("stop-server")
    assert done.returncode == 0, done.stderr
    assert "has ended" in done.stderr
    assert home.servers() == []
    assert not home.socket.exists()


def test_two_opens_at_once_start_one_server(home: Home) -> None:
    opens = [
        subprocess.Popen(
            [CODECAGE, "session", "open"],
            env=home.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    ids = []
    for process in opens:
        out, err = process.communicate(timeout=300)
        assert process.returncode == 0, err
        ids.append(out.strip())
    assert len(home.servers()) == 1
    done = home.session("list")
    assert done.returncode == 0, done.stderr
    assert all(sid in done.stdout for sid in ids)  # both in the one server


def test_the_server_exits_when_idle_and_not_while_a_session_is_open(quick_home: Home) -> None:
    home = quick_home
    sid = home.session("open").stdout.strip()
    assert home.session("run", sid, "--code", "x = 1").returncode == 0
    (pid,) = home.servers()
    time.sleep(6)  # three times its idle time: an open session keeps it
    assert home.servers() == [pid]
    done = home.session("run", sid, "--code", "x + 1")
    assert done.returncode == 0, done.stderr
    assert "2" in done.stdout

    assert home.session("close", sid).returncode == 0
    deadline = time.monotonic() + 120  # bounded, not a timing assertion: it must end
    while home.servers() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert home.servers() == []
    assert not home.socket.exists()  # gone with it: the next command starts a new one
    assert "server.idle_exit" in (home.dir / "server.log").read_text()

    done = home.session("open")
    assert done.returncode == 0, done.stderr
    assert len(home.servers()) == 1


def test_a_stale_socket_is_replaced(home: Home) -> None:
    """A killed server leaves its socket file, which nothing listens on: made here by binding
    a socket and closing it (killing a real server with SIGKILL would leave its sandboxes
    behind), with a pid file naming a process that is no server."""
    home.dir.mkdir(mode=0o700)
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(home.socket))
    stale.close()
    (home.dir / "server.pid").write_text(str(os.getpid()))
    (home.dir / "token").write_text("old")
    assert home.socket.exists()

    done = home.session("open")
    assert done.returncode == 0, done.stderr
    sid = done.stdout.strip()
    assert home.session("run", sid, "--code", "y = 2").returncode == 0
    assert "4" in home.session("run", sid, "--code", "y * 2").stdout
    assert len(home.servers()) == 1


def test_a_directory_others_can_enter_is_refused(home: Home) -> None:
    home.dir.mkdir(mode=0o700)
    home.dir.chmod(0o750)
    done = home.session("list")
    assert done.returncode == 2  # a configuration error
    assert "refusing the local server's directory" in done.stderr
    assert "mode 0700" in done.stderr
    assert home.servers() == []


@pytest.mark.anyio
async def test_an_idle_server_refuses_what_comes_after_it_decides_to_exit(tmp_path: Path) -> None:
    """The server's idle check (mcp/http.py IdleExit) on a real ASGI app, called in process
    (what the subprocess tests cannot time: a request arriving as the server decides): never
    while a session is open or a request is in flight; once decided, every request gets a
    503 (which the CLI retries on a new server) and its socket is gone."""
    import anyio
    import httpx2

    from codecage.mcp.http import IdleExit

    sock = tmp_path / "s.sock"
    listening = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listening.bind(str(sock))
    open_sessions = [1]
    idle = IdleExit(0.05, lambda: open_sessions[0], sock)
    idle.bound()
    release = anyio.Event()

    async def app(scope: object, receive: object, send: object) -> None:
        assert callable(send)
        if scope["path"] == "/slow":  # type: ignore[index]
            await release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    transport = httpx2.ASGITransport(app=idle.gate(app))
    async with httpx2.AsyncClient(transport=transport, base_url="http://localhost:1") as client:
        assert (await client.get("/")).status_code == 200
        await anyio.sleep(0.2)
        assert not idle.due()  # a session is open
        open_sessions[0] = 0
        async with anyio.create_task_group() as group:
            group.start_soon(client.get, "/slow")
            await anyio.sleep(0.2)
            assert not idle.due()  # a request is in flight
            release.set()
        await anyio.sleep(0.2)
        assert idle.due()
        assert not sock.exists()
        refused = await client.get("/")
        assert refused.status_code == 503
        assert "exiting" in refused.text
    listening.close()
