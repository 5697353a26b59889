"""Moving HTTP/1.1 between a client and a server, within a run's bounds.

The pieces the proxy runs over a plain connection, and that can run unchanged over a
TLS-terminated one (the streams are asyncio's either way): `read_head` (one request head,
by a deadline, within `MAX_HEAD_BYTES`), `forward_http` (one request and its response, with
an optional header rewrite and response scrubber), `relay` (bytes both ways, for a
tunnel). Every byte to or from the server is charged to a `Meter`, which cuts the
connection off at the run's byte limits and when neither side has sent anything for the
idle timeout.

HTTP parsing is h11's (what httpx and uvicorn use; sans-I/O, strict about framing, bounded
buffers). Both sides are parsed and the message is written again by h11, so what reaches
the server is a well-framed request whatever the client sent: no smuggling by ambiguous
Content-Length / Transfer-Encoding, no hop-by-hop or Proxy-* headers.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Protocol

import h11

from codecage.models.settings import NetworkLimits

MAX_HEAD_BYTES = 32 * 1024
"""The largest request or response head accepted (a huge header cannot grow memory)."""
READ_BYTES = 64 * 1024

HeaderList = list[tuple[bytes, bytes]]
HeaderRewrite = Callable[[HeaderList], HeaderList]
"""Given the request headers that will go to the server (lower-case names), the ones to send."""


class Scrub(Protocol):
    """What the client gets of a response instead of what the server sent (credentials
    scrubbed out): its headers, then its body piece by piece, then what was held back."""

    def headers(self, headers: HeaderList) -> HeaderList: ...

    def feed(self, data: bytes) -> bytes: ...

    def flush(self) -> bytes: ...


# asyncio.timeout, not wait_for: on Python 3.11 wait_for can swallow a cancellation that
# comes as the read completes, and a revoked run's connection would then never end.

# Hop-by-hop headers (RFC 9110 7.6.1) and the proxy's own: never forwarded. Framing
# (Content-Length / Transfer-Encoding) is written again by h11 for each side.
_HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-connection",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
        b"expect",
    }
)


class Refusal(Exception):
    """The client gets this HTTP status and plain-text reason, and nothing else happens."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


class Cutoff(Exception):
    """The connection is closed mid-way (a limit, a timeout, a peer's error): `reason` says why."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class Budget:
    """One run's allowance while a grant lasts: bytes each way and the request rate."""

    def __init__(self, limits: NetworkLimits) -> None:
        self.limits = limits
        self.bytes_out = 0
        self.bytes_in = 0
        self._tokens = max(1.0, limits.requests_per_second)
        self._stamp = time.monotonic()

    def take_token(self) -> bool:
        """A token bucket: `requests_per_second`, bursts up to one second's worth."""
        rate = self.limits.requests_per_second
        now = time.monotonic()
        self._tokens = min(max(1.0, rate), self._tokens + (now - self._stamp) * rate)
        self._stamp = now
        if self._tokens < 1.0:
            return False
        self._tokens -= 1.0
        return True

    def exhausted(self) -> str | None:
        """Why no new connection may start (a byte limit already reached), or None."""
        if self.bytes_out >= self.limits.max_bytes_out:
            return f"byte limit: this run has sent its {self.limits.max_bytes_out} bytes"
        if self.bytes_in >= self.limits.max_bytes_in:
            return f"byte limit: this run has received its {self.limits.max_bytes_in} bytes"
        return None


class Meter:
    """One connection's bytes and activity, charged to its run's `Budget`."""

    def __init__(self, budget: Budget) -> None:
        self.budget = budget
        self.bytes_out = 0
        self.bytes_in = 0
        self.last_activity = time.monotonic()

    @property
    def limits(self) -> NetworkLimits:
        return self.budget.limits

    def charge_out(self, n: int) -> None:
        """Raises Cutoff before the run's outgoing bytes would pass its limit."""
        if self.budget.bytes_out + n > self.limits.max_bytes_out:
            self.budget.bytes_out = self.limits.max_bytes_out  # spent: later ones are refused
            raise Cutoff(f"byte limit: more than {self.limits.max_bytes_out} bytes out")
        self.budget.bytes_out += n
        self.bytes_out += n

    def charge_in(self, n: int) -> None:
        """Raises Cutoff before the run's incoming bytes would pass its limit."""
        if self.budget.bytes_in + n > self.limits.max_bytes_in:
            self.budget.bytes_in = self.limits.max_bytes_in
            raise Cutoff(f"byte limit: more than {self.limits.max_bytes_in} bytes in")
        self.budget.bytes_in += n
        self.bytes_in += n

    async def read(self, reader: asyncio.StreamReader) -> bytes:
        """Up to READ_BYTES; b"" at EOF. Raises Cutoff when no byte passed either way
        (on any of this connection's streams) for the idle timeout."""
        idle_s = self.limits.idle_timeout
        while True:
            remaining = self.last_activity + idle_s - time.monotonic()
            if remaining <= 0:
                raise Cutoff("idle timeout")
            try:
                async with asyncio.timeout(remaining):
                    data = await reader.read(READ_BYTES)
            except TimeoutError:
                continue  # the other direction may have been active meanwhile
            self.last_activity = time.monotonic()
            return data

    async def read_upstream(self, reader: asyncio.StreamReader) -> bytes:
        data = await self.read(reader)
        self.charge_in(len(data))
        return data

    async def send_upstream(self, writer: asyncio.StreamWriter, data: bytes) -> None:
        self.charge_out(len(data))
        await self.send(writer, data)

    async def send(self, writer: asyncio.StreamWriter, data: bytes) -> None:
        """Write and wait for the peer to take it, within the idle timeout."""
        if not data:
            return
        writer.write(data)
        try:
            async with asyncio.timeout(self.limits.idle_timeout):
                await writer.drain()
        except TimeoutError:
            raise Cutoff("idle timeout (the peer stopped reading)") from None
        self.last_activity = time.monotonic()


