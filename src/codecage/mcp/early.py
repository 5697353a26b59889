"""`codecage serve` over stdio answers MCP's `initialize` before it has loaded anything.

A stdio server starts by importing the MCP SDK (~600 pydantic models), codecage's host and
engine, and building its host (the backend's self-test, the audit trail, the warm pool):
1.5-3 s here, 8 s on a first boot when the self-test runs. Its client waits for the answer
to `initialize` all that time, and some clients give up. Here the answer goes out first:

- `start` (called by `codecage.cli.main` before the command's own imports) reads the first
  line of stdin in a thread; when it is an `initialize` request, the thread writes the
  answer the SDK gave the last time to the same request (same protocol version, same
  codecage and SDK, same interpreter), kept in the cache directory. Without one (the first
  start, or a new version), nothing is answered early and the SDK answers as before.
- The main thread meanwhile imports and builds the host, as before: the self-test still
  runs before the server reads anything else, so a run asked for at once waits until the
  host is proven, and one on a host that fails it is refused as before.
- `take` hands what the thread read to the stdio transport (mcp/stdio.py), which feeds it
  to the SDK first: the SDK handles that `initialize` itself (its session then knows its
  client) and the transport drops its answer when it was already sent, keeping it for the
  next start when it was not (or differs: then the new one is kept and a warning logged).

Imports the standard library only: this runs before anything else of codecage's.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from codecage import fdio
from codecage._version import __version__

log = logging.getLogger(__name__)

_MAX_FIRST_LINE = 1 << 20
"""An `initialize` is a few hundred bytes; a first line past this is not one (it is handed
on unread, and the SDK answers whatever it is)."""
_NOT_EARLY = frozenset({"--http", "-h", "--help"})


@dataclass
class Front:
    """What the reading thread saw: the bytes it read (handed on to the SDK), and the
    `initialize` request's id and cache file when the first line was one."""

    read: bytearray = field(default_factory=bytearray)
    request_id: Any = None
    cache: Path | None = None
    answered: dict[str, Any] | None = None  # the result sent early, if one was
    thread: threading.Thread | None = None


_FRONT: Front | None = None


def start(args: list[str]) -> None:
    """For `codecage serve` over stdio (pipes or sockets, as MCP hosts give), start
    reading stdin's first line and answering it when it is an `initialize` whose answer
    is known. Anything else (another command, HTTP, help, a terminal): nothing."""
    global _FRONT
    if not args or args[0] != "serve" or _FRONT is not None:
        return
    if any(arg in _NOT_EARLY or arg.startswith("--http=") for arg in args[1:]):
        return
    if not (fdio.is_stream(0) and fdio.is_stream(1)):
        return
    front = Front()
    front.thread = threading.Thread(target=_answer_first, args=(front,), daemon=True)
    _FRONT = front
    front.thread.start()


def take() -> Front | None:
    """What the reading thread read (waiting until it has read its first line), once;
    None when no thread was started."""
    global _FRONT
    front, _FRONT = _FRONT, None
    if front is not None and front.thread is not None:
        front.thread.join()
    return front


def cache_dir() -> Path:
    """isolation/rootfs.py `cache_dir`, which this module must not import."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "codecage"


def cache_file(protocol_version: str) -> Path:
    """Where the SDK's answer to an `initialize` of `protocol_version` is kept: named by
    all it depends on (the protocol version asked for, codecage and its instructions, the
    SDK's installed version, the interpreter) and, to be safe, by all that could change
    the server (its arguments and CODECAGE_* variables), so a change of any is a new file."""
    here = Path(__file__).resolve().parent
    parts = [protocol_version, __version__, sys.executable, *_sdk_versions(), *sys.argv[1:]]
    parts += sorted(f"{k}={v}" for k, v in os.environ.items() if k.startswith("CODECAGE_"))
    with contextlib.suppress(OSError):
        info = (here / "server.py").stat()  # INSTRUCTIONS, in a source checkout
        parts.append(f"{info.st_mtime_ns}:{info.st_size}")
    digest = hashlib.sha256("|".join(parts).encode()).hexdigest()[:24]
    return cache_dir() / f"serve-initialize-{digest}.json"


def _sdk_versions() -> list[str]:
    """The installed MCP SDK's distributions (`mcp-2.3.0.dist-info`, ...), by name: found
    next to codecage's own, without importing them."""
    found: list[str] = []
    for entry in sys.path:
        with contextlib.suppress(OSError):
            found += [p.name for p in Path(entry or ".").glob("mcp*.dist-info")]
    return sorted(set(found))


def _answer_first(front: Front) -> None:
    """Read stdin up to its first line end; answer it when it is an `initialize` known."""
    try:
        while b"\n" not in front.read and len(front.read) < _MAX_FIRST_LINE:
            chunk = os.read(0, 1 << 16)
            if not chunk:
                return
            front.read += chunk
        line = bytes(front.read.split(b"\n", 1)[0])
        request = _initialize_request(line)
        if request is None:
            return
        front.request_id, version = request
        front.cache = cache_file(version)
        known = _cached_result(front.cache)
        if known is None:
            return
        answer = {"jsonrpc": "2.0", "id": front.request_id, "result": known}
        fdio.write_all(1, (json.dumps(answer, separators=(",", ":")) + "\n").encode())
        front.answered = known
    except OSError:  # stdin or stdout gone: the transport meets it and ends the session
        return


def _initialize_request(line: bytes) -> tuple[Any, str] | None:
    """The id and protocol version of an `initialize` request, else None."""
    try:
        message = json.loads(line)
    except ValueError:
        return None
    if not isinstance(message, dict) or message.get("method") != "initialize":
        return None
    params = message.get("params")
    request_id = message.get("id")
    if not isinstance(params, dict) or not isinstance(request_id, str | int):
        return None
    # What the SDK requires of one (the rest it ignores): a malformed one is left to it.
    client = params.get("clientInfo")
    if not isinstance(params.get("capabilities"), dict) or not isinstance(client, dict):
        return None
    if not (isinstance(client.get("name"), str) and isinstance(client.get("version"), str)):
        return None
    version = params.get("protocolVersion")
    return (request_id, version) if isinstance(version, str) else None


def _cached_result(path: Path) -> dict[str, Any] | None:
    try:
        result = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return None
    return result if isinstance(result, dict) else None


def keep(path: Path, result: dict[str, Any]) -> None:
    """Keep the SDK's `result` for the next start (written whole, then renamed)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_suffix(f".{os.getpid()}.tmp")
        temporary.write_text(json.dumps(result), encoding="utf-8")
        temporary.replace(path)
    except OSError as exc:  # a read-only home: the next start answers late, that is all
        log.warning("server.initialize_not_kept", extra={"path": str(path), "error": str(exc)})
