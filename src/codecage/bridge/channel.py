"""The host's end of one sandbox's tool bridge: framing, bounds, answers, the call record.

The wire format is in docs/tool-bridge.md. A `Channel` serves one run: a reader thread
takes the guest's requests (JSON lines, each bounded), hands them to a `Responder` (the
broker, or `NoServers` when no upstream servers are configured) and a writer thread sends
the answers back. Nothing the guest sends is trusted: a malformed or oversized line ends
the channel for this run (the code's next call fails with `channel_closed`), and no
guest behaviour can block the responder, which may be shared by many runs.

What one run can cost the host is bounded, whatever its code does with the socket:
memory (a request line, and the answers the code has not read yet: past
`max_unread_bytes` the reader stops reading until the writer drains them, so code that
never reads its answers blocks itself, not the host), work (every request is one of the
run's `max_calls`, a scrub's text is at most `max_scrub_bytes`) and host CPU (what the
channel's threads spend on the run's requests is metered against its budget; past it
the request is refused and the channel closed). A request the host fails on, however it
fails, is answered with an error or ends the channel with a `bridge_closed` event: the
reader never dies silently, leaving the code's calls waiting.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import select
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol

from pydantic import TypeAdapter, ValidationError

from codecage import forks
from codecage.guest.contract import BRIDGE_MAX_CLOSED_REASON, OP_CALL_TOOL, WIRE_VERSION
from codecage.guest.contract import BRIDGE_MAX_REQUEST_BYTES as MAX_REQUEST_BYTES
from codecage.models import Event, wire
from codecage.output import neutralise_text

log = logging.getLogger(__name__)

MAX_DEPTH = 64  # nesting of a request's JSON: tool arguments are shallow; walkers recurse
_MAX_EVENTS = 200  # tool_call events kept per run; the rest are counted in one more event

_REQUEST: TypeAdapter[wire.CallToolRequest | wire.ScrubRequest] = TypeAdapter(wire.BridgeRequest)
"""Parses one request (its line already bounded, its nesting checked)."""


class CallFailed(Exception):
    """A tool call that fails: sent to the guest as `{"ok": false, "error": ...}`."""

    def __init__(self, kind: wire.BridgeErrorKind, message: str) -> None:
        super().__init__(message)
        self.kind: wire.BridgeErrorKind = kind
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
    """Bounds of one run's use of its tool bridge."""

    max_calls: int = 200  # requests of every op: tool calls and scrubs
    max_in_flight: int = 16
    max_result_bytes: int = 4 * 1024 * 1024
    max_scrub_bytes: int = 1024 * 1024  # ~0.3 s of host CPU for text dense in personal data
    # Answers queued for the code and not read yet: past this, the host reads no request.
    max_unread_bytes: int = 1024 * 1024
    # Host CPU the channel may spend on the run's requests (parsing, scrubbing, putting
    # real values back in place of tokens, encoding answers); None: the run's cpu_seconds.
    host_cpu_seconds: float | None = None


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
    """Serves one run's bridge socket from `start()` until `stop()`. `cpu_seconds` is the
    run's CPU limit: the host CPU budget of its requests unless `limits` sets one."""

    def __init__(
        self,
        sock: socket.socket,
        responder: Responder,
        limits: BridgeLimits,
        *,
        cpu_seconds: float | None = None,
    ) -> None:
        self._sock = sock
        self._responder = responder
        self._limits = limits
        budget = limits.host_cpu_seconds
        self._cpu_budget_s = budget if budget is not None else (cpu_seconds or 30.0)
        self._cpu_spent = f"{_CPU_SPENT} ({self._cpu_budget_s:g} s" + (
            ")" if budget is not None else ", as much as the run's CPU limit)"
        )
        # The answers to send, their size in bytes, and whether the writer should end
        # (after sending what is queued, when closing). `_outbox_changed` wakes the writer
        # (a line queued) and the reader (the queue drained below its bound).
        self._outbox: collections.deque[bytes] = collections.deque()
        self._unread_bytes = 0
        self._peak_unread_bytes = 0
        self._writer_ends = False
        self._outbox_changed = threading.Condition()
        self._lock = threading.Lock()
        self._in_flight = 0
        self._calls = 0
        self._cpu_s = 0.0  # host CPU spent on this run's requests (all of the channel's threads)
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
        with self._outbox_changed:
            self._writer_ends = True
            self._outbox.clear()
            self._outbox_changed.notify_all()
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

    @property
    def peak_unread_bytes(self) -> int:
        """The most bytes of answers this channel held for the guest at once."""
        with self._outbox_changed:
            return self._peak_unread_bytes

    @property
    def host_cpu_seconds(self) -> float:
        """Host CPU spent so far on this run's requests."""
        with self._lock:
            return self._cpu_s

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
        started = time.thread_time()
        try:
            self._read_requests(started)
        except Exception as exc:  # a host bug: the code's calls must not wait forever
            log.warning("bridge.reader_failed", extra={"error": _log_field(repr(exc))})
            self._close(f"the host's bridge reader failed ({type(exc).__name__})")

    def _read_requests(self, started: float) -> None:
        """Read and handle requests until the channel ends. The partial line in `buffer`
        is at most MAX_REQUEST_BYTES + one chunk; the answers queued, at most
        `max_unread_bytes` + one answer before the next request is read."""
        buffer = bytearray()
        charged = started
        while not self._stopped.is_set():
            try:
                chunk = self._sock.recv(1 << 16)
            except OSError:
                return
            if not chunk:
                return
            buffer += chunk
            start = 0
            while (newline := buffer.find(b"\n", start)) >= 0:
                line = bytes(buffer[start:newline])
                start = newline + 1
                if not self._wait_for_room():
                    return
                if not self._take(line):
                    return
                now = time.thread_time()
                self._charge(now - charged)
                charged = now
            del buffer[:start]
            if len(buffer) > MAX_REQUEST_BYTES:
                self._close(f"the sandbox sent a request over {_mib(MAX_REQUEST_BYTES)} MiB")
                return

    def _wait_for_room(self) -> bool:
        """Back-pressure: wait until the guest has read its answers down to the bound.
        False: the channel ended meanwhile."""
        with self._outbox_changed:
            while self._unread_bytes > self._limits.max_unread_bytes:
                if self._writer_ends or self._stopped.is_set():
                    return False
                self._outbox_changed.wait(timeout=1.0)
            return not self._writer_ends

    def _take(self, line: bytes) -> bool:
        """Handle one request line; False when the channel had to be closed."""
        if len(line) > MAX_REQUEST_BYTES:
            self._close(f"the sandbox sent a request over {_mib(MAX_REQUEST_BYTES)} MiB")
            return False
        try:
            request = json.loads(line)
        except RecursionError:
            self._close("the sandbox sent a request nested too deeply to parse")
            return False
        except ValueError:
            self._close("the sandbox sent a request that is not JSON")
            return False
        request_id = request.get("id") if isinstance(request, dict) else None
        if type(request_id) is not int:
            self._close("the sandbox sent a request without an integer id")
            return False
        refusal = self._admit_request()
        if refusal is not None:
            self._answer_error(request_id, refusal)
            if refusal.message.startswith(_CPU_SPENT):
                self._close(self._cpu_spent)
                return False
            return True
        if _deeper_than(request, MAX_DEPTH):
            self._answer_error(
                request_id,
                CallFailed("bad_request", f"the request is nested deeper than {MAX_DEPTH} levels"),
            )
            return True
        try:
            self._dispatch(request_id, request, len(line))
        except Exception as exc:  # a responder bug: answer, and keep serving
            log.warning("bridge.request_failed", extra={"error": _log_field(repr(exc))})
            self._answer_error(
                request_id,
                CallFailed(
                    "upstream_error", f"the host failed on this request ({type(exc).__name__})"
                ),
            )
        return True

    def _admit_request(self) -> CallFailed | None:
        """Count the request against the run's budgets: calls, and host CPU."""
        with self._lock:
            if self._cpu_s >= self._cpu_budget_s:
                return CallFailed("limit", f"{self._cpu_spent}; its later calls fail")
            if self._calls >= self._limits.max_calls:
                return CallFailed(
                    "limit",
                    f"this run made its {self._limits.max_calls} tool bridge requests"
                    " (tool calls and scrubs) already",
                )
            self._calls += 1
        return None

    def _charge(self, seconds: float) -> None:
        with self._lock:
            self._cpu_s += seconds

    def _dispatch(self, request_id: int, request: dict[str, Any], size: int) -> None:
        try:
            message = _REQUEST.validate_python(request)
        except ValidationError as exc:
            self._refuse(request_id, request, exc, size)
            return
        if isinstance(message, wire.CallToolRequest):
            self._start_call(request_id, message, size)
        else:
            self._scrub(request_id, message.text)

    def _refuse(
        self, request_id: int, request: dict[str, Any], exc: ValidationError, size: int
    ) -> None:
        """Answer a request that is not one of the models, saying its first fault in the
        order the parts are read: version, op, names, arguments. Bad arguments are a
        call's failure (recorded among the run's tool calls); the rest only an answer."""
        faults = {str(error["loc"][1]) if len(error["loc"]) > 1 else "" for error in exc.errors()}
        op = request.get("op")
        if "v" in faults or request.get("v") != WIRE_VERSION:  # op may be unknown as well
            why = "unknown wire version"
        elif op != OP_CALL_TOOL or "" in faults:
            shown = repr(op)[:200] if isinstance(op, str) else type(op).__name__
            why = f"unknown op {shown}"
        elif faults & {"server", "tool"}:
            why = "server and tool: strings"
        else:
            call = _Call(str(request["server"]), str(request["tool"]), size)
            self._finish(request_id, call, CallFailed("bad_request", "arguments: an object"))
            return
        self._answer_error(request_id, CallFailed("bad_request", why))

    def _scrub(self, request_id: int, text: str) -> None:
        limit = self._limits.max_scrub_bytes
        if len(text) > limit or (
            not text.isascii() and len(text.encode("utf-8", "surrogatepass")) > limit
        ):
            self._answer_error(
                request_id,
                CallFailed(
                    "limit",
                    f"scrub() takes at most {_mib(self._limits.max_scrub_bytes)} MiB of text"
                    " per call; scrub it in parts",
                ),
            )
            return
        self._answer(request_id, self._responder.scrub(text))

    def _start_call(self, request_id: int, request: wire.CallToolRequest, size: int) -> None:
        call = _Call(request.server, request.tool, size)
        refusal = self._admit()
        if refusal is not None:
            self._finish(request_id, call, refusal)
            return
        try:
            future = self._responder.call_tool(request.server, request.tool, request.arguments)
        except Exception as exc:  # CallFailed, or a responder bug: the call ends here
            self._release()
            if not isinstance(exc, CallFailed):
                log.warning("bridge.responder_failed", extra={"error": _log_field(repr(exc))})
                exc = CallFailed(
                    "upstream_error", f"the host failed on this call ({type(exc).__name__})"
                )
            self._finish(request_id, call, exc)
            return
        future.add_done_callback(lambda done: self._on_done(request_id, call, done))

    def _admit(self) -> CallFailed | None:
        with self._lock:
            if self._in_flight >= self._limits.max_in_flight:
                return CallFailed(
                    "limit",
                    f"{self._limits.max_in_flight} tool calls are running already; await some",
                )
            self._in_flight += 1
        return None

    def _release(self) -> None:
        with self._lock:
            self._in_flight -= 1

    def _on_done(self, request_id: int, call: _Call, done: Future[ToolAnswer]) -> None:
        # Runs on the responder's thread: do no I/O here, only queue the answer.
        started = time.thread_time()
        self._release()
        try:
            answer = done.result()
        except CallFailed as exc:
            self._finish(request_id, call, exc)
        except Exception as exc:  # a responder bug must not kill the channel
            log.warning("bridge.responder_failed", extra={"error": _log_field(repr(exc))})
            self._finish(request_id, call, CallFailed("upstream_error", str(exc)[:500]))
        else:
            self._finish(request_id, call, answer)
        self._charge(time.thread_time() - started)  # encoding the answer: this run's work

    # --- answering --------------------------------------------------------------------

    def _finish(self, request_id: int, call: _Call, outcome: ToolAnswer | CallFailed) -> None:
        line = b""
        if isinstance(outcome, ToolAnswer):
            try:
                line = _line(wire.BridgeAnswer(id=request_id, result=outcome.to_wire()).to_dict())
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
        self._send(_line(wire.BridgeAnswer(id=request_id, result=result).to_dict()))

    def _answer_error(self, request_id: int, error: CallFailed) -> None:
        self._send(_error_line(request_id, error))

    def _send(self, line: bytes) -> None:
        with self._outbox_changed:
            if self._writer_ends or self._stopped.is_set():
                return
            self._outbox.append(line)
            self._unread_bytes += len(line)
            self._peak_unread_bytes = max(self._peak_unread_bytes, self._unread_bytes)
            self._outbox_changed.notify_all()

    def _write_loop(self) -> None:
        started = time.thread_time()
        try:
            self._write_answers()
        finally:
            self._charge(time.thread_time() - started)
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)  # the guest's reader sees the end
            with self._outbox_changed:
                self._writer_ends = True  # and the reader stops waiting for room
                self._outbox.clear()
                self._unread_bytes = 0
                self._outbox_changed.notify_all()

    def _write_answers(self) -> None:
        """Send queued answers in order until the channel ends (after the queued ones,
        when it is closed; at once, when it is stopped)."""
        while True:
            with self._outbox_changed:
                while not self._outbox and not self._writer_ends:
                    self._outbox_changed.wait()
                if not self._outbox:
                    return
                line = self._outbox[0]
            try:
                self._sock.sendall(line)
            except OSError:
                return
            with self._outbox_changed:
                if self._outbox and self._outbox[0] is line:
                    self._outbox.popleft()
                    self._unread_bytes -= len(line)
                self._outbox_changed.notify_all()

    def _close(self, reason: str) -> None:
        """End the channel for this run: the guest gets the answers already queued, then
        a last line saying why, then the end of the stream (at once, if it reads them)."""
        log.info("bridge.closed", extra={"reason": reason})
        closed = f"the tool bridge was closed: {reason}"
        with self._lock:
            if self._closed_reason is not None:
                return
            self._closed_reason = closed
        notice = _line(wire.BridgeClosed(closed=closed[:BRIDGE_MAX_CLOSED_REASON]).model_dump())
        with self._outbox_changed:
            if not self._writer_ends:
                self._outbox.append(notice)
                self._unread_bytes += len(notice)
            self._writer_ends = True
            self._outbox_changed.notify_all()

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


