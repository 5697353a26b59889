"""The host's end of one sandbox's tool bridge: framing, bounds, answers, the call record.

The wire format is in docs/tool-bridge.md. A `Channel` serves one run: a reader thread
takes the guest's requests (JSON lines, each bounded), hands them to a `Responder` (the
broker, or `NoServers` when no upstream servers are configured) and a writer thread sends
the answers back. Nothing the guest sends is trusted: a malformed or oversized line ends
the channel for this run (the code's next call fails with `channel_closed`), and no
guest behaviour can block the responder, which may be shared by many runs.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import select
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from codecage.models import Event

log = logging.getLogger(__name__)

WIRE_VERSION = 1
MAX_REQUEST_BYTES = 4 * 1024 * 1024
_MAX_EVENTS = 200  # tool_call events kept per run; the rest are counted in one more event

ErrorKind = Literal[
    "bad_request",
    "no_servers",
    "unknown_server",
    "not_allowed",
    "limit",
    "timeout",
    "tool_error",
    "upstream_error",
]


class CallFailed(Exception):
    """A tool call that fails: sent to the guest as `{"ok": false, "error": ...}`."""

    def __init__(self, kind: ErrorKind, message: str) -> None:
        super().__init__(message)
        self.kind: ErrorKind = kind
        self.message = message


@dataclass(frozen=True, slots=True)
class ToolAnswer:
    """What a tool sent back: its structured content (or None) and its text."""

    structured: Any
    text: str

    def to_wire(self) -> dict[str, Any]:
        return {"structured": self.structured, "text": self.text, "is_error": False}


class Responder(Protocol):
    """What answers a run's requests: the broker's per-run view, or `NoServers`."""

    def call_tool(self, server: str, tool: str, arguments: dict[str, Any]) -> Future[ToolAnswer]:
        """Start the call; the future fails with `CallFailed` when the call does."""
        ...

    def scrub(self, text: str) -> str: ...


@dataclass(frozen=True, slots=True)
class BridgeLimits:
    """Bounds of one run's tool calls."""

    max_calls: int = 200
    max_in_flight: int = 16
    max_result_bytes: int = 4 * 1024 * 1024


class NoServers:
    """The responder of a sandbox run without upstream servers: scrub works, calls do not."""

    def __init__(self, scrub: Callable[[str], str]) -> None:
        self._scrub = scrub

    def call_tool(self, server: str, tool: str, arguments: dict[str, Any]) -> Future[ToolAnswer]:
        future: Future[ToolAnswer] = Future()
        future.set_exception(
            CallFailed(
                "no_servers",
                "no upstream MCP servers are configured for this sandbox; start codecage"
                " with --mcp-config FILE to call tools",
            )
        )
        return future

    def scrub(self, text: str) -> str:
        return self._scrub(text)


@dataclass(slots=True)
class _Call:
    server: str
    tool: str
    request_bytes: int
    started: float = field(default_factory=time.monotonic)