def server_connection() -> h11.Connection:
    """The proxy's side of a client's connection, with the head size bounded."""
    return h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD_BYTES)


async def read_head(
    reader: asyncio.StreamReader, conn: h11.Connection, deadline: float
) -> h11.Request:
    """The client's request head, whole by `deadline` (time.monotonic()).

    Raises:
        Refusal: 408 at the deadline (a slow client), 400/431 for a malformed or too
            large head.
        Cutoff: the client closed before sending a request.
    """
    while True:
        try:
            event = conn.next_event()
        except h11.RemoteProtocolError as exc:
            raise Refusal(exc.error_status_hint, f"malformed request: {exc}") from None
        if isinstance(event, h11.Request):
            return event
        if isinstance(event, h11.ConnectionClosed):
            raise Cutoff("the client closed before sending a request")
        if event is not h11.NEED_DATA:
            raise Refusal(400, "malformed request: expected a request head")
        remaining = deadline - time.monotonic()
        try:
            if remaining <= 0:
                raise TimeoutError
            async with asyncio.timeout(remaining):
                data = await reader.read(READ_BYTES)
        except TimeoutError:
            raise Refusal(408, "header timeout: the request head came too slowly") from None
        conn.receive_data(data)


async def forward_http(
    client_r: asyncio.StreamReader,
    client_w: asyncio.StreamWriter,
    upstream_r: asyncio.StreamReader,
    upstream_w: asyncio.StreamWriter,
    *,
    meter: Meter,
    request: h11.Request | None = None,
    client_conn: h11.Connection | None = None,
    rewrite_headers: HeaderRewrite | None = None,
    scrub: Scrub | None = None,
) -> int:
    """One request from the client to the server and its response back; the status.

    `request` is the head already read on `client_conn` (its target in origin form), or
    None to read one here (over a TLS-terminated stream, say). The server gets the
    end-to-end headers (after `rewrite_headers`) and `Connection: close`; the response
    body goes back through `scrub`, piece by piece (a scrubber that needs context across
    pieces must keep it itself). One request per connection: the client gets
    `Connection: close` too.

    Raises:
        Refusal: nothing was sent to the client yet (a malformed request, a server that
            closed or answered nonsense before its status line).
        Cutoff: the exchange stopped mid-way (limits, timeouts, a peer's error).
    """
    client_conn = client_conn or server_connection()
    if request is None:
        deadline = time.monotonic() + meter.limits.header_timeout
        request = await read_head(client_r, client_conn, deadline)
    upstream_conn = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEAD_BYTES)
    headers = end_to_end(request.headers, keep_length=True)
    if _chunked(request.headers):
        headers.append((b"transfer-encoding", b"chunked"))
    if rewrite_headers is not None:
        headers = rewrite_headers(headers)
    headers.append((b"connection", b"close"))
    try:
        head = upstream_conn.send(
            h11.Request(method=request.method, target=request.target, headers=headers)
        )
    except h11.LocalProtocolError as exc:
        raise Refusal(400, f"malformed request: {exc}") from None
    await meter.send_upstream(upstream_w, head or b"")
    if _expects_continue(request.headers):
        # The client waits for this before its body; the server never sees the Expect.
        interim = h11.InformationalResponse(status_code=100, headers=[])
        await meter.send(client_w, client_conn.send(interim) or b"")
    await _copy_body(client_r, client_conn, upstream_w, upstream_conn, meter)
    return await _copy_response(upstream_r, upstream_conn, client_w, client_conn, meter, scrub)