def _close_parents_epoll(copy: _Watcher) -> None:
    with contextlib.suppress(OSError):
        copy.close_epoll()


# A forked child has the parent's watcher but not its thread: it makes its own.
_watchers = forks.PerProcess(_Watcher, forget=_close_parents_epoll)


def watcher() -> _Watcher:
    """The process's bridge watcher: made at first use, kept until exit."""
    return _watchers.get()


_CPU_SPENT = "this run's tool bridge used its budget of host CPU"


def _mib(size: int) -> str:
    return f"{size / (1024 * 1024):g}"


def _log_field(text: str, limit: int = 300) -> str:
    """Guest-influenced text for one field of one log line: bounded, and with every
    character that could forge a line or act on a terminal escaped."""
    return neutralise_text(text[:limit]).replace("\n", "\\n").replace("\t", "\\t")


def _deeper_than(value: Any, limit: int) -> bool:
    """Whether `value` (parsed JSON) nests containers deeper than `limit` (iteratively: the
    point is not to recurse)."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item
        for child in children:
            if isinstance(child, dict | list):
                if depth >= limit:
                    return True
                stack.append((child, depth + 1))
    return False


def _line(message: dict[str, Any]) -> bytes:
    # ASCII: a lone surrogate in an upstream's text must not break the encoding.
    return (json.dumps(message, ensure_ascii=True, allow_nan=False) + "\n").encode("ascii")


def _error_line(request_id: int, error: CallFailed) -> bytes:
    body = wire.BridgeErrorInfo(kind=error.kind, message=error.message[:4000])
    return _line(wire.BridgeFailure(id=request_id, error=body).model_dump())
