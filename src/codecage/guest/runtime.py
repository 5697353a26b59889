"""codecage.runtime: what agent code imports inside the sandbox.

    from codecage.runtime import call_tool, search_tools, workspace, logger, scrub

- `await call_tool(server, tool, arguments)` / `call_tool_sync(...)`: call a tool of an
  upstream MCP server. The call leaves the sandbox over a private socket (fd 4) to the
  broker in the host, which holds the sessions and credentials (docs/tool-bridge.md). The
  generated modules (`servers.<server>.<tool>.call`) use these. A failed call raises
  `ToolCallError` (`.kind`, `.message`, `.server`, `.tool`).
- `search_tools(query)` / `list_servers()`: find tools in /servers without importing them.
- `workspace`: read and write files in /workspace, by paths relative to it.
- `run_async(coro)`: run a coroutine to the end, with or without a running event loop.
- `logger`: JSON lines on stderr; `scrub(text)`: the host's redaction of personal data.

Standard library only: this runs in the sandbox's interpreter, which has nothing else.
It is imported by agent code on the hot path of a run, so it imports little at the top
(`logging`, `pathlib`, `asyncio`, `ast`, `socket`, `concurrent.futures` are imported when
first needed) and opens the bridge only on the first call. Nothing here is a security
boundary: the sandbox (namespaces, seccomp, mounts) and the host's checks are. The
workspace's path rules, for example, only turn a mistake into a clear error early.
"""

from __future__ import annotations

import _thread
import itertools
import json
import os
import stat
import sys
from collections.abc import Callable, Coroutine, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Literal, TypeVar

if TYPE_CHECKING:
    import logging
    from concurrent.futures import Future
    from pathlib import Path

    logger: logging.Logger  # made on first use by __getattr__ (below)

