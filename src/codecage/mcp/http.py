"""Serving the MCP app over HTTP without letting a client exhaust the process.

uvicorn on its own holds a connection that never sends a request forever, accepts
connections until the process runs out of descriptors (then asyncio logs one traceback per
failed accept, thousands a second), and the SDK buffers any body up to its size cap however
slowly it arrives. Here:

- every connection must send a whole request's headers within `HEADER_TIMEOUT` (on a kept-
  alive connection too, from the end of the previous response): trickling header bytes does
  not reset the clock;
- at most `MAX_CONNECTIONS` are open; at the cap the connection idle the longest (no request
  in progress) is closed for the new one, and when every connection is busy the new one gets
  a `503` with `Retry-After`, so the descriptors in use stay bounded. A connection turned
  away (the new one, or an evicted one: its next request may be on the way) gets that `503`
  and a *lingering* close: its request is read and dropped for up to `LINGER_S`,
  since closing on unread bytes sends a reset that destroys the `503` before the client
  reads it (1000 clients at once: 872 got a bare connection reset, no answer at all);
- `RequestGate` checks the bearer token on the headers alone (one Authorization header, all
  headers within `MAX_HEADER_BYTES`): an unauthenticated request's body is never read (the
  `401` closes the connection). An accepted body must arrive within
  `BODY_IDLE_TIMEOUT` per gap and `BODY_TIMEOUT_BASE` + size / `BODY_MIN_RATE` in total,
  and all bodies being read or served together hold at most `MAX_BODY_BYTES_IN_FLIGHT`;
- RLIMIT_NOFILE's soft limit is raised to the hard one at start, the connection cap kept
  `FD_RESERVE` below it, and log records of WARNING and above repeat at most once per
  `LOG_REPEAT_INTERVAL` per message (with a count of the ones left out).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import resource
import time
from collections.abc import Callable
from http import HTTPStatus
from pathlib import Path
from typing import Any, ClassVar

import anyio
import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from codecage.mcp.callers import SCOPE_CLIENT_KEY
from codecage.mcp.clients import ClientTokens

log = logging.getLogger(__name__)

# The numbers (docs/mcp.md, "Limits of the HTTP server"). ---------------------------------
MAX_CONNECTIONS = 128
"""HTTP connections open at once; the cap is lowered to stay `FD_RESERVE` under the
descriptor limit."""
FD_RESERVE = 256
"""Descriptors kept for the rest of the process: sandboxes, pipes, the warm pool, logs."""
HEADER_TIMEOUT = 10.0
"""Seconds a connection has to send a whole request's headers (new, or kept alive)."""
KEEP_ALIVE_TIMEOUT = 5
"""Seconds a kept-alive connection that sends nothing stays open (uvicorn's own timer)."""
LINGER_S = HEADER_TIMEOUT
"""Seconds a turned-away connection is read (and its bytes dropped) after its `503`: as
long as any connection has to send its headers (a busy client may send its request late;
closing before it arrives resets the connection, and the `503` is lost with it)."""
MAX_LINGERING = 1024
"""Turned-away connections lingering at once (lowered to fit the descriptor limit); past
it, one is closed at once. 1000 clients at once against 128 connections: 864 lingered."""
MAX_HEADER_BYTES = 16 * 1024
"""The request line and headers of one request, at most."""
BODY_IDLE_TIMEOUT = 10.0
"""Seconds a request body may go without a byte arriving."""
BODY_TIMEOUT_BASE = 10.0
BODY_MIN_RATE = 256 * 1024
"""A body of n bytes must arrive within BODY_TIMEOUT_BASE + n / BODY_MIN_RATE seconds (32 MiB:
138 s)."""
MAX_BODY_BYTES_IN_FLIGHT = 128 * 1024 * 1024
"""Request bodies read or being served at once, in bytes (four of the largest)."""
MAX_SESSIONS = 100
"""Stateful MCP sessions (protocols before 2026-07-28) open at once; at the cap the session
idle the longest is closed for the new one."""
SESSION_IDLE_TIMEOUT = 30 * 60.0
"""Seconds a session without a request in flight lives on (the SDK's default)."""
SESSION_EVICTABLE_AFTER_S = HEADER_TIMEOUT
"""Seconds a session must have been idle before a new one may close it at the cap: a client
between its initialize and its first call is not idle (evicted there, 11 of 27,000 calls of
a 30-minute soak got "404 session not found"); the new one gets a 503 instead."""
RETRY_AFTER_S = 1
"""The `Retry-After` of every busy refusal (`503`)."""
LOG_REPEAT_INTERVAL = 10.0
"""A warning or error with the same message is logged at most once per this many seconds."""


