"""The per-user local server of `codecage session`: with no --server given, the session
commands talk to a `codecage serve --http --uds` of this user's own, started on demand and
ended by itself when idle ([sessions] local_idle_exit), so sessions need nothing set up.

Everything lives in one private directory, `$XDG_RUNTIME_DIR/codecage`, or
`/tmp/codecage-UID` when XDG_RUNTIME_DIR is unset: mode 0700, owned by the user, else
refused (another user could otherwise put a socket of theirs there, or read the token):

- `server.sock`: the server's Unix socket;
- `token`: a random bearer token (0600), written by the command that starts the server and
  handed to it in its environment (never its argv, which every user can read). The directory
  alone keeps other users out; the token is a second lock, and lets the server use the same
  checks as any HTTP server (root can connect to any socket; it can read the token too:
  root is not a threat this keeps out);
- `lock`: flocked by a command while it checks for and starts a server, so two commands at
  once start one server;
- `server.log`: the server's stdout and stderr (what to read when it does not start);
- `server.pid`: its process id, for `codecage session stop-server`.

A server is there when its socket accepts a connection: a server that decides to exit
unlinks its socket first (mcp/http.py `IdleExit`), so a socket that refuses is stale (the
server was killed) and is replaced.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import signal
import socket
import stat
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import codecage.cli.handoff as handoff
from codecage import config
from codecage.errors import CodecageError, ConfigError
from codecage.fdio import locked

START_TIMEOUT_S = 120.0
"""How long a command waits for the server it started to listen (it builds the sandbox
runtime and its warm pool first; a loaded machine takes a while)."""
STOP_TIMEOUT_S = 60.0
"""How long `stop-server` waits for the server to end (it closes its sandboxes first)."""
SOCKET = handoff.SOCKET  # `codecage run` finds the server by them (cli/handoff.py)
TOKEN = handoff.TOKEN
LOCK = "lock"
LOG = "server.log"
PID = "server.pid"


@dataclass(frozen=True, slots=True)
class Local:
    """A running local server: its socket and the token it wants."""

    socket: Path
    token: str
    log: Path


def runtime_dir(environ: dict[str, str] | None = None) -> Path:
    """This user's private directory for the local server, made if missing.

    Raises:
        ConfigError: it is not a directory owned by this user with no group or other
            access (or cannot be made).
    """
    # /tmp is sticky: no one else can rename or replace a directory of ours there, and one
    # that is not ours (made first by someone else) is refused below.
    path = handoff.home_path(os.environ if environ is None else environ)
    uid = os.geteuid()
    try:
        path.mkdir(mode=0o700, exist_ok=True)
        info = path.lstat()
    except OSError as exc:
        raise ConfigError(
            f"cannot make the local server's directory {path}: {exc.strerror}",
            hint="set XDG_RUNTIME_DIR to a directory of yours, or pass --server URL",
        ) from exc
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != uid or info.st_mode & 0o077:
        raise ConfigError(
            f"refusing the local server's directory {path}: it must be a directory owned "
            f"by you (uid {uid}) with mode 0700 (it is uid {info.st_uid}, mode "
            f"{stat.filemode(info.st_mode)})",
            hint=f"remove it (or `chmod 700 {path}` if it is yours), or pass --server URL",
        )
    return path


def ensure(idle_exit: float | None = None) -> Local:
    """The local server, started when none answers. `idle_exit`: its seconds before it
    exits when idle (None: the config file's [sessions] local_idle_exit).

    Raises:
        ConfigError: the directory is not private, or the config file is invalid.
        CodecageError: the server did not start (its log says why).
    """
    home = runtime_dir()
    found = _found(home)
    if found is not None:
        return found
    with locked(home / LOCK):  # held at most for a start
        found = _found(home)  # another command may have started it while this one waited
        if found is not None:
            return found
        return _start(home, idle_exit)


def stop() -> bool:
    """End the local server and wait until it is gone; False when none was running.

    Raises:
        CodecageError: it did not end in time.
    """
    home = runtime_dir()
    with locked(home / LOCK):  # held at most for a start
        pid = _server_pid(home)
        if pid is None:
            with contextlib.suppress(FileNotFoundError):
                (home / SOCKET).unlink()  # stale, if there: nothing answers it
            return False
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while _alive(pid):
            if time.monotonic() > deadline:
                raise CodecageError(
                    f"the local codecage server (pid {pid}) did not end within "
                    f"{STOP_TIMEOUT_S:g} s",
                    hint=f"see its log, {home / LOG}; `kill -9 {pid}` ends it",
                )
            time.sleep(0.1)
        (home / PID).unlink(missing_ok=True)
        return True


def _found(home: Path) -> Local | None:
    """The server listening in `home`, if one is."""
    if not _answers(home / SOCKET):
        return None
    try:
        token = (home / TOKEN).read_text(encoding="ascii").strip()
    except OSError:
        return None
    return Local(home / SOCKET, token, home / LOG)


def _answers(path: Path) -> bool:
    """Whether a server accepts connections on the socket `path` (a socket nobody listens
    on refuses: its server was killed)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(5.0)
        try:
            sock.connect(str(path))
        except OSError:
            return False
    return True


def _start(home: Path, idle_exit: float | None) -> Local:
    """Start a server in `home` (the lock held) and wait until it listens."""
    if idle_exit is None:
        idle_exit = config.load().sessions.local_idle_exit
    sock, log_path = home / SOCKET, home / LOG
    with contextlib.suppress(FileNotFoundError):
        sock.unlink()  # stale: _found saw nothing accept on it
    token = secrets.token_urlsafe(32)
    _write_private(home / TOKEN, token)
    command = [
        sys.executable,
        "-m",
        "codecage.cli",
        "serve",
        "--http",
        "--uds",
        str(sock),
        "--idle-exit",
        f"{idle_exit:g}",
    ]
    env = {**os.environ, "CODECAGE_TOKEN": token}
    with open(log_path, "wb") as log:
        os.fchmod(log.fileno(), 0o600)
        process = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            cwd="/",  # holds no directory of the user's
            env=env,
            start_new_session=True,  # outlives this command, and its terminal's signals
        )
    _write_private(home / PID, str(process.pid))
    deadline = time.monotonic() + START_TIMEOUT_S
    while not _answers(sock):
        if process.poll() is not None:
            raise CodecageError(
                f"the local codecage server exited (status {process.returncode}) before it "
                f"listened: {_last_line(log_path)}",
                hint=f"its log is {log_path}; or pass --server URL to use a running one",
            )
        if time.monotonic() > deadline:
            raise CodecageError(
                f"the local codecage server did not listen within {START_TIMEOUT_S:g} s",
                hint=f"its log is {log_path}; `codecage session stop-server` ends it",
            )
        time.sleep(0.1)
    return Local(sock, token, log_path)


def _write_private(path: Path, text: str) -> None:
    """Write `text` to `path`, readable by this user only, replacing what was there."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w", encoding="ascii") as out:
        out.write(text)


def _last_line(log_path: Path) -> str:
    try:
        lines = log_path.read_text(encoding="utf-8", errors="replace").strip().splitlines()
    except OSError:
        return "(no log)"
    return lines[-1] if lines else "(its log is empty)"


def _server_pid(home: Path) -> int | None:
    """The pid in server.pid when that process is still the server of this directory (a
    pid can be reused: its command line must name this socket)."""
    try:
        pid = int((home / PID).read_text(encoding="ascii").strip())
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except (OSError, ValueError):
        return None
    if str(home / SOCKET).encode() not in cmdline or not _alive(pid):
        return None
    return pid


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, ended but not reaped by its new parent, does not)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text(encoding="ascii").rsplit(")", 1)[1]
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ESRCH):
            return False
        raise
    return fields.split()[0] != "Z"