__all__ = [
    "BRIDGE_FD",
    "SERVERS_DIR",
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
"""The guest's end of the tool bridge (docs/tool-bridge.md)."""
SERVERS_DIR = "/servers"
"""Where the generated tool tree (`codecage gen`) is mounted, read-only."""
WORKSPACE_DIR = "/workspace"

WIRE_VERSION = 1
_MAX_REQUEST_BYTES = 4 * 1024 * 1024  # the host ends the channel on a longer request line
_MAX_ANSWER_BYTES = 64 * 1024 * 1024  # a longer answer line ends the channel here
_MAX_TOOL_FILE_BYTES = 1024 * 1024  # search_tools skips larger files
_RECV_BYTES = 256 * 1024
_NO_BRIDGE_HINT = (
    "tool calls work only in code run by `codecage run` or `codecage serve` (give them "
    "--mcp-config to name the upstream MCP servers)"
)

_T = TypeVar("_T")


class ToolCallError(Exception):
    """A tool call (or `scrub`) failed: `kind` says how, `message` why (from the host).

    Kinds (docs/tool-bridge.md): `bad_request`, `no_servers` (no upstream servers were
    configured), `unknown_server`, `not_allowed` (not on the allow-list), `limit` (too many
    calls, arguments or result too large), `timeout`, `tool_error` (the tool said it
    failed), `upstream_error` (the server failed; it is restarted for the next call), and
    `channel_closed`: there is no bridge (the code does not run under codecage) or the
    host ended it; every later call fails the same way.
    """

    def __init__(self, kind: str, message: str = "", server: str = "", tool: str = "") -> None:
        super().__init__(kind, message, server, tool)  # args stay re-creatable: it pickles
        self.kind = kind
        self.message = message
        self.server = server
        self.tool = tool

    def __str__(self) -> str:
        where = f"{self.server}.{self.tool}" if self.server or self.tool else "the tool bridge"
        return f"{where} failed ({self.kind}): {self.message}"


# --- the bridge ------------------------------------------------------------------------


class _Pending:
    __slots__ = ("future", "op", "server", "tool")

    def __init__(self, future: Future[Any], op: str, server: str, tool: str) -> None:
        self.future = future
        self.op = op
        self.server = server
        self.tool = tool

    def names(self) -> tuple[str, str]:
        return self.server, self.tool


class _Bridge:
    """One socket to the host, shared by every call of the program.

    Requests are written whole under a lock; one reader thread reads the answers and
    settles the waiting futures by id, so calls from many threads and tasks can be in
    flight together and be answered in any order. Anything wrong with the channel (EOF,
    an error, a line that is not an answer, one over 64 MiB) fails every pending call and
    every later one with `channel_closed`.
    """

    def __init__(self, sock: Any) -> None:
        import threading

        self._sock = sock
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()  # guards _pending and _closed
        self._pending: dict[int, _Pending] = {}
        self._ids = itertools.count(1)
        self._closed: str | None = None
        self._reader = threading.Thread(target=self._read_loop, name="codecage-bridge", daemon=True)
        self._reader.start()

    def request(
        self, op: str, fields: Mapping[str, Any], server: str = "", tool: str = ""
    ) -> Future[Any]:
        """Send one request; return a concurrent Future of its `result`.

        Raises:
            ToolCallError: the request is over the host's size limit (`limit`); nothing
                was sent and the channel stays usable.
        """
        from concurrent.futures import Future

        request_id = next(self._ids)
        body = {"v": WIRE_VERSION, "id": request_id, "op": op, **fields}
        # ASCII with escapes: no encoding question, and no NaN (not JSON; the host's parser
        # may take it, another may not). The caller checked that the values are JSON.
        line = json.dumps(body, ensure_ascii=True, allow_nan=False, separators=(",", ":"))
        data = line.encode("ascii") + b"\n"
        if len(data) > _MAX_REQUEST_BYTES:
            raise ToolCallError(
                "limit",
                f"the request is {len(data) / (1024 * 1024):.1f} MiB, over the bridge's "
                f"{_MAX_REQUEST_BYTES // (1024 * 1024)} MiB per request; pass less (write "
                "big data to the workspace and pass its path, if the tool can read it)",
                server,
                tool,
            )
        future: Future[Any] = Future()
        entry = _Pending(future, op, server, tool)
        with self._lock:
            if self._closed is not None:
                raise ToolCallError("channel_closed", self._closed, server, tool)
            self._pending[request_id] = entry
        # An async caller that gives up (cancel, wait_for timeout) cancels the future:
        # forget it, so its late answer is dropped.
        future.add_done_callback(lambda f: self._forget(request_id) if f.cancelled() else None)
        try:
            with self._send_lock:
                self._sock.sendall(data)
        except OSError as exc:
            self._fail_all(f"the tool bridge broke while sending ({exc.strerror or exc})")
        return future

    def close(self, reason: str) -> None:
        """End the channel here: pending and later calls fail with `channel_closed`."""
        self._fail_all(reason)
        self._reader.join(timeout=5)
        self._sock.close()

    def _forget(self, request_id: int) -> None:
        with self._lock:
            self._pending.pop(request_id, None)

    def _read_loop(self) -> None:
        reason = "the host closed the tool bridge"
        try:
            reason = self._read_answers()
        except Exception as exc:  # a bug here must not leave callers waiting forever
            reason = f"the tool bridge's reader failed ({type(exc).__name__}: {exc})"
        finally:
            self._fail_all(reason)

    def _read_answers(self) -> str:
        """Read and deliver answers until the channel ends; return why it ended."""
        buffer = bytearray()
        scanned = 0  # bytes of `buffer` known to hold no newline
        while True:
            try:
                chunk = self._sock.recv(_RECV_BYTES)
            except OSError as exc:
                return f"the tool bridge broke ({exc.strerror or exc})"
            if not chunk:
                with self._lock:
                    if self._closed is not None:
                        return self._closed
                return "the host closed the tool bridge"
            buffer += chunk
            start = 0
            while (newline := buffer.find(b"\n", max(start, scanned))) >= 0:
                if newline - start > _MAX_ANSWER_BYTES:
                    return self._answer_too_long()
                problem = self._deliver(bytes(buffer[start:newline]))
                if problem is not None:
                    return problem
                start = newline + 1
            del buffer[:start]
            scanned = len(buffer)
            if scanned > _MAX_ANSWER_BYTES:
                return self._answer_too_long()

    @staticmethod
    def _answer_too_long() -> str:
        return f"the host sent an answer over {_MAX_ANSWER_BYTES // (1024 * 1024)} MiB"

    def _deliver(self, line: bytes) -> str | None:
        """Settle the future `line` answers; a reason to end the channel if it is bad."""
        try:
            answer = json.loads(line)
        except (ValueError, RecursionError):
            return f"the host sent a line that is not JSON: {line[:80]!r}"
        if isinstance(answer, dict) and isinstance(answer.get("closed"), str):
            closed: str = answer["closed"]  # the host's last line: why it ends the channel
            return closed[:2000]
        request_id = answer.get("id") if isinstance(answer, dict) else None
        ok = answer.get("ok") if isinstance(answer, dict) else None
        if type(request_id) is not int or not isinstance(ok, bool):
            return f"the host sent a line that is not a bridge answer: {line[:80]!r}"
        with self._lock:
            entry = self._pending.pop(request_id, None)
        if entry is None:
            return None  # the caller gave up on it (cancelled)
        if ok:
            outcome: Any = answer.get("result")
            if not _well_formed(entry.op, outcome):  # the two sides disagree on the protocol
                problem = f"the host's answer to {entry.op} has an unexpected shape: {line[:80]!r}"
                _settle(entry.future, ToolCallError("channel_closed", problem, *entry.names()))
                return problem
        else:
            error = answer.get("error")
            error = error if isinstance(error, dict) else {}
            kind, message = error.get("kind"), error.get("message")
            outcome = ToolCallError(
                kind if isinstance(kind, str) and kind else "upstream_error",
                message if isinstance(message, str) else "",
                entry.server,
                entry.tool,
            )
        _settle(entry.future, outcome)
        return None

    def _fail_all(self, reason: str) -> None:
        with self._lock:
            first = self._closed is None
            if first:
                self._closed = reason
            reason = self._closed or reason
            pending, self._pending = self._pending, {}
        if first:
            try:  # wakes the reader, and tells the host we are gone
                self._sock.shutdown(2)  # socket.SHUT_RDWR, without importing socket
            except OSError:
                pass
        for entry in pending.values():
            _settle(entry.future, ToolCallError("channel_closed", reason, entry.server, entry.tool))


def _well_formed(op: str, result: Any) -> bool:
    if op == "scrub":
        return isinstance(result, str)
    return isinstance(result, dict) and isinstance(result.get("text", ""), str)


def _settle(future: Future[Any], outcome: Any) -> None:
    from concurrent.futures import InvalidStateError

    try:
        if isinstance(outcome, ToolCallError):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)
    except InvalidStateError:
        pass  # cancelled meanwhile by its async caller