def raise_fd_limit() -> int:
    """Raise RLIMIT_NOFILE's soft limit to the hard one (a sandbox sets its own); the soft
    limit in force afterwards."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if target > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):
            return soft
        return target
    return soft


def connection_cap(fd_limit: int, wanted: int = MAX_CONNECTIONS) -> int:
    """`wanted`, lowered to stay `FD_RESERVE` under the descriptor limit (at least 8)."""
    return max(8, min(wanted, fd_limit - FD_RESERVE))


def lingering_cap(fd_limit: int, connections: int, wanted: int = MAX_LINGERING) -> int:
    """`wanted`, lowered so that it and `connections` stay `FD_RESERVE` under the limit."""
    return max(8, min(wanted, fd_limit - FD_RESERVE - connections))


# --- log flood control ----------------------------------------------------------------------


class RepeatLimiter(logging.Filter):
    """Lets a WARNING-or-worse record through at most once per `interval` per (logger,
    message template); the next one let through says how many were left out. Records below
    WARNING (the per-call INFO lines) always pass."""

    def __init__(self, interval: float = LOG_REPEAT_INTERVAL) -> None:
        super().__init__()
        self.interval = interval
        self._last: dict[tuple[str, str], tuple[float, int]] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        decided = getattr(record, "_codecage_repeat", None)
        if decided is not None:  # the same record, at a second handler
            return bool(decided)
        record._codecage_repeat = passed = self._passes(record)
        return passed

    def _passes(self, record: logging.LogRecord) -> bool:
        key = (record.name, str(record.msg)[:200])
        now = time.monotonic()
        last, suppressed = self._last.get(key, (-self.interval, 0))
        if now - last < self.interval:
            self._last[key] = (last, suppressed + 1)
            return False
        if len(self._last) > 1024:  # many distinct messages: forget the old ones
            self._last.clear()
        self._last[key] = (now, 0)
        if suppressed:
            gap = now - last
            record.msg = f"{record.msg} ({suppressed} more like this in the last {gap:.0f} s)"
        return True


def limit_log_repeats(interval: float = LOG_REPEAT_INTERVAL) -> RepeatLimiter:
    """Install one `RepeatLimiter` on every handler in use (root's and uvicorn's own): a
    filter on a handler sees the records of every logger that reaches it."""
    limiter = RepeatLimiter(interval)
    loggers = [logging.getLogger(), *(logging.getLogger(n) for n in ("uvicorn", "uvicorn.error"))]
    loggers.append(logging.getLogger("uvicorn.access"))
    for logger in loggers:
        for handler in logger.handlers:
            if limiter not in handler.filters:
                handler.addFilter(limiter)
    return limiter


# --- connections: a header deadline, and a cap with eviction of the idle ---------------------

_FULL_BODY = b'{"error": "the server has too many connections open; try again shortly"}'
_FULL = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
    b"retry-after: 1\r\nconnection: close\r\ncontent-length: %d\r\n\r\n%s"
) % (len(_FULL_BODY), _FULL_BODY)


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a request-header deadline and a connection cap.

    A connection is *idle* while no request is in progress on it: from accept until its
    request's headers are complete, and again after each response. Idle connections are
    kept in `_idle` (oldest first) and are the ones closed at the cap or at the deadline.
    Subclassed per server by `protocol_class`, which sets the class attributes.
    """

    max_connections: ClassVar[int] = MAX_CONNECTIONS
    max_lingering: ClassVar[int] = MAX_LINGERING
    header_timeout: ClassVar[float] = HEADER_TIMEOUT
    _idle: ClassVar[dict[GuardedH11Protocol, None]] = {}
    _lingering: ClassVar[set[GuardedH11Protocol]] = set()

    _deadline: asyncio.TimerHandle | None = None
    _turned_away = False  # answered 503: what it sends from now on is dropped

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        full = len(self.connections) >= self.max_connections
        super().connection_made(transport)
        if full and not self._evict_oldest_idle():
            # Every connection is serving a request: refuse this one, and free its descriptor.
            log.warning("server.http_connections_full", extra={"max": self.max_connections})
            self._turn_away()
            return
        self._become_idle()

    def data_received(self, data: bytes) -> None:
        if not self._turned_away:
            super().data_received(data)

    def handle_events(self) -> None:
        before = self.cycle
        super().handle_events()
        if self.cycle is not before and self.cycle is not None:
            self._become_busy()  # a request's headers are complete; the app has it

    def on_response_complete(self) -> None:
        super().on_response_complete()  # may start a pipelined request (handle_events)
        if not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
            self._become_idle()

    def connection_lost(self, exc: Exception | None) -> None:
        self._become_busy()
        self._lingering.discard(self)
        super().connection_lost(exc)

    def _become_idle(self) -> None:
        self._idle.pop(self, None)
        self._idle[self] = None
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline = self.loop.call_later(self.header_timeout, self._drop_if_idle)

    def _become_busy(self) -> None:
        self._idle.pop(self, None)
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _drop_if_idle(self) -> None:
        if self in self._idle:
            self._drop()

    def _evict_oldest_idle(self) -> bool:
        for oldest in self._idle:
            # Its next request may be on the way: it gets the 503. (A client that kept the
            # connection alive and sends nothing sees it readable, and opens a new one.)
            oldest._turn_away()
            return True
        return False

    def _turn_away(self) -> None:
        """Answer `503` + `Retry-After`, stop sending, and read what the client still sends
        (dropped) until it closes or `LINGER_S` passes. Past `max_lingering` of them at
        once, close at once instead (the client may then see a reset): the descriptors stay
        bounded."""
        self._become_busy()
        self.connections.discard(self)
        self._turned_away = True
        if self.transport.is_closing():
            return
        self.transport.write(_FULL)
        if len(self._lingering) >= self.max_lingering or not self.transport.can_write_eof():
            self.transport.close()
            return
        try:
            self.transport.write_eof()  # the client reads the 503, then closes: eof_received
        except OSError:  # the client is gone already (a reset): nothing to wait for
            self.transport.close()
            return
        self._lingering.add(self)
        self._deadline = self.loop.call_later(LINGER_S, self.transport.close)

    def _drop(self) -> None:
        """Close now, and stop counting it (connection_lost comes on a later loop turn)."""
        self._become_busy()
        self.connections.discard(self)
        if not self.transport.is_closing():
            if self.conn.our_state in (h11.IDLE, h11.DONE):
                self.conn.send(h11.ConnectionClosed())
            self.transport.close()


