"""The tool-bridge client: `call_tool`, `call_tool_sync` and `scrub`, over fd 4.

One socket to the host's broker, opened on the first call and shared by every call of the
program (docs/tool-bridge.md). The wire's version, ops, fd and caps are the contract's
(codecage/contract.py), which the host's channel uses too.
"""

from __future__ import annotations

import _thread
import itertools
import json
import os
import stat
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ..contract import (
    BRIDGE_FD,
    BRIDGE_MAX_CLOSED_REASON,
    BRIDGE_MAX_REQUEST_BYTES,
    OP_CALL_TOOL,
    OP_SCRUB,
    WIRE_VERSION,
)

if TYPE_CHECKING:
    from concurrent.futures import Future

_MAX_ANSWER_BYTES = 64 * 1024 * 1024  # a longer answer line ends the channel here
_RECV_BYTES = 256 * 1024
_NO_BRIDGE_HINT = (
    "tool calls work only in code run by `codecage run` or `codecage serve` (give them "
    "--mcp-config to name the upstream MCP servers)"
)


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
        if len(data) > BRIDGE_MAX_REQUEST_BYTES:
            raise ToolCallError(
                "limit",
                f"the request is {len(data) / (1024 * 1024):.1f} MiB, over the bridge's "
                f"{BRIDGE_MAX_REQUEST_BYTES // (1024 * 1024)} MiB per request; pass less (write "
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
            return closed[:BRIDGE_MAX_CLOSED_REASON]
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
    if op == OP_SCRUB:
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
        OP_CALL_TOOL, {"server": server, "tool": tool, "arguments": args}, server, tool
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
    future = _channel().request(OP_SCRUB, {"text": text})
    return future.result()  # type: ignore[no-any-return]


# Public as the package's (codecage.runtime): tracebacks and pickles name it so.
ToolCallError.__module__ = __package__ or ToolCallError.__module__