_bridge: _Bridge | None = None
_bridge_lock = _thread.allocate_lock()
_forked = False


def _after_fork_in_child() -> None:
    # The parent's reader thread is not in the child, and the socket is shared with the
    # parent: answers would go to whichever process reads first. So the child has none.
    global _forked, _bridge_lock
    _forked = True
    _bridge_lock = _thread.allocate_lock()  # it may have been held by another thread


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _channel(server: str = "", tool: str = "") -> _Bridge:
    global _bridge
    if _forked:
        raise ToolCallError(
            "channel_closed",
            "tool calls and scrub() work only in the sandbox's main process, not in a forked "
            "child (multiprocessing with fork): call tools in the parent, or use threads",
            server,
            tool,
        )
    with _bridge_lock:
        if _bridge is None:
            _bridge = _Bridge(_open_bridge_socket(server, tool))
        return _bridge


def _open_bridge_socket(server: str, tool: str) -> Any:
    """fd 4 as a socket, if it is the stream socket the host gave us."""
    import socket

    try:
        if not stat.S_ISSOCK(os.fstat(BRIDGE_FD).st_mode):
            raise OSError(f"fd {BRIDGE_FD} is not a socket")
        sock = socket.socket(fileno=BRIDGE_FD)
    except OSError as exc:
        raise ToolCallError(
            "channel_closed",
            f"no tool bridge (fd {BRIDGE_FD} is not an open socket): {_NO_BRIDGE_HINT}",
            server,
            tool,
        ) from exc
    if sock.family != socket.AF_UNIX or sock.type != socket.SOCK_STREAM:
        sock.detach()  # not ours to close
        raise ToolCallError(
            "channel_closed",
            f"no tool bridge (fd {BRIDGE_FD} is some other socket): {_NO_BRIDGE_HINT}",
            server,
            tool,
        )
    os.set_inheritable(BRIDGE_FD, False)  # the code's subprocesses never get it
    return sock


def _use_channel(sock: Any) -> None:
    """Talk over `sock` (a connected stream socket) instead of fd 4; for tests.

    The bridge owns `sock` from now on: `_reset()` closes it.
    """
    global _bridge, _forked
    _reset()
    with _bridge_lock:
        _forked = False
        _bridge = _Bridge(sock)


def _reset() -> None:
    """Close the bridge, if one is open (its pending calls fail); the next call opens fd 4."""
    global _bridge
    with _bridge_lock:
        bridge, _bridge = _bridge, None
    if bridge is not None:
        bridge.close("the tool bridge was closed by this program")


def _check_names(server: Any, tool: Any) -> None:
    for label, value in (("server", server), ("tool", tool)):
        if not isinstance(value, str) or not value:
            raise TypeError(f"{label} must be a non-empty string, not {value!r}")


def _start_call(server: str, tool: str, arguments: Mapping[str, Any] | None) -> Future[Any]:
    _check_names(server, tool)
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, Mapping):
        raise TypeError(
            f"the arguments of {server}.{tool} must be a mapping (a dict of argument names "
            f"to values), not {type(arguments).__name__}"
        )
    args = dict(arguments)
    for key in args:
        if not isinstance(key, str):
            raise TypeError(f"the arguments of {server}.{tool} must have string names, not {key!r}")
    try:
        json.dumps(args, allow_nan=False)
    except (TypeError, ValueError, RecursionError) as exc:
        raise TypeError(
            f"the arguments of {server}.{tool} must be JSON (dicts, lists, strings, numbers, "
            f"booleans, None): {exc}"
        ) from None
    return _channel(server, tool).request(
        "call_tool", {"server": server, "tool": tool, "arguments": args}, server, tool
    )