class Channel:
    """Serves one run's bridge socket from `start()` until `stop()`."""

    def __init__(self, sock: socket.socket, responder: Responder, limits: BridgeLimits) -> None:
        self._sock = sock
        self._responder = responder
        self._limits = limits
        self._outbox: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._in_flight = 0
        self._calls = 0
        self._events: list[Event] = []
        self._dropped_events = 0
        self._closed_reason: str | None = None
        self._stopped = threading.Event()
        self._serving = threading.Lock()  # orders `_serve` (the watcher's) and `stop`
        self._threads = [
            threading.Thread(target=self._read_loop, name="codecage-bridge-read", daemon=True),
            threading.Thread(target=self._write_loop, name="codecage-bridge-write", daemon=True),
        ]

    def start(self) -> None:
        """Serve the socket from the moment the guest first writes to it. Most runs never
        call a tool, and two threads started and joined per run cost ~1 ms of a warm run's
        ~3 ms, so one shared watcher waits for the first byte instead."""
        watcher().watch(self._sock.fileno(), self._serve)

    def stop(self) -> list[Event]:
        """End the channel (the run is over) and return its events. Calls still running
        upstream go on in the broker, but their answers go nowhere."""
        with self._serving:
            self._stopped.set()
            served = self._threads[0].ident is not None
        if not served:
            watcher().forget(self._sock.fileno(), self._serve)
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._outbox.put(None)
        for thread in self._threads if served else ():
            thread.join(timeout=5)
        with self._lock:
            events = list(self._events)
            if self._dropped_events:
                events.append(
                    Event(
                        kind="tool_call",
                        detail=f"{self._dropped_events} more tool calls (not listed one by one)",
                    )
                )
            if self._closed_reason is not None:
                events.append(Event(kind="bridge_closed", detail=self._closed_reason[:2000]))
        return events

    def _serve(self) -> None:
        """The guest wrote (or hung up): start the reader and the writer, unless the run
        is already over or the guest only hung up (its process ended before the host
        stopped the channel: no request to serve)."""
        try:
            if not self._sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT):
                return
        except BlockingIOError:
            pass  # woken without data: serving costs only the threads
        except OSError:
            return
        with self._serving:
            if self._stopped.is_set() or self._threads[0].ident is not None:
                return
            for thread in self._threads:
                thread.start()

    # --- reading ----------------------------------------------------------------------

    def _read_loop(self) -> None:
        buffer = bytearray()
        while not self._stopped.is_set():
            try:
                chunk = self._sock.recv(1 << 16)
            except OSError:
                return
            if not chunk:
                return
            buffer += chunk
            while (newline := buffer.find(b"\n")) >= 0:
                line = bytes(buffer[:newline])
                del buffer[: newline + 1]
                if not self._take(line):
                    return
            if len(buffer) > MAX_REQUEST_BYTES:
                self._close(f"a request over {MAX_REQUEST_BYTES // (1024 * 1024)} MiB")
                return

    def _take(self, line: bytes) -> bool:
        """Handle one request line; False when the channel had to be closed."""
        if len(line) > MAX_REQUEST_BYTES:
            self._close(f"a request over {MAX_REQUEST_BYTES // (1024 * 1024)} MiB")
            return False
        try:
            request = json.loads(line)
        except ValueError:
            self._close("a request that is not JSON")
            return False
        request_id = request.get("id") if isinstance(request, dict) else None
        if type(request_id) is not int:
            self._close("a request without an integer id")
            return False
        self._dispatch(request_id, request, len(line))
        return True

    def _dispatch(self, request_id: int, request: dict[str, Any], size: int) -> None:
        op = request.get("op")
        if request.get("v") != WIRE_VERSION:
            self._answer_error(request_id, CallFailed("bad_request", "unknown wire version"))
        elif op == "scrub" and isinstance(request.get("text"), str):
            self._answer(request_id, self._responder.scrub(request["text"]))
        elif op == "call_tool":
            self._start_call(request_id, request, size)
        else:
            self._answer_error(request_id, CallFailed("bad_request", f"unknown op {op!r}"))

    def _start_call(self, request_id: int, request: dict[str, Any], size: int) -> None:
        server, tool = request.get("server"), request.get("tool")
        arguments = request.get("arguments") or {}
        if not isinstance(server, str) or not isinstance(tool, str):
            self._answer_error(request_id, CallFailed("bad_request", "server and tool: strings"))
            return
        call = _Call(server, tool, size)
        if not isinstance(arguments, dict):
            self._finish(request_id, call, CallFailed("bad_request", "arguments: an object"))
            return
        refusal = self._admit()
        if refusal is not None:
            self._finish(request_id, call, refusal)
            return
        try:
            future = self._responder.call_tool(server, tool, arguments)
        except CallFailed as exc:
            self._release()
            self._finish(request_id, call, exc)
            return
        future.add_done_callback(lambda done: self._on_done(request_id, call, done))

    def _admit(self) -> CallFailed | None:
        with self._lock:
            if self._calls >= self._limits.max_calls:
                return CallFailed(
                    "limit", f"this run made its {self._limits.max_calls} tool calls already"
                )
            if self._in_flight >= self._limits.max_in_flight:
                return CallFailed(
                    "limit",
                    f"{self._limits.max_in_flight} tool calls are running already; await some",
                )
            self._calls += 1
            self._in_flight += 1
        return None

    def _release(self) -> None:
        with self._lock:
            self._in_flight -= 1

    def _on_done(self, request_id: int, call: _Call, done: Future[ToolAnswer]) -> None:
        # Runs on the responder's thread: do no I/O here, only queue the answer.
        self._release()
        try:
            answer = done.result()
        except CallFailed as exc:
            self._finish(request_id, call, exc)
        except Exception as exc:  # a responder bug must not kill the channel
            log.exception("bridge.responder_failed")
            self._finish(request_id, call, CallFailed("upstream_error", str(exc)[:500]))
        else:
            self._finish(request_id, call, answer)

    # --- answering --------------------------------------------------------------------

    def _finish(self, request_id: int, call: _Call, outcome: ToolAnswer | CallFailed) -> None:
        line = b""
        if isinstance(outcome, ToolAnswer):
            try:
                line = _line(
                    {"v": WIRE_VERSION, "id": request_id, "ok": True, "result": outcome.to_wire()}
                )
            except (TypeError, ValueError):
                outcome = CallFailed("upstream_error", "the tool's result is not JSON")
        if isinstance(outcome, ToolAnswer) and len(line) > self._limits.max_result_bytes:
            size_mb = len(line) / (1024 * 1024)
            outcome = CallFailed(
                "limit",
                f"the result of {call.server}.{call.tool} is {size_mb:.1f} MiB, over the"
                f" {self._limits.max_result_bytes / (1024 * 1024):g} MiB limit per call;"
                " ask the tool for less (a filter, a page)",
            )
        if isinstance(outcome, CallFailed):
            line = _error_line(request_id, outcome)
        self._record(call, outcome, len(line))
        self._send(line)

    def _answer(self, request_id: int, result: Any) -> None:
        self._send(_line({"v": WIRE_VERSION, "id": request_id, "ok": True, "result": result}))

    def _answer_error(self, request_id: int, error: CallFailed) -> None:
        self._send(_error_line(request_id, error))

    def _send(self, line: bytes) -> None:
        if not self._stopped.is_set():
            self._outbox.put(line)

    def _write_loop(self) -> None:
        while (line := self._outbox.get()) is not None:
            try:
                self._sock.sendall(line)
            except OSError:
                return

    def _close(self, reason: str) -> None:
        log.info("bridge.closed", extra={"reason": reason})
        with self._lock:
            self._closed_reason = f"the tool bridge was closed: the sandbox sent {reason}"
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)

    def _record(self, call: _Call, outcome: ToolAnswer | CallFailed, answer_bytes: int) -> None:
        status = "ok" if isinstance(outcome, ToolAnswer) else outcome.kind
        duration_ms = round((time.monotonic() - call.started) * 1000, 1)
        data = {
            "server": call.server[:200],
            "tool": call.tool[:200],
            "status": status,
            "duration_ms": duration_ms,
            "request_bytes": call.request_bytes,
            "result_bytes": answer_bytes,
        }
        detail = f"{call.server[:200]}.{call.tool[:200]}: {status} in {duration_ms:g} ms"
        if isinstance(outcome, CallFailed):
            detail += f" ({outcome.message[:300]})"
        with self._lock:
            if len(self._events) >= _MAX_EVENTS:
                self._dropped_events += 1
                return
            self._events.append(Event(kind="tool_call", detail=detail[:2000], data=data))


