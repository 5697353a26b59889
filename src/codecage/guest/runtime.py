"""codecage.runtime: what agent code imports inside the sandbox.

    from codecage.runtime import call_tool, search_tools, workspace, logger, scrub

- `call_tool(server, tool, arguments)` (async) / `call_tool_sync(...)`: call a tool of an
  upstream MCP server. The call leaves the sandbox over a private socket (fd 4) to the
  broker in the host, which holds the sessions and credentials (docs/tool-bridge.md). The
  generated modules (`servers.<server>.<tool>.call`) use these.
- `search_tools(query)`: find tools in /servers without importing them.
- `workspace`: read and write files in /workspace (and only there).
- `run_async(coro)`, `logger` (JSON lines on stderr), `scrub(text)`.

Standard library only: this runs in the sandbox's interpreter, which has nothing else.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import re
import sys
import threading
from collections.abc import Coroutine, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

__all__ = [
    "BRIDGE_FD",
    "ToolCallError",
    "ToolRef",
    "Workspace",
    "WorkspacePathError",
    "call_tool",
    "call_tool_sync",
    "list_servers",
    "logger",
    "run_async",
    "scrub",
    "search_tools",
    "workspace",
]

BRIDGE_FD = 4
WIRE_VERSION = 1
SERVERS_DIR = "/servers"
_MAX_ANSWER_BYTES = 64 * 1024 * 1024
_MAX_TOOL_FILE_BYTES = 1024 * 1024


class ToolCallError(Exception):
    """A tool call failed; `kind` says how (docs/tool-bridge.md), `message` why.

    Kinds: no_servers, unknown_server, not_allowed, limit, timeout, tool_error (the tool
    said it failed), upstream_error (the server failed), bad_request, channel_closed.
    """

    def __init__(self, kind: str, message: str, server: str = "", tool: str = "") -> None:
        self.kind = kind
        self.message = message
        self.server = server
        self.tool = tool
        where = f"{server}.{tool} failed" if server else "the tool bridge failed"
        super().__init__(f"{where} ({kind}): {message}")


# --- the bridge ------------------------------------------------------------------------


class _Bridge:
    """One socket to the host, shared by every call of the program; answers are matched
    to requests by id, so async calls can be in flight together."""

    def __init__(self, sock: Any) -> None:
        self._sock = sock
        self._send_lock = threading.Lock()
        self._pending: dict[int, Future[Any]] = {}
        self._pending_lock = threading.Lock()
        self._ids = itertools.count(1)
        self._closed: str | None = None
        threading.Thread(target=self._read_loop, name="codecage-bridge", daemon=True).start()

    def request(self, op: str, **fields: Any) -> Future[Any]:
        future: Future[Any] = Future()
        request_id = next(self._ids)
        line = json.dumps({"v": WIRE_VERSION, "id": request_id, "op": op, **fields})
        with self._pending_lock:
            if self._closed is not None:
                future.set_exception(ToolCallError("channel_closed", self._closed))
                return future
            self._pending[request_id] = future
        try:
            with self._send_lock:
                self._sock.sendall(line.encode("utf-8", "surrogatepass") + b"\n")
        except OSError as exc:
            self._fail_all(f"the host closed the tool bridge ({exc.strerror})")
        return future

    def _read_loop(self) -> None:
        buffer = b""
        while True:
            try:
                chunk = self._sock.recv(1 << 16)
            except OSError:
                chunk = b""
            if not chunk:
                self._fail_all("the host closed the tool bridge")
                return
            buffer += chunk
            if len(buffer) > _MAX_ANSWER_BYTES and b"\n" not in buffer:
                self._fail_all("the host sent an answer over 64 MiB")
                return
            *lines, buffer = buffer.split(b"\n")
            for line in lines:
                self._deliver(line)

    def _deliver(self, line: bytes) -> None:
        try:
            answer = json.loads(line)
            request_id = answer["id"]
        except (ValueError, KeyError, TypeError):
            return
        with self._pending_lock:
            future = self._pending.pop(request_id, None)
        if future is None:
            return
        if answer.get("ok"):
            future.set_result(answer.get("result"))
        else:
            error = answer.get("error") or {}
            future.set_exception(
                ToolCallError(str(error.get("kind", "error")), str(error.get("message", "")))
            )

    def _fail_all(self, reason: str) -> None:
        with self._pending_lock:
            self._closed = self._closed or reason
            pending, self._pending = self._pending, {}
        for future in pending.values():
            if not future.done():
                future.set_exception(ToolCallError("channel_closed", reason))


_bridge: _Bridge | None = None
_bridge_lock = threading.Lock()


def _channel() -> _Bridge:
    global _bridge
    with _bridge_lock:
        if _bridge is None:
            _bridge = _Bridge(_open_bridge_socket())
        return _bridge


def _open_bridge_socket() -> Any:
    import socket
    import stat

    try:
        if not stat.S_ISSOCK(os.fstat(BRIDGE_FD).st_mode):
            raise OSError("not a socket")
        return socket.socket(fileno=os.dup(BRIDGE_FD))
    except OSError as exc:
        raise ToolCallError(
            "channel_closed",
            f"no tool bridge on fd {BRIDGE_FD}: run the code with `codecage run` or `codecage "
            "serve` (with --mcp-config for tool calls)",
        ) from exc


def _use_channel(sock: Any) -> None:
    """Talk over `sock` instead of fd 4 (for tests on the host)."""
    global _bridge
    with _bridge_lock:
        _bridge = _Bridge(sock)


def _call(server: str, tool: str, arguments: Mapping[str, Any] | None) -> Future[Any]:
    if not isinstance(server, str) or not isinstance(tool, str):
        raise TypeError("server and tool must be strings")
    args = dict(arguments) if arguments is not None else {}
    try:
        json.dumps(args)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"the arguments of {server}.{tool} are not JSON: {exc}") from None
    return _channel().request("call_tool", server=server, tool=tool, arguments=args)


def _value(result: Any) -> Any:
    if not isinstance(result, dict):
        return result
    structured = result.get("structured")
    return structured if structured is not None else result.get("text", "")


def _named(exc: ToolCallError, server: str, tool: str) -> ToolCallError:
    return ToolCallError(exc.kind, exc.message, server, tool)


async def call_tool(server: str, tool: str, arguments: Mapping[str, Any] | None = None) -> Any:
    """Call `tool` of the upstream MCP server `server`; return its structured content
    (a dict) if it sends one, else its text.

    Raises:
        ToolCallError: the call failed (not allowed, timeout, the tool's own error, ...).
        TypeError: the arguments are not JSON.
    """
    import asyncio

    future = _call(server, tool, arguments)
    try:
        return _value(await asyncio.wrap_future(future))
    except ToolCallError as exc:
        raise _named(exc, server, tool) from None


def call_tool_sync(server: str, tool: str, arguments: Mapping[str, Any] | None = None) -> Any:
    """`call_tool` without await."""
    try:
        return _value(_call(server, tool, arguments).result())
    except ToolCallError as exc:
        raise _named(exc, server, tool) from None


def scrub(text: str) -> str:
    """`text` with personal data and secrets replaced by [EMAIL], [PHONE], [SECRET], ...
    (by the host's scrubber; all output is scrubbed by the host anyway, unless the
    operator turned that off)."""
    result = _channel().request("scrub", text=str(text)).result()
    return str(result)


# --- finding tools ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ToolRef:
    """A tool found by `search_tools`; `load()` imports its module."""

    server: str
    tool: str
    module: str  # e.g. "servers.memory.create_entities"
    summary: str = ""
    description: str | None = None

    def load(self) -> Any:
        import importlib

        return importlib.import_module(self.module)

    def __str__(self) -> str:
        return f"{self.module}: {self.summary}" if self.summary else self.module


def list_servers(root: str | None = None) -> list[str]:
    """The module names of the servers in /servers (`from servers.<name> import ...`)."""
    base = Path(root or SERVERS_DIR)
    if not base.is_dir():
        return []
    return sorted(p.name for p in base.iterdir() if (p / "__init__.py").is_file())


def search_tools(
    query: str,
    detail: Literal["name", "basic", "full"] = "basic",
    limit: int = 10,
    *,
    root: str | None = None,
) -> list[ToolRef]:
    """Tools in /servers that match `query`, best first, read without importing them.

    detail: "name" gives server, tool and module; "basic" adds the one-line summary;
    "full" adds the whole docstring (the parameters and the result).
    """
    words = _words(query)
    scored: list[tuple[float, str, ToolRef]] = []
    base = Path(root or SERVERS_DIR)
    for server_dir in list_servers(str(base)):
        for path in sorted((base / server_dir).glob("*.py")):
            if path.name == "__init__.py":
                continue
            ref = _read_tool(path, f"servers.{server_dir}.{path.stem}")
            if ref is None:
                continue
            score = _score(words, ref, path.stem, server_dir)
            if words and score <= 0:
                continue
            scored.append((-score, ref.module, ref))
    scored.sort(key=lambda item: (item[0], item[1]))
    return [_with_detail(ref, detail) for _, _, ref in scored[: max(0, limit)]]


def _read_tool(path: Path, module: str) -> ToolRef | None:
    import ast

    try:
        if path.stat().st_size > _MAX_TOOL_FILE_BYTES:
            return None
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError):
        return None
    doc = ast.get_docstring(tree) or ""
    constants: dict[str, str] = {}
    for node in tree.body:
        target = value = None
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            target, value = node.target.id, node.value
        elif (
            isinstance(node, ast.Assign)
            and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name)
        ):
            target, value = node.targets[0].id, node.value
        if target in ("SERVER", "TOOL") and isinstance(value, ast.Constant):
            constants[target] = str(value.value)
    summary = doc.strip().splitlines()[0] if doc.strip() else ""
    return ToolRef(
        server=constants.get("SERVER", path.parent.name),
        tool=constants.get("TOOL", path.stem),
        module=module,
        summary=summary,
        description=doc,
    )


def _words(text: str) -> list[str]:
    return [w for w in re.split(r"[^a-z0-9]+", text.lower()) if w]


def _stem(word: str) -> str:
    for suffix in ("ies", "es", "s", "ing", "ed"):
        if word.endswith(suffix) and len(word) > len(suffix) + 2:
            return word[: -len(suffix)]
    return word


def _score(words: list[str], ref: ToolRef, tool_module: str, server_module: str) -> float:
    if not words:
        return 0.0
    fields = (
        (4.0, _words(f"{ref.tool} {tool_module}")),
        (2.0, _words(f"{ref.server} {server_module}")),
        (1.5, _words(ref.summary)),
        (0.5, _words(ref.description or "")),
    )
    score = 0.0
    for word in {_stem(w) for w in words}:
        for weight, field_words in fields:
            if any(_stem(w) == word or w.startswith(word) for w in field_words):
                score += weight
    return score


def _with_detail(ref: ToolRef, detail: str) -> ToolRef:
    if detail == "full":
        return ref
    if detail == "basic":
        return ToolRef(ref.server, ref.tool, ref.module, ref.summary, None)
    return ToolRef(ref.server, ref.tool, ref.module, "", None)


# --- the workspace ---------------------------------------------------------------------


class WorkspacePathError(ValueError):
    """A path that is not inside the workspace."""


class Workspace:
    """Files in /workspace, by paths relative to it; nothing outside it can be reached."""

    def __init__(self, root: str | os.PathLike[str] = "/workspace") -> None:
        self.path = Path(root)

    def _resolve(self, relative: str | os.PathLike[str]) -> Path:
        root = self.path.resolve()
        target = (root / relative).resolve()
        if target != root and root not in target.parents:
            raise WorkspacePathError(
                f"{str(relative)!r} is outside the workspace {root}: paths are relative to it "
                "and may not leave it (no '..', no absolute paths elsewhere, no links out)"
            )
        return target

    def read_text(self, path: str | os.PathLike[str]) -> str:
        return self._resolve(path).read_text(encoding="utf-8")

    def write_text(self, path: str | os.PathLike[str], text: str) -> Path:
        target = self._writable(path)
        target.write_text(text, encoding="utf-8")
        return target

    def read_bytes(self, path: str | os.PathLike[str]) -> bytes:
        return self._resolve(path).read_bytes()

    def write_bytes(self, path: str | os.PathLike[str], data: bytes) -> Path:
        target = self._writable(path)
        target.write_bytes(data)
        return target

    def read_json(self, path: str | os.PathLike[str]) -> Any:
        return json.loads(self.read_text(path))

    def write_json(self, path: str | os.PathLike[str], value: Any) -> Path:
        return self.write_text(path, json.dumps(value, indent=2, ensure_ascii=False) + "\n")

    def list(self, pattern: str = "*") -> list[str]:
        root = self.path.resolve()
        return sorted(
            str(p.relative_to(root))
            for p in root.rglob(pattern)
            if p.is_file() and not p.is_symlink()
        )

    def exists(self, path: str | os.PathLike[str]) -> bool:
        return self._resolve(path).exists()

    def delete(self, path: str | os.PathLike[str]) -> None:
        self._resolve(path).unlink()

    def _writable(self, path: str | os.PathLike[str]) -> Path:
        target = self._resolve(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        return target


workspace = Workspace()


# --- async and logging -----------------------------------------------------------------


def run_async(coro: Coroutine[Any, Any, Any]) -> Any:
    """Run `coro` to completion and return its value, with or without a running loop
    (top-level `await` code runs in one: then the coroutine gets a thread of its own)."""
    import asyncio

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = asyncio.run(coro)
        except BaseException as exc:
            box["error"] = exc

    thread = threading.Thread(target=target, name="codecage-run-async")
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box.get("value")


class _JsonLines(logging.Formatter):
    _standard = frozenset(vars(logging.makeLogRecord({})))

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {"level": record.levelname.lower(), "msg": record.getMessage()}
        for key, value in vars(record).items():
            if key not in self._standard and key not in ("message", "asctime"):
                entry[key] = value
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=repr, ensure_ascii=False)


def _make_logger() -> logging.Logger:
    log = logging.getLogger("agent")
    log.setLevel(logging.INFO)
    log.propagate = False
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(_JsonLines())
        log.addHandler(handler)
    return log


logger = _make_logger()
"""Structured log: one JSON object per line on stderr (`logger.info("done", extra={...})`).
Its text is scrubbed of personal data by the host like all output: the host never trusts
the sandbox to do that itself."""
