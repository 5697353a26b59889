"""`codecage run` handed to the user's local server when one is running: the standard
library only, called by `codecage.cli.main` before typer, pydantic, rich or codecage's
models are imported (they take ~390 ms; a whole `codecage run` in-process cannot go below
~600 ms, docs/performance.md).

When the command is `run` with only flags understood here (`FLAGS`, `LIMIT_FLAGS`) and the
per-user local server of cli/local.py is listening, the run is one request on its Unix
socket (POST `PATH`, HTTP/1.1 written by hand: `http.client` alone costs more than the
rest) and the server's warm pool runs it as the CLI's face. The server prints the result
with the CLI's own functions (render.py, run.py `show_run`) into streams that record
each write, and sends the writes back as they happen, one JSON line each
(cli/handoff_endpoint.py); this process writes them to its own stdout and stderr and
exits with the code the server sends. So the output is the in-process run's by
construction: the same functions print it, for a terminal described as this one is
(whether each stream is a TTY, its encoding, size and the variables rich reads).

The hand-off happens only when the result would be the in-process run's. The request
carries the `fingerprint` of what this process would resolve (its user, codecage's
version and files, the interpreter, the `CODECAGE_*` and other variables the
configuration reads, the config file found and its bytes, the added packages' record); the
server compares it with its own, computed the same way at its start, and declines a
mismatch. On anything else this module declines too, silently, and the command runs
in-process: an unknown flag, a lent directory (--workspace, --out, --in), code on stdin, a
missing or stale socket, a directory that is not this user's with mode 0700, a socket or
token not this user's, a refusal by the server, any error before the first write. Only
after the server has started writing does a failure end the command (the code has run,
and must not run twice): then `codecage: ...` on stderr and exit 1.

`CODECAGE_HANDOFF=0` turns the hand-off off; `CODECAGE_HANDOFF=debug` says on stderr
whether a run was handed off, and why not.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import re
import socket
import stat
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from codecage import configsearch
from codecage._version import __version__

PATH = "/cli/run"
"""The server's endpoint (cli/handoff_endpoint.py)."""
PROTOCOL = 1
SOCKET = "server.sock"
TOKEN = "token"  # noqa: S105 (a file name)
ENV_SWITCH = "CODECAGE_HANDOFF"
"""0: never hand off; debug: say on stderr whether, and why not; else: when possible."""

CODE_FLAGS = {"--code": "code", "-c": "code", "--file": "file", "-f": "file"}
VALUE_FLAGS = {**CODE_FLAGS, "--profile": "profile"}
BOOL_FLAGS = {"--json": "as_json", "--raw": "raw", "--strict": "strict"}
LIMIT_FLAGS: dict[str, tuple[str, type[int] | type[float]]] = {
    "--timeout": ("timeout", float),
    "--cpu-seconds": ("cpu_seconds", int),
    "--memory-mb": ("memory_mb", int),
    "--max-processes": ("max_processes", int),
    "--max-open-files": ("max_open_files", int),
    "--max-file-size-mb": ("max_file_size_mb", int),
    "--workspace-mb": ("workspace_mb", int),
    "--tmp-mb": ("tmp_mb", int),
    "--max-output-bytes": ("max_output_bytes", int),
}
"""`run`'s limit flags (options.LimitFlags, a test holds them equal) and their types as
click converts them."""

RICH_ENV = (
    "TERM",
    "COLORTERM",
    "NO_COLOR",
    "FORCE_COLOR",
    "TTY_COMPATIBLE",
    "TTY_INTERACTIVE",
    "COLUMNS",
    "LINES",
    "JUPYTER_COLUMNS",
    "JUPYTER_LINES",
)
"""The variables rich reads to decide colours and size: the server's console reads the
client's."""

_FINGERPRINT_ENV = (
    "HOME",
    "PATH",
    "TMPDIR",
    "USER",
    "LOGNAME",
    "LANG",
    "LC_ALL",
    "LC_CTYPE",
    "VIRTUAL_ENV",
    "XDG_CONFIG_HOME",
    "XDG_DATA_HOME",
    "XDG_STATE_HOME",
    "XDG_CACHE_HOME",
    "XDG_RUNTIME_DIR",
)
"""Variables besides `CODECAGE_*` and `PYTHON*` that decide what a run resolves: where
the config, the state (the audit store), the packages and the cache are; which bwrap and
runsc are found; the login name on the audit record."""
_NOT_FINGERPRINTED = frozenset({"CODECAGE_TOKEN", "CODECAGE_SERVER", ENV_SWITCH})
"""The local server's token is in its environment, not the client's; the session
commands' server and this switch change nothing a run resolves."""
_RUN_ONLY_ENV = ("CODECAGE_BACKEND", "CODECAGE_ALLOW_DEGRADED")
"""`run`'s flags --backend and --allow-degraded read these; `serve` has neither flag."""
_PACKAGES_RECORDS = (
    Path("/var/lib/codecage/packages/packages.lock.json"),  # packages.SYSTEM_DIR
)
_MAX_CONFIG_BYTES = 4 * 1024 * 1024 + 1  # config._MAX_BYTES, and one over: a bigger file differs
_MAX_TOKEN_BYTES = 4096
_MAX_LINE_BYTES = 64 * 1024 * 1024  # one write of the run's output, base64 and JSON
_CONNECT_TIMEOUT_S = 2.0
_ANSWER_TIMEOUT_S = 10.0
"""How long the server has to answer the request's headers (it answers before it runs)."""