async def _copy_body(
    client_r: asyncio.StreamReader,
    client_conn: h11.Connection,
    upstream_w: asyncio.StreamWriter,
    upstream_conn: h11.Connection,
    meter: Meter,
) -> None:
    while True:
        try:
            event = client_conn.next_event()
        except h11.RemoteProtocolError as exc:
            raise Refusal(400, f"malformed request body: {exc}") from None
        if event is h11.NEED_DATA:
            client_conn.receive_data(await meter.read(client_r))
        elif isinstance(event, h11.Data | h11.EndOfMessage):
            try:
                out = upstream_conn.send(event)
            except h11.LocalProtocolError as exc:
                raise Refusal(400, f"malformed request body: {exc}") from None
            await meter.send_upstream(upstream_w, out or b"")
            if isinstance(event, h11.EndOfMessage):
                return
        else:
            raise Cutoff("the client closed before sending its whole request")


async def _copy_response(
    upstream_r: asyncio.StreamReader,
    upstream_conn: h11.Connection,
    client_w: asyncio.StreamWriter,
    client_conn: h11.Connection,
    meter: Meter,
    scrub: Scrub | None,
) -> int:
    status: int | None = None
    while True:
        try:
            event = upstream_conn.next_event()
        except h11.RemoteProtocolError as exc:
            if status is None:
                raise Refusal(502, f"the server sent a malformed response: {exc}") from None
            raise Cutoff(f"the server sent a malformed response: {exc}") from None
        if event is h11.NEED_DATA:
            upstream_conn.receive_data(await meter.read_upstream(upstream_r))
            continue
        if isinstance(event, h11.InformationalResponse):
            continue  # 100 Continue and the like: the body was sent already
        if isinstance(event, h11.Response):
            status = event.status_code
            headers = end_to_end(event.headers, keep_length=scrub is None)
            if scrub is not None:
                headers = scrub.headers(headers)
            headers.append((b"connection", b"close"))
            out = client_conn.send(
                h11.Response(status_code=status, headers=headers, reason=event.reason)
            )
        elif isinstance(event, h11.Data):
            data = scrub.feed(bytes(event.data)) if scrub is not None else event.data
            out = client_conn.send(h11.Data(data=data)) if data else b""
        elif isinstance(event, h11.EndOfMessage):
            held = scrub.flush() if scrub is not None else b""
            if held:
                await meter.send(client_w, client_conn.send(h11.Data(data=held)) or b"")
            await meter.send(client_w, client_conn.send(h11.EndOfMessage()) or b"")
            return status or 0  # h11 gives EndOfMessage only after a Response
        else:  # ConnectionClosed before a response
            raise Refusal(502, "the server closed the connection without answering")
        await meter.send(client_w, out or b"")


async def relay(
    client_r: asyncio.StreamReader,
    client_w: asyncio.StreamWriter,
    upstream_r: asyncio.StreamReader,
    upstream_w: asyncio.StreamWriter,
    *,
    meter: Meter,
) -> None:
    """Bytes both ways until the server closes (a client's EOF is passed on as a half
    close: the server may still answer).

    Raises:
        Cutoff: a byte limit or the idle timeout.
    """

    async def outward() -> None:
        while data := await meter.read(client_r):
            await meter.send_upstream(upstream_w, data)
        if upstream_w.can_write_eof():
            upstream_w.write_eof()

    async def inward() -> None:
        while data := await meter.read_upstream(upstream_r):
            await meter.send(client_w, data)

    out_task, in_task = asyncio.ensure_future(outward()), asyncio.ensure_future(inward())
    try:
        done, _ = await asyncio.wait([out_task, in_task], return_when=asyncio.FIRST_COMPLETED)
        if out_task in done and out_task.exception() is None:
            await in_task  # the client's half close: the server may still answer
    finally:
        for task in (out_task, in_task):
            task.cancel()
        await asyncio.wait([out_task, in_task])
    for task in (out_task, in_task):
        if not task.cancelled() and task.exception() is not None:
            raise task.exception()  # type: ignore[misc]


def end_to_end(headers: Sequence[tuple[bytes, bytes]], *, keep_length: bool) -> HeaderList:
    """The headers a proxy passes on: no hop-by-hop, no Proxy-*, none that Connection
    names; Content-Length only when `keep_length` and the body is not chunked."""
    pairs = [(bytes(n).lower(), bytes(v)) for n, v in headers]
    named = {
        token.strip().lower()
        for name, value in pairs
        if name == b"connection"
        for token in value.split(b",")
    }
    keep_length = keep_length and not _chunked(pairs)
    return [
        (name, value)
        for name, value in pairs
        if name not in _HOP_BY_HOP
        and name not in named
        and not name.startswith(b"proxy-")
        and (keep_length or name != b"content-length")
    ]


def _chunked(headers: Sequence[tuple[bytes, bytes]]) -> bool:
    return any(bytes(n).lower() == b"transfer-encoding" for n, _ in headers)


def _expects_continue(headers: Sequence[tuple[bytes, bytes]]) -> bool:
    return any(n == b"expect" and v.lower() == b"100-continue" for n, v in headers)