def _value(result: dict[str, Any], server: str, tool: str) -> Any:
    if result.get("is_error"):  # the host answers those with ok: false; be sure anyway
        raise ToolCallError("tool_error", str(result.get("text", "")), server, tool)
    structured = result.get("structured")
    return structured if structured is not None else result.get("text", "")


async def call_tool(server: str, tool: str, arguments: Mapping[str, Any] | None = None) -> Any:
    """Call `tool` of the upstream MCP server `server` with `arguments`.

    Returns the tool's structured content (usually a dict) when it sends one, else the
    text of its answer. Many calls may be awaited together (`asyncio.gather`); each
    waits only for its own answer.

    Raises:
        ToolCallError: the call failed; `.kind` says how (`not_allowed`, `timeout`,
            `tool_error`, `limit`, `channel_closed`, ...) and `.message` why.
        TypeError: `arguments` is not a mapping of names to JSON values.
    """
    import asyncio

    future = _start_call(server, tool, arguments)
    return _value(await asyncio.wrap_future(future), server, tool)


def call_tool_sync(server: str, tool: str, arguments: Mapping[str, Any] | None = None) -> Any:
    """`call_tool` without `await`: blocks this thread until the answer comes.

    It also works inside async code (it blocks the event loop meanwhile), but there
    `await call_tool(...)` lets other calls run at the same time.

    Raises:
        ToolCallError: the call failed; `.kind` says how and `.message` why.
        TypeError: `arguments` is not a mapping of names to JSON values.
    """
    return _value(_start_call(server, tool, arguments).result(), server, tool)


def scrub(text: str) -> str:
    """`text` with personal data and secrets replaced (`[EMAIL]`, `[PHONE]`, `[SECRET]`...).

    The host's scrubber does it, over the tool bridge; it works with or without upstream
    servers. (The program's output is scrubbed by the host anyway unless the operator
    turned that off: use this for text the code keeps or passes on.)

    Raises:
        ToolCallError: no bridge (`channel_closed`), `text` is over the host's limit
            (1 MiB by default: `limit`), or the run used its tool bridge budget (`limit`).
        TypeError: `text` is not a string.
    """
    if not isinstance(text, str):
        raise TypeError(f"scrub() takes a string, not {type(text).__name__}")
    if not text:
        return text
    future = _channel().request("scrub", {"text": text})
    return future.result()  # type: ignore[no-any-return]


# --- finding tools ---------------------------------------------------------------------


class ToolRef:
    """A tool found by `search_tools`: its names, its module and what it does.

    Immutable, compared and hashed by value (like a frozen dataclass, without importing
    `dataclasses` in the sandbox). `load()` imports the module; `await ref.load().call(...)`
    calls the tool.

    Attributes:
        server: the server's name, as the host knows it (for `call_tool`).
        tool: the tool's name, as the server knows it (for `call_tool`).
        module: the module to import, e.g. "servers.memory.create_entities".
        summary: the first line of the tool's description ("" for detail="name").
        description: the module's whole docstring: description, parameters, result
            (None unless detail="full").
    """

    __slots__ = ("description", "module", "server", "summary", "tool")
    __match_args__ = ("server", "tool", "module", "summary", "description")

    server: str
    tool: str
    module: str
    summary: str
    description: str | None

    def __init__(
        self, server: str, tool: str, module: str, summary: str = "", description: str | None = None
    ) -> None:
        object.__setattr__(self, "server", server)
        object.__setattr__(self, "tool", tool)
        object.__setattr__(self, "module", module)
        object.__setattr__(self, "summary", summary)
        object.__setattr__(self, "description", description)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"ToolRef is immutable: cannot set {name!r}")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"ToolRef is immutable: cannot delete {name!r}")

    def _fields(self) -> tuple[str, str, str, str, str | None]:
        return (self.server, self.tool, self.module, self.summary, self.description)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ToolRef):
            return NotImplemented
        return self._fields() == other._fields()

    def __hash__(self) -> int:
        return hash(self._fields())

    def __repr__(self) -> str:
        fields = ", ".join(
            f"{n}={v!r}" for n, v in zip(self.__match_args__, self._fields(), strict=True)
        )
        return f"ToolRef({fields})"

    def __str__(self) -> str:
        return f"{self.module}: {self.summary}" if self.summary else self.module

    def __reduce__(self) -> tuple[type[ToolRef], tuple[str, str, str, str, str | None]]:
        return (ToolRef, self._fields())

    def load(self) -> Any:
        """Import and return the tool's module (`call`, `call_sync`, `Params`, ...).

        Raises:
            ImportError: the module cannot be imported (e.g. /servers is not importable
                here: inside codecage it always is).
        """
        import importlib

        return importlib.import_module(self.module)