_INT = re.compile(r"[0-9]{1,18}", re.ASCII)
_FLOAT = re.compile(r"[0-9]{1,18}(\.[0-9]{0,18})?", re.ASCII)


class Declined(Exception):
    """Not handed off: the command runs in-process. The text says why (for debug)."""


class Broken(Exception):
    """The server stopped answering after it had started writing the run's output."""


class Job(NamedTuple):
    """What the command line asks for, as far as the hand-off understands it. (A named
    tuple: `dataclasses` imports `inspect`, ~15 ms of this path's ~50.)"""

    code: str | None
    file: str | None
    profile: str | None
    as_json: bool
    raw: bool
    strict: bool
    limits: dict[str, int | float]


def run_if_served(args: Sequence[str]) -> None:
    """Hand `codecage ARGS` to the local server and exit with the run's code, when it is
    a `run` the server can take; otherwise return (nothing printed unless debug)."""
    switch = os.environ.get(ENV_SWITCH, "")
    if switch == "0" or not args or args[0] != "run":
        return
    try:
        job = parse(args[1:])
        path, token = _server(os.environ)  # first: without a server nothing else is done
        code = exchange(path, token, request_body(job, os.environ))
    except Declined as why:
        if switch == "debug":
            sys.stderr.write(f"codecage: run in-process: {why}\n")
        return
    except Broken as why:
        sys.stderr.write(f"codecage: {why}\n")
        code = 1
    except KeyboardInterrupt:
        # As click ends a command on Ctrl-C; the server kills the run when the socket closes.
        sys.stderr.write("Aborted.\n")
        code = 1
    if switch == "debug":
        sys.stderr.write("codecage: handed off to the local server\n")
    sys.stdout.flush()
    raise SystemExit(code)


def parse(args: Sequence[str]) -> Job:
    """The `run` options in `args`, when all are understood here.

    Raises:
        Declined: anything else (an argument, an unknown or repeated flag, a bad value).
    """
    values: dict[str, str] = {}
    flags: set[str] = set()
    rest = list(args)
    while rest:
        arg = rest.pop(0)
        name, eq, attached = arg.partition("=") if arg.startswith("--") else (arg, "", "")
        if name in BOOL_FLAGS and not eq:
            if BOOL_FLAGS[name] in flags:
                raise Declined(f"{name} given twice")
            flags.add(BOOL_FLAGS[name])
        elif name in VALUE_FLAGS or name in LIMIT_FLAGS:
            if not eq and not rest:
                raise Declined(f"{name} without a value")
            key = VALUE_FLAGS[name] if name in VALUE_FLAGS else LIMIT_FLAGS[name][0]
            if key in values:
                raise Declined(f"{name} given twice")
            values[key] = attached if eq else rest.pop(0)
        else:
            raise Declined(f"the option or argument {arg[:40]!r} is not handed off")
    return Job(
        code=values.pop("code", None),
        file=values.pop("file", None),
        profile=values.pop("profile", None),
        as_json="as_json" in flags,
        raw="raw" in flags,
        strict="strict" in flags,
        limits=_limits(values),
    )


def _limits(values: Mapping[str, str]) -> dict[str, int | float]:
    """The limit flags' values, when each is plainly a number (ASCII digits: `run`'s
    parser accepts some other spellings, and refuses others Python's int() and float()
    take, such as other scripts' digits; any of those runs in-process)."""
    types = dict(LIMIT_FLAGS.values())
    limits: dict[str, int | float] = {}
    for name, text in values.items():
        number = types[name]
        if not (_INT if number is int else _FLOAT).fullmatch(text):
            raise Declined(f"{name}={text[:40]!r} is not plainly a number")
        limits[name] = number(text)
    return limits