def protocol_class(
    max_connections: int,
    header_timeout: float = HEADER_TIMEOUT,
    max_lingering: int = MAX_LINGERING,
) -> type:
    """A `GuardedH11Protocol` for one server: its own caps, deadline and registries."""
    return type(
        "GuardedH11Protocol",
        (GuardedH11Protocol,),
        {
            "max_connections": max_connections,
            "max_lingering": max_lingering,
            "header_timeout": header_timeout,
            "_idle": {},
            "_lingering": set(),
        },
    )


# --- requests: the token on the headers, then a bounded body ---------------------------------


class _Held:
    """The body bytes one request has reserved in `RequestGate.in_flight`."""

    bytes: int = 0


class _Refused(Exception):
    def __init__(self, status: int, message: str, *headers: tuple[bytes, bytes]) -> None:
        super().__init__(message)
        self.status = status
        self.headers = list(headers)


class RequestGate:
    """ASGI middleware in front of the MCP app.

    The bearer token (when there is one) is checked on the headers alone, and a refused
    request's body is never read: the `401` closes the connection. Then the body is read
    here, whole, under a size cap (`413`), the in-flight byte budget (`503`) and the body
    timeouts (`408`), and handed to the app. All these refusals close the connection.
    """

    def __init__(
        self,
        app: Any,
        *,
        token: str | None = None,
        tokens: ClientTokens | None = None,
        max_body_bytes: int,
        max_in_flight: int = MAX_BODY_BYTES_IN_FLIGHT,
        body_idle_timeout: float = BODY_IDLE_TIMEOUT,
    ) -> None:
        self.app = app
        # `token` alone is the one client "default"; `tokens` names every client.
        self._tokens = tokens or ClientTokens.load({}, token)
        self.max_body_bytes = max_body_bytes
        self.max_in_flight = max_in_flight
        self.body_idle_timeout = body_idle_timeout
        self.in_flight = 0

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        held = _Held()
        try:
            raw_headers = scope.get("headers") or []
            _check_headers(raw_headers)
            headers = dict(raw_headers)
            if self._tokens is not None:
                client = self._tokens.identify(headers.get(b"authorization", b""))
                if client is None:
                    raise _Refused(
                        401,
                        "unauthorized: send Authorization: Bearer <token>",
                        (b"www-authenticate", b"Bearer"),
                    )
                scope[SCOPE_CLIENT_KEY] = client  # who, for the audit trail and its limits
            declared = self._declared_length(headers)
            body = await self._read_body(receive, declared, held)
        except _Refused as refused:
            self.in_flight -= held.bytes
            await _refuse(send, refused)
            return
        replayed = False

        async def replay() -> Any:
            nonlocal replayed
            if replayed:
                return await receive()  # after the body: the disconnect, when it comes
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        try:
            await self.app(scope, replay, _with_retry_after(_with_a_reason(send, scope)))
        finally:
            self.in_flight -= held.bytes

    def _declared_length(self, headers: dict[bytes, bytes]) -> int | None:
        raw = headers.get(b"content-length")
        if raw is None:
            return None
        if not raw.isdigit():
            raise _Refused(400, "bad Content-Length")
        length = int(raw)
        if length > self.max_body_bytes:
            raise _Refused(413, f"the request body is over {self.max_body_bytes} bytes")
        return length

    def _reserve(self, held: _Held, size: int) -> None:
        if self.in_flight + size > self.max_in_flight:
            raise _Refused(
                503,
                "the server is reading too many request bodies; try again shortly",
                (b"retry-after", b"1"),
            )
        self.in_flight += size
        held.bytes += size

    async def _read_body(self, receive: Any, declared: int | None, held: _Held) -> bytes:
        """The whole body, reserved in the budget as it arrives: a body that trickles holds
        only what it sent, and cannot keep others out by what it declared."""
        size_for_deadline = declared if declared is not None else self.max_body_bytes
        chunks: list[bytes] = []
        received = 0
        with anyio.move_on_after(BODY_TIMEOUT_BASE + size_for_deadline / BODY_MIN_RATE) as total:
            while True:
                with anyio.move_on_after(self.body_idle_timeout) as gap:
                    message = await receive()
                if gap.cancelled_caught:
                    break
                if message["type"] == "http.disconnect":
                    raise _Refused(400, "the client went away")  # nobody reads the answer
                chunk = message.get("body", b"")
                received += len(chunk)
                if received > (declared if declared is not None else self.max_body_bytes):
                    raise _Refused(413, f"the request body is over {self.max_body_bytes} bytes")
                self._reserve(held, len(chunk))
                chunks.append(chunk)
                if not message.get("more_body", False):
                    return b"".join(chunks)
        if total.cancelled_caught:
            raise _Refused(408, "the request body did not arrive in time")
        raise _Refused(408, f"no byte of the request body came for {self.body_idle_timeout:g} s")