def list_servers(root: str | os.PathLike[str] | None = None) -> list[str]:
    """The servers whose tools are in the tool tree, as module names, sorted.

    `from servers.<name> import <tool>` imports one; `search_tools` finds tools across
    them. `root` is the tree (default /servers, where codecage mounts it).
    """
    base = os.fspath(root) if root is not None else SERVERS_DIR
    return [name for name, _ in _server_dirs(base)]


def _server_dirs(base: str) -> list[tuple[str, str]]:
    try:
        entries = list(os.scandir(base))
    except OSError:
        return []
    found = []
    for entry in entries:
        if (
            entry.name.isidentifier()
            and entry.is_dir(follow_symlinks=False)
            and os.path.isfile(os.path.join(entry.path, "__init__.py"))
        ):
            found.append((entry.name, entry.path))
    return sorted(found)


def search_tools(
    query: str,
    detail: Literal["name", "basic", "full"] = "basic",
    limit: int | None = 10,
    *,
    root: str | os.PathLike[str] | None = None,
) -> list[ToolRef]:
    """Tools in the tool tree that match `query`, best first, read without importing them.

    Words of the query are matched (case, plural and -ing/-ed aside, prefixes counting
    half) against each tool's name, which weighs most, then its server's name, then the
    summary, then the rest of its description. Ties go by module name; an empty query
    lists every tool. `detail`: "name" gives server, tool and module; "basic" adds the
    one-line summary; "full" adds the whole docstring (description, parameters, result).
    `limit` is the most returned (None: all). `root` is the tree (default /servers).

    Raises:
        ValueError: `detail` is not one of the three, or `limit` is below 1.
        TypeError: `query` is not a string.
    """
    if not isinstance(query, str):
        raise TypeError(f"query must be a string, not {type(query).__name__}")
    if detail not in ("name", "basic", "full"):
        raise ValueError(f"detail must be 'name', 'basic' or 'full', not {detail!r}")
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be 1 or more (or None for all), not {limit!r}")
    words = _query_words(query)
    base = os.fspath(root) if root is not None else SERVERS_DIR
    scored: list[tuple[float, str, ToolRef]] = []
    for server_module, server_path in _server_dirs(base):
        for info in _tools_of(server_module, server_path):
            score = _score(words, info) if words else 0.0
            if words and score <= 0:
                continue
            scored.append((-score, info.ref.module, info.ref))
    scored.sort(key=lambda item: (item[0], item[1]))
    chosen = scored if limit is None else scored[:limit]
    return [_with_detail(ref, detail) for _, _, ref in chosen]


class _ToolInfo:
    """A parsed tool module: its full ToolRef and its words for scoring (`more`: other
    text of the module that counts as description)."""

    __slots__ = ("description", "name", "ref", "server", "summary")

    def __init__(self, ref: ToolRef, server_module: str, tool_module: str, more: str) -> None:
        self.ref = ref
        self.name = frozenset(_words(f"{ref.tool} {tool_module}"))
        self.server = frozenset(_words(f"{ref.server} {server_module}"))
        self.summary = frozenset(_words(ref.summary))
        text = _description_body(ref.description or "") + "\n" + more
        self.description = frozenset(_words(text))


# (path, size, mtime_ns, inode) -> parsed tool: /servers is read-only, searches are many.
_parsed: dict[tuple[str, int, int, int], _ToolInfo | None] = {}


def _tools_of(server_module: str, server_path: str) -> Iterator[_ToolInfo]:
    try:
        entries = sorted(os.scandir(server_path), key=lambda e: e.name)
    except OSError:
        return
    for entry in entries:
        stem, dot, ext = entry.name.rpartition(".")
        if ext != "py" or not dot or stem == "__init__" or not stem.isidentifier():
            continue
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if not stat.S_ISREG(st.st_mode) or st.st_size > _MAX_TOOL_FILE_BYTES:
            continue
        key = (entry.path, st.st_size, st.st_mtime_ns, st.st_ino)
        if key not in _parsed:
            _parsed[key] = _parse_tool(entry.path, server_module, stem)
        info = _parsed[key]
        if info is not None:
            yield info