def request_body(job: Job, environ: Mapping[str, str]) -> bytes:
    """The request: the code (a --file read here, as `run` reads it), the options, the
    fingerprint and this terminal.

    Raises:
        Declined: not exactly one of --code and --file, or the file is unreadable or not
            UTF-8 (`run` says so in-process).
    """
    if (job.code is None) == (job.file is None):
        raise Declined("not exactly one of --code and --file")
    for name in _RUN_ONLY_ENV:
        if name in environ and not (name == "CODECAGE_BACKEND" and environ[name] == "auto"):
            raise Declined(f"{name} is set: `run` reads it, the server does not")
    code, filename = job.code, "main.py"
    if job.file is not None:
        try:
            code = Path(job.file).read_bytes().decode("utf-8")
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            raise Declined(f"cannot read --file: {exc}") from exc
        filename = Path(job.file).name
    message = {
        "protocol": PROTOCOL,
        "fingerprint": fingerprint(environ),
        "code": code,
        "filename": filename,
        "profile": job.profile,
        "limits": job.limits,
        "as_json": job.as_json,
        "raw": job.raw,
        "strict": job.strict,
        "terminal": terminal(environ),
    }
    return json.dumps(message).encode("utf-8", "surrogatepass")


def fingerprint(environ: Mapping[str, str]) -> str:
    """What a run's result depends on besides its request, as one hash: the client's is
    compared with the server's (computed at its start, from its own environment)."""
    chosen = configsearch.chosen(environ)
    facts = {
        "protocol": PROTOCOL,
        "version": __version__,
        "package": str(Path(__file__).resolve().parent.parent),
        # Real paths: the same venv reached by a link (a worktree's .venv) is the same one.
        "python": [os.path.realpath(sys.executable), os.path.realpath(sys.prefix), sys.version],
        "user": [os.geteuid(), os.getegid()],
        "env": {
            name: value
            for name, value in sorted(environ.items())
            if name not in _NOT_FINGERPRINTED
            and (name.startswith(("CODECAGE_", "PYTHON")) or name in _FINGERPRINT_ENV)
        },
        "config": [str(chosen), _digest(chosen) if chosen is not None else None],
        "packages": [_stamp(path) for path in _packages_records(environ)],
    }
    text = json.dumps(facts, sort_keys=True, ensure_ascii=True)
    return hashlib.sha256(text.encode("ascii")).hexdigest()


def _digest(path: Path) -> str:
    try:
        with open(path, "rb") as handle:
            return hashlib.sha256(handle.read(_MAX_CONFIG_BYTES)).hexdigest()
    except OSError as exc:
        return f"unreadable: {exc.errno}"


def _packages_records(environ: Mapping[str, str]) -> list[Path]:
    """The added packages' records a run may read (packages.directory's places)."""
    places = list(_PACKAGES_RECORDS)
    if environ.get("CODECAGE_PACKAGES_DIR"):
        places.append(Path(environ["CODECAGE_PACKAGES_DIR"]) / "packages.lock.json")
    xdg = environ.get("XDG_DATA_HOME", "")
    if not Path(xdg).is_absolute():
        xdg = str(Path.home() / ".local" / "share")
    places.append(Path(xdg) / "codecage" / "packages" / "packages.lock.json")
    return places


def _stamp(path: Path) -> list[int] | None:
    """Which version of a file this is (rewritten: replaced, a new inode), None if none."""
    try:
        info = path.stat()
    except OSError:
        return None
    return [info.st_ino, info.st_size, info.st_mtime_ns]


def terminal(environ: Mapping[str, str]) -> dict[str, Any]:
    """This process's screen as rich would see it: the server's console is made to match."""
    size = [80, 25]
    for fd in (0, 1, 2):  # rich's order (console.size)
        try:
            size = list(os.get_terminal_size(fd))
        except (OSError, ValueError):
            continue
        break
    return {
        "env": {name: environ[name] for name in RICH_ENV if name in environ},
        "tty": [_isatty(sys.stdout), _isatty(sys.stderr)],
        "encoding": [sys.stdout.encoding, sys.stderr.encoding],
        "size": [size[0] or 80, size[1] or 25],
    }


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (ValueError, OSError):
        return False


def home_path(environ: Mapping[str, str]) -> Path:
    """The user's private directory of the local server (cli/local.py `runtime_dir`)."""
    base = environ.get("XDG_RUNTIME_DIR", "")
    # /tmp is sticky: no one else can replace a directory of ours there (local.py).
    fallback = Path(f"/tmp/codecage-{os.geteuid()}")  # noqa: S108
    return Path(base) / "codecage" if Path(base).is_absolute() else fallback