def _with_a_reason(send: Any, scope: dict[str, Any]) -> Any:
    """`send`, giving an error that has no body a short JSON one: the SDK answers some
    requests with a bare status (a GET under the stateless protocol era: `405` and
    nothing else), and every refusal should say what it refused. A HEAD has no body."""
    if scope.get("method") == "HEAD":
        return send
    held: dict[str, Any] | None = None

    async def sending(message: dict[str, Any]) -> None:
        nonlocal held
        if message["type"] == "http.response.start" and message.get("status", 200) >= 400:
            held = message  # sent with the first body, once its size is known
            return
        if held is not None and message["type"] == "http.response.body":
            start, held = held, None
            body = message.get("body", b"")
            if not body and not message.get("more_body", False):
                await send(_described(start))
                await send({"type": "http.response.body", "body": _reason_body(start)})
                return
            await send(start)
        await send(message)

    return sending


def _reason_body(start: dict[str, Any]) -> bytes:
    status = int(start["status"])
    try:
        reason = HTTPStatus(status).phrase
    except ValueError:
        reason = "refused"
    return json.dumps({"error": reason, "status": status}).encode()


def _described(start: dict[str, Any]) -> dict[str, Any]:
    """The response start of `_reason_body`: its length and type replace the empty one's."""
    keep = [
        (name, value)
        for name, value in start.get("headers") or []
        if name.lower() not in (b"content-length", b"content-type")
    ]
    length = str(len(_reason_body(start))).encode()
    headers = [*keep, (b"content-type", b"application/json"), (b"content-length", length)]
    return {**start, "headers": headers}