def _parse_tool(path: str, server_module: str, tool_module: str) -> _ToolInfo | None:
    """Read a tool module's docstring and SERVER/TOOL constants with `ast`, not import."""
    import ast

    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as f:
            source = f.read(_MAX_TOOL_FILE_BYTES + 1)
        if len(source) > _MAX_TOOL_FILE_BYTES:
            return None
        tree = ast.parse(source, filename=path)
    except (OSError, SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    constants: dict[str, str] = {}
    for node in tree.body:
        target: ast.expr | None = None
        value: ast.expr | None = None
        if isinstance(node, ast.AnnAssign):
            target, value = node.target, node.value
        elif isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
        if (
            isinstance(target, ast.Name)
            and target.id in ("SERVER", "TOOL")
            and isinstance(value, ast.Constant)
            and isinstance(value.value, str)
        ):
            constants[target.id] = value.value
    doc = ast.get_docstring(tree) or ""
    summary = next((line.strip() for line in doc.splitlines() if line.strip()), "")
    ref = ToolRef(
        server=constants.get("SERVER", server_module),
        tool=constants.get("TOOL", tool_module),
        module=f"servers.{server_module}.{tool_module}",
        summary=summary,
        description=doc,
    )
    # The docstrings of its types describe the fields of nested arguments and results.
    types = [ast.get_docstring(n) or "" for n in tree.body if isinstance(n, ast.ClassDef)]
    return _ToolInfo(ref, server_module, tool_module, "\n".join(types))


def _description_body(doc: str) -> str:
    """The docstring without codegen's closing paragraph, which every tool has alike."""
    cut = doc.find("\nCall it with `await call(")
    return doc if cut < 0 else doc[:cut]


# Dropped from a query (unless it has nothing else): they match everything.
_STOP_WORDS = frozenset(
    {"a", "an", "and", "are", "as", "at", "be", "by", "do", "for", "from", "i", "in"}
    | {"into", "is", "it", "me", "my", "of", "on", "or", "that", "the", "to", "which", "with"}
)


def _split_words(text: str) -> list[str]:
    """Lowercase words of `text`, camelCase and snake_case split: readGraph -> read, graph."""
    words: list[str] = []
    current: list[str] = []
    previous = ""
    for ch in text:
        if ch.isalnum() and ch.isascii():
            if ch.isupper() and current and (previous.islower() or previous.isdigit()):
                words.append("".join(current))
                current = []
            current.append(ch)
        elif current:
            words.append("".join(current))
            current = []
        previous = ch
    if current:
        words.append("".join(current))
    return [w.lower() for w in words]


def _stem(word: str) -> str:
    """A crude English stem, the same on both sides: entities/entity, creating/create."""
    if len(word) > 4 and word.endswith("ies"):
        word = word[:-3] + "y"
    elif len(word) > 4 and word.endswith(("sses", "ches", "shes", "xes", "zes")):
        word = word[:-2]
    elif len(word) > 3 and word.endswith("s") and not word.endswith(("ss", "us", "is")):
        word = word[:-1]
    if len(word) > 5 and word.endswith("ing"):
        word = word[:-3]
    elif len(word) > 4 and word.endswith("ed"):
        word = word[:-2]
    if len(word) > 3 and word.endswith("e"):
        word = word[:-1]
    return word


def _words(text: str) -> list[str]:
    return [_stem(w) for w in _split_words(text)]


def _query_words(query: str) -> list[str]:
    raw = _split_words(query)
    kept = [w for w in raw if w not in _STOP_WORDS] or raw
    return list(dict.fromkeys(_stem(w) for w in kept))


# Per query word: a match in the tool's name outweighs matches everywhere else together.
_WEIGHTS = (("name", 8.0), ("server", 4.0), ("summary", 2.0), ("description", 1.0))


def _score(words: list[str], info: _ToolInfo) -> float:
    score = 0.0
    for word in words:
        for field, weight in _WEIGHTS:
            tokens: frozenset[str] = getattr(info, field)
            if word in tokens:
                score += weight
            elif len(word) >= 3 and any(t.startswith(word) for t in tokens):
                score += weight / 2
    return score


def _with_detail(ref: ToolRef, detail: str) -> ToolRef:
    if detail == "full":
        return ref
    return ToolRef(ref.server, ref.tool, ref.module, ref.summary if detail == "basic" else "")


# --- the workspace ---------------------------------------------------------------------


class WorkspacePathError(ValueError):
    """A path that leads outside the workspace (absolute elsewhere, `..`, a link out)."""


class Workspace:
    """Files in the workspace (/workspace), by paths relative to it.

    Every path is resolved (links followed) and must stay inside the workspace, or the
    call raises `WorkspacePathError` before touching anything; an absolute path is fine
    when it is inside. Writes create the parent directories. The sandbox is what keeps
    the code from the host's files; these rules only catch mistakes early and clearly.
    """

    def __init__(self, root: str | os.PathLike[str] = WORKSPACE_DIR) -> None:
        self._root = os.fspath(root)

    def __repr__(self) -> str:
        return f"Workspace({self._root!r})"

    @property
    def path(self) -> Path:
        """The workspace's root directory."""
        from pathlib import Path

        return Path(self._root)

    def resolve(self, path: str | os.PathLike[str]) -> Path:
        """The absolute path of `path` (relative to the workspace), checked to be inside it.

        Hand it to libraries that take paths: `pandas.read_csv(workspace.resolve("a.csv"))`.

        Raises:
            WorkspacePathError: `path` leads outside the workspace.
        """
        from pathlib import Path

        return Path(self._inside(path))

    def read_text(self, path: str | os.PathLike[str], encoding: str = "utf-8") -> str:
        """The text of a file.

        Raises:
            WorkspacePathError: `path` leads outside the workspace.
            OSError: it cannot be read (FileNotFoundError, IsADirectoryError, ...).
        """
        with open(self._inside(path), encoding=encoding) as f:
            return f.read()

    def read_bytes(self, path: str | os.PathLike[str]) -> bytes:
        """The bytes of a file.

        Raises:
            WorkspacePathError: `path` leads outside the workspace.
            OSError: it cannot be read.
        """
        with open(self._inside(path), "rb") as f:
            return f.read()

    def read_json(self, path: str | os.PathLike[str]) -> Any:
        """A JSON file's value.

        Raises:
            WorkspacePathError: `path` leads outside the workspace.
            OSError: it cannot be read.
            ValueError: it is not JSON (json.JSONDecodeError).
        """
        return json.loads(self.read_text(path))

    def write_text(self, path: str | os.PathLike[str], text: str, encoding: str = "utf-8") -> Path:
        """Write `text` to a file (replacing it); return its absolute path.

        Raises:
            WorkspacePathError: `path` leads outside the workspace.
            OSError: it cannot be written (e.g. the workspace size limit).
        """
        target = self._writable(path)
        with open(target, "w", encoding=encoding) as f:
            f.write(text)
        return target

    def write_bytes(self, path: str | os.PathLike[str], data: bytes) -> Path:
        """Write `data` to a file (replacing it); return its absolute path.

        Raises:
            WorkspacePathError: `path` leads outside the workspace.
            OSError: it cannot be written.
        """
        target = self._writable(path)
        with open(target, "wb") as f:
            f.write(data)
        return target

    def write_json(self, path: str | os.PathLike[str], value: Any) -> Path:
        """Write `value` as JSON (indented by 2, UTF-8); return the file's absolute path.

        Raises:
            WorkspacePathError: `path` leads outside the workspace.
            TypeError: `value` is not JSON-serialisable (nothing is written then).
            OSError: it cannot be written.
        """
        text = json.dumps(value, indent=2, ensure_ascii=False) + "\n"
        return self.write_text(path, text)

    def list(self, pattern: str = "*") -> list[str]:
        """Relative paths of the regular files whose path matches `pattern`, sorted.

        Recursive, like `Path.rglob`: "*" is every file, "*.csv" every CSV file at any
        depth, "out/*.json" the JSON files directly in any directory named out. Links are
        not followed and not listed.

        Raises:
            WorkspacePathError: `pattern` is absolute or has a `..` part.
        """
        from fnmatch import fnmatchcase

        parts = [p for p in pattern.replace(os.sep, "/").split("/") if p not in ("", ".")]
        if pattern.startswith("/") or ".." in parts:
            raise WorkspacePathError(
                f"list({pattern!r}): a pattern is matched inside the workspace; it may not be "
                "absolute or hold '..'"
            )
        parts = parts or ["*"]
        root = os.path.realpath(self._root)
        found: list[str] = []
        for directory, _dirs, files in os.walk(root, followlinks=False):
            relative_dir = os.path.relpath(directory, root)
            prefix = [] if relative_dir == "." else relative_dir.split(os.sep)
            for name in files:
                full = os.path.join(directory, name)
                try:
                    if not stat.S_ISREG(os.lstat(full).st_mode):
                        continue
                except OSError:
                    continue
                segments = [*prefix, name]
                if _match_tail(segments, parts, fnmatchcase):
                    found.append("/".join(segments))
        return sorted(found)

    def exists(self, path: str | os.PathLike[str]) -> bool:
        """Whether `path` exists in the workspace (a file or a directory).

        Raises:
            WorkspacePathError: `path` leads outside the workspace.
        """
        return os.path.exists(self._inside(path))

    def delete(self, path: str | os.PathLike[str], missing_ok: bool = False) -> None:
        """Remove a file (a link is removed, not what it points to) or an empty directory.

        Raises:
            WorkspacePathError: `path` leads outside the workspace, or is its root.
            FileNotFoundError: there is nothing at `path` (unless `missing_ok`).
            OSError: it cannot be removed (e.g. a directory that is not empty).
        """
        text = os.fspath(path)
        root = os.path.realpath(self._root)
        lexical = os.path.normpath(os.path.join(root, text))
        if not _within(lexical, root):
            self._inside(text)  # raises, naming the rule broken
        if lexical == root:
            raise WorkspacePathError(f"{text!r} is the workspace itself: it cannot be deleted")
        # The last part is not resolved: a link is removed, not what it points to.
        parent, name = os.path.split(lexical)
        target = os.path.join(self._inside(parent, asked=text), name)
        try:
            mode = os.lstat(target).st_mode
        except FileNotFoundError:
            if missing_ok:
                return
            raise
        if stat.S_ISDIR(mode):
            os.rmdir(target)
        else:
            os.unlink(target)

    def _inside(self, path: str | os.PathLike[str], asked: str | None = None) -> str:
        """`path` resolved against the root (links followed); it must be inside.

        `asked` is the path the caller was given, if `path` was derived from it: the
        error names it, and the rule it broke.
        """
        text = os.fspath(path)
        if not isinstance(text, str):
            raise TypeError(f"workspace paths are strings, not {type(text).__name__}")
        root = os.path.realpath(self._root)
        target = os.path.realpath(os.path.join(root, text))
        if _within(target, root):
            return target
        text = text if asked is None else asked
        if os.path.isabs(text):
            rule = "an absolute path must be inside the workspace"
        elif not _lexically_inside(text):
            rule = "'..' may not climb above the workspace"
        else:
            rule = "it goes through a symbolic link that points out of the workspace"
        raise WorkspacePathError(
            f"{text!r} is outside the workspace {root}: {rule}; use a path relative to the "
            "workspace, such as 'data/report.csv'"
        )

    def _writable(self, path: str | os.PathLike[str]) -> Path:
        from pathlib import Path

        target = self._inside(path)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        return Path(target)


def _within(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def _lexically_inside(relative: str) -> bool:
    depth = 0
    for part in relative.split(os.sep):
        if part == "..":
            depth -= 1
            if depth < 0:
                return False
        elif part not in ("", "."):
            depth += 1
    return True


def _match_tail(segments: list[str], pattern: list[str], match: Callable[[str, str], bool]) -> bool:
    """Whether `pattern` ("**" = any number of parts) matches the end of `segments`."""

    def at(i: int, j: int) -> bool:
        if j == len(pattern):
            return i == len(segments)
        if pattern[j] == "**":
            return any(at(k, j + 1) for k in range(i, len(segments) + 1))
        return i < len(segments) and match(segments[i], pattern[j]) and at(i + 1, j + 1)

    return any(at(start, 0) for start in range(len(segments)))


workspace = Workspace()
"""The sandbox's workspace, /workspace: the program's files, and what it hands back."""


# --- async and logging -----------------------------------------------------------------


def run_async(coro: Coroutine[Any, Any, _T]) -> _T:
    """Run `coro` to completion and return its value (or raise its exception).

    Works with or without an event loop running in this thread: the code of a run with
    top-level `await` runs inside one, and there the coroutine runs on a new loop in a
    thread of its own while this thread waits (so it must not need this thread's loop).

    Raises:
        Whatever `coro` raises. TypeError: `coro` is not a coroutine.
    """
    import asyncio
    import threading

    if not asyncio.iscoroutine(coro):
        raise TypeError(f"run_async() takes a coroutine, not {type(coro).__name__}")
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    outcome: list[Any] = []

    def target() -> None:
        try:
            outcome.append((True, asyncio.run(coro)))
        except BaseException as exc:
            outcome.append((False, exc))

    thread = threading.Thread(target=target, name="codecage-run-async")
    thread.start()
    thread.join()
    ok, value = outcome[0]
    if not ok:
        raise value
    return value  # type: ignore[no-any-return]


def _make_logger() -> logging.Logger:
    import logging

    class JsonLines(logging.Formatter):
        standard = frozenset(vars(logging.makeLogRecord({}))) | {"message", "asctime"}

        def format(self, record: logging.LogRecord) -> str:
            entry: dict[str, Any] = {"level": record.levelname.lower(), "msg": record.getMessage()}
            for key, value in vars(record).items():
                if key not in self.standard:
                    entry.setdefault(key, value)  # an extra field cannot replace level/msg
            if record.exc_info:
                entry.setdefault("exception", self.formatException(record.exc_info))
            return json.dumps(entry, default=str, ensure_ascii=False)

    class Stderr(logging.Handler):
        """Writes to whatever sys.stderr is at the time (it may be redirected)."""

        def emit(self, record: logging.LogRecord) -> None:
            try:
                line = self.format(record)
                sys.stderr.write(line + "\n")
                sys.stderr.flush()
            except Exception:
                self.handleError(record)

    log = logging.getLogger("agent")
    log.setLevel(logging.INFO)
    log.propagate = False
    if not any(h.name == "codecage" for h in log.handlers):
        handler = Stderr()
        handler.name = "codecage"
        handler.setFormatter(JsonLines())
        log.addHandler(handler)
    return log


def __getattr__(name: str) -> Any:
    # `logger` is made on first use: `logging` costs a few ms at import, and most
    # programs never log. It is then an ordinary module attribute.
    if name == "logger":
        with _bridge_lock:
            made = globals().get("logger")
            if made is None:
                made = globals()["logger"] = _make_logger()
        return made
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