def _server(environ: Mapping[str, str]) -> tuple[Path, str]:
    """The local server's socket and token, when the directory, the socket and the token
    are this user's alone.

    Raises:
        Declined: no server there, or anything not private.
    """
    home, uid = home_path(environ), os.geteuid()
    try:
        info = home.lstat()
        sock = (home / SOCKET).lstat()
    except OSError as exc:
        raise Declined(f"no local server ({exc.strerror})") from exc
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != uid or info.st_mode & 0o077:
        raise Declined(f"{home} is not a directory of yours with mode 0700")
    if not stat.S_ISSOCK(sock.st_mode) or sock.st_uid != uid:
        raise Declined(f"{home / SOCKET} is not a socket of yours")
    try:
        fd = os.open(home / TOKEN, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise Declined(f"no token ({exc.strerror})") from exc
    with os.fdopen(fd, "rb") as handle:
        held = os.fstat(handle.fileno())
        if not stat.S_ISREG(held.st_mode) or held.st_uid != uid or held.st_mode & 0o077:
            raise Declined("the token file is not yours alone")
        token = handle.read(_MAX_TOKEN_BYTES).decode("ascii", "replace").strip()
    if not token or any(c in token for c in "\r\n ") or not token.isprintable():
        raise Declined("the token file holds no token")
    return home / SOCKET, token


def exchange(path: Path, token: str, body: bytes) -> int:
    """Send the request to the server on `path` and write what it sends back; the run's
    exit code.

    Raises:
        Declined: the server does not answer, or declined, before anything was written.
        Broken: the server stopped after it had started writing.
    """
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(_CONNECT_TIMEOUT_S)
        try:
            sock.connect(str(path))
        except OSError as exc:
            raise Declined(f"the local server does not answer ({exc})") from exc
        head = (
            f"POST {PATH} HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer {token}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n"
        )
        sock.settimeout(_ANSWER_TIMEOUT_S)
        with sock.makefile("rb") as stream:
            try:
                sock.sendall(head.encode("ascii") + body)
                chunked = _answer_head(stream)
            except OSError as exc:
                raise Declined(f"the local server did not answer ({exc})") from exc
            sock.settimeout(None)  # the run takes as long as its timeout allows
            return _relay(_lines(stream, chunked))


def _answer_head(stream: io.BufferedReader) -> bool:
    """Read the status line and headers; whether the body is chunked.

    Raises:
        Declined: not a 200 (an older server without the endpoint, a wrong token, busy).
    """
    status = stream.readline(1024).split()
    if len(status) < 2 or status[1] != b"200":
        raise Declined(
            f"the local server answered {b' '.join(status[1:3]).decode(errors='replace')!r}"
        )
    chunked = False
    for _ in range(100):
        line = stream.readline(16 * 1024)
        if line in (b"\r\n", b"\n", b""):
            return chunked
        name, _, value = line.decode("latin-1").partition(":")
        if name.strip().lower() == "transfer-encoding" and "chunked" in value.lower():
            chunked = True
    raise Declined("the local server's answer has too many headers")


def _lines(stream: io.BufferedReader, chunked: bool) -> Iterator[bytes]:
    """The body's lines as they arrive (a chunked body decoded)."""
    pending = b""
    for data in _chunks(stream) if chunked else iter(lambda: stream.read1(65536), b""):
        pending += data
        *whole, pending = pending.split(b"\n")
        yield from whole
        if len(pending) > _MAX_LINE_BYTES:
            raise OSError("a line of the server's answer is too long")
    if pending:
        yield pending


def _chunks(stream: io.BufferedReader) -> Iterator[bytes]:
    while True:
        size = int(stream.readline(1024).split(b";")[0].strip() or b"x", 16)
        if size == 0:
            return
        data = stream.read(size)
        if len(data) != size or stream.readline(16) not in (b"\r\n", b"\n"):
            raise OSError("the server's answer ended in the middle")
        yield data


def _relay(lines: Iterator[bytes]) -> int:
    """Write what the server says to; its exit code.

    Raises:
        Declined: it declined before anything was written (or ended, or sent nonsense).
        Broken: it ended or sent nonsense after the first write.
    """
    wrote = False
    try:
        for line in lines:
            message = json.loads(line)
            if "exit" in message:
                return int(message["exit"])
            if "decline" in message and not wrote:
                raise Declined(f"the local server declined: {message['decline']}")
            _write(message)
            wrote = True
    except (OSError, ValueError, KeyError, TypeError) as exc:
        if not wrote:
            raise Declined(f"the local server's answer broke off ({exc})") from exc
        raise Broken(f"the local server stopped answering during the run ({exc})") from exc
    if not wrote:
        raise Declined("the local server's answer ended without a result")
    raise Broken("the local server's answer ended before the run's result")


def _write(message: Mapping[str, Any]) -> None:
    """One write, as the server's recording streams saw it (text, or bytes for --raw)."""
    stream = sys.stdout if message["o"] == "out" else sys.stderr
    data = base64.b64decode(message["b"]) if "b" in message else None
    try:
        if data is not None:
            stream.flush()
            stream.buffer.write(data)
            stream.buffer.flush()
        else:
            stream.write(message["t"])
            stream.flush()
    except OSError:  # our own stdout or stderr is gone (a closed pipe): not the server's fault
        raise SystemExit(1) from None