class _Watcher:
    """One thread for the whole process that waits for the first byte on the bridge
    sockets of runs that have not used their bridge yet, and starts serving them."""

    def __init__(self) -> None:
        self._epoll = select.epoll()
        self._lock = threading.Lock()
        self._waiting: dict[int, Callable[[], None]] = {}
        threading.Thread(target=self._loop, name="codecage-bridge-watch", daemon=True).start()

    def watch(self, fd: int, serve: Callable[[], None]) -> None:
        events = select.EPOLLIN | select.EPOLLONESHOT
        with self._lock:
            self._waiting[fd] = serve
            try:
                self._epoll.register(fd, events)
            except FileExistsError:  # this socket was watched before: arm it again
                self._epoll.modify(fd, events)

    def forget(self, fd: int, serve: Callable[[], None]) -> None:
        with self._lock:
            if self._waiting.get(fd) == serve:
                del self._waiting[fd]
                with contextlib.suppress(OSError):
                    self._epoll.unregister(fd)

    def close_epoll(self) -> None:
        self._epoll.close()

    def _loop(self) -> None:
        while True:
            for fd, _ in self._epoll.poll():
                with self._lock:
                    serve = self._waiting.pop(fd, None)
                    if serve is not None:
                        with contextlib.suppress(OSError):
                            self._epoll.unregister(fd)
                if serve is not None:
                    serve()


_watcher: _Watcher | None = None
_watcher_lock = threading.Lock()


def watcher() -> _Watcher:
    """The process's bridge watcher: made at first use, kept until exit."""
    global _watcher
    with _watcher_lock:
        if _watcher is None:
            _watcher = _Watcher()
        return _watcher


def _forget_watcher_in_child() -> None:
    """A forked child has the parent's watcher but not its thread: it makes its own."""
    global _watcher, _watcher_lock
    if _watcher is not None:
        with contextlib.suppress(OSError):
            _watcher.close_epoll()
    _watcher, _watcher_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_watcher_in_child)


def _line(message: dict[str, Any]) -> bytes:
    # ASCII: a lone surrogate in an upstream's text must not break the encoding.
    return (json.dumps(message, ensure_ascii=True, allow_nan=False) + "\n").encode("ascii")


def _error_line(request_id: int, error: CallFailed) -> bytes:
    body = {"kind": error.kind, "message": error.message[:4000]}
    return _line({"v": WIRE_VERSION, "id": request_id, "ok": False, "error": body})