def _with_retry_after(send: Any) -> Any:
    """`send`, adding `Retry-After` to a `503` that has none (the SDK's "Too many open
    sessions"): every busy refusal says when to try again."""

    async def sending(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start" and message.get("status") == 503:
            headers = list(message.get("headers") or [])
            if not any(name.lower() == b"retry-after" for name, _ in headers):
                headers.append((b"retry-after", str(RETRY_AFTER_S).encode()))
                message = {**message, "headers": headers}
        await send(message)

    return sending


def _check_headers(headers: list[tuple[bytes, bytes]]) -> None:
    """The headers as a whole: within `MAX_HEADER_BYTES` (h11 bounds only headers still
    arriving: up to ~100 KiB that came in one read passed), and one Authorization (the token
    is checked on one, the session's owner was keyed on another: both must be the same).

    Raises:
        _Refused: 431 over the size, 400 for a repeated Authorization.
    """
    if sum(len(name) + len(value) + 4 for name, value in headers) > MAX_HEADER_BYTES:
        raise _Refused(431, f"the request headers are over {MAX_HEADER_BYTES} bytes")
    if sum(1 for name, _ in headers if name == b"authorization") > 1:
        raise _Refused(400, "send one Authorization header, not several")


async def _refuse(send: Any, refused: _Refused) -> None:
    body = json.dumps({"error": str(refused)}).encode()
    try:
        await _send_refusal(send, refused, body)
    except h11.LocalProtocolError:
        # uvicorn already answered this connection: a malformed request (a broken chunk) that
        # came in the same read as the headers got its 400 before this refusal, and the
        # connection is closing. Nothing more to say, and no traceback to log.
        log.debug("server.http_refusal_after_close", extra={"status": refused.status})


async def _send_refusal(send: Any, refused: _Refused, body: bytes) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": refused.status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"),  # uvicorn closes: the unread body stays unread
                *refused.headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


# --- MCP sessions: a cap that evicts the idle ------------------------------------------------


def evict_idle_sessions_at_cap(manager: Any) -> bool:
    """Make the SDK's session manager close the session idle the longest when a new one would
    pass `max_sessions`, instead of answering 503 until a session expires. A session with a
    request in flight (a client's open GET stream included), or idle for less than
    `SESSION_EVICTABLE_AFTER_S`, is never closed for another; when none can be, the SDK's 503
    "Too many open sessions" stands (with a `Retry-After`, see `_with_retry_after`).

    This reaches into the manager's private admission step; whether it could is returned
    (False: an SDK without it keeps its plain refusal at the cap).
    """
    admit = getattr(manager, "_admit_session", None)
    sessions = getattr(manager, "_server_instances", None)
    if admit is None or not isinstance(sessions, dict) or manager.max_sessions is None:
        return False

    def admit_evicting(requestor: Any) -> Any:
        if len(sessions) >= manager.max_sessions:
            # A session's idle deadline is its last activity + the idle timeout.
            idle_since_before = (
                anyio.current_time() + manager.session_idle_timeout - SESSION_EVICTABLE_AFTER_S
            )
            idle = [
                (transport.idle_scope.deadline, session_id)
                for session_id, transport in sessions.items()
                if transport.idle_scope is not None
                and transport.idle_scope.deadline <= idle_since_before
                and not transport.idle_scope.cancel_called
            ]
            if idle:
                _, oldest = min(idle)
                transport = sessions.pop(oldest)
                getattr(manager, "_session_owners", {}).pop(oldest, None)
                transport.idle_scope.cancel()  # its server task ends and terminates it
                log.warning("server.http_session_evicted", extra={"max": manager.max_sessions})
        return admit(requestor)

    manager._admit_session = admit_evicting
    return True


def serve(
    app: Any,
    *,
    host: str,
    port: int,
    verbose: bool,
    uds: Path | None = None,
    idle: IdleExit | None = None,
) -> None:
    """Run `app` (from `server.http_app`) with uvicorn under the limits above, until stopped;
    on the Unix socket `uds` instead of host:port when given; until `idle` says so when
    given (wrap the app in `idle.gate` first)."""
    import uvicorn

    fd_limit = raise_fd_limit()
    cap = connection_cap(fd_limit)
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        uds=str(uds) if uds is not None else None,
        log_level="debug" if verbose else "warning",
        http=protocol_class(cap, max_lingering=lingering_cap(fd_limit, cap)),
        ws="none",
        timeout_keep_alive=KEEP_ALIVE_TIMEOUT,
        h11_max_incomplete_event_size=MAX_HEADER_BYTES,
        # asyncio's accept loop makes up to `backlog` attempts per wake-up and, out of
        # descriptors, logs and schedules a retry for each: uvicorn's 2048 made it spin
        # (2 CPU-s per 5 s here); twice the cap is room enough for a burst of connects.
        backlog=2 * cap,
    )
    limit_log_repeats()  # after uvicorn.Config: it sets up its loggers' handlers
    log.info("server.http", extra={"max_connections": cap, "fd_limit": fd_limit})
    server = uvicorn.Server(config) if idle is None else _idle_server_class()(config, idle)
    try:
        server.run()
    finally:
        if idle is not None:
            idle.unlink_socket()


# --- exit when idle (the per-user local server of `codecage session`) --------------------


class IdleExit:
    """Ends a server that has had no request in flight, no request for `seconds` and no
    open session (`open_sessions()`). Its `gate` counts requests; the check (`due`) runs on
    the server's event loop, as the requests' handlers start, so no request can begin
    between the check and the decision: from then on the gate answers `503`, and the
    socket is unlinked at once, so a client that comes later finds no server and starts a
    new one instead of reaching this one as it ends."""

    def __init__(
        self, seconds: float, open_sessions: Callable[[], int], socket: Path | None
    ) -> None:
        self.seconds = seconds
        self._open_sessions = open_sessions
        self._socket = socket
        self._socket_inode: int | None = None
        self._in_flight = 0
        self._last = time.monotonic()
        self._closing = False

    def gate(self, app: Any) -> Any:
        """`app`, its requests counted (and refused once the server is ending)."""

        async def counted(scope: Any, receive: Any, send: Any) -> None:
            if scope["type"] != "http":
                await app(scope, receive, send)
                return
            if self._closing:
                refused = _Refused(503, "this codecage server is exiting; start another")
                body = json.dumps({"error": str(refused)}).encode()
                await _send_refusal(send, refused, body)
                return
            self._in_flight += 1
            try:
                await app(scope, receive, send)
            finally:
                self._in_flight -= 1
                self._last = time.monotonic()

        return counted

    def bound(self) -> None:
        """Note the socket's inode once bound: only that file is ever unlinked here (a
        server started after this one may have bound the same path anew)."""
        if self._socket is not None and self._socket_inode is None:
            with contextlib.suppress(OSError):
                self._socket_inode = self._socket.stat().st_ino

    def due(self) -> bool:
        """Whether to exit now; when so, the gate refuses from now on and the socket is gone."""
        if self._closing:
            return True
        idle_for = time.monotonic() - self._last
        if self._in_flight or idle_for < self.seconds or self._open_sessions():
            return False
        self._closing = True
        log.info("server.idle_exit", extra={"idle_seconds": round(idle_for, 1)})
        self.unlink_socket()
        return True

    def unlink_socket(self) -> None:
        """Remove the socket this server bound (not one a newer server bound there)."""
        if self._socket is None or self._socket_inode is None:
            return
        with contextlib.suppress(OSError):
            if self._socket.stat().st_ino == self._socket_inode:
                self._socket.unlink()


def _idle_server_class() -> type[Any]:
    import uvicorn

    class IdleServer(uvicorn.Server):
        """uvicorn's server, which also asks `idle` once a second whether to stop."""

        def __init__(self, config: uvicorn.Config, idle: IdleExit) -> None:
            super().__init__(config)
            self.idle = idle

        async def on_tick(self, counter: int) -> bool:
            if await super().on_tick(counter):
                return True
            if counter % 10:
                return False
            self.idle.bound()
            return self.idle.due()

    return IdleServer
