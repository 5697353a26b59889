"""The host egress proxy: one per host process, serving every run that has network.

An asyncio loop on its own daemon thread (started by the first `listen`) accepts
connections on one Unix socket per run. A run's identity is its listener: the lead binds
that socket file into the run's sandbox and nothing the code sends names a run. The socket
is made mode 0o666 so the sandbox's host uid (never root) can connect; what keeps other
users out is the directory it lives in, which the caller owns and opens only to that uid.
And the listener checks each client's kernel credentials (SO_PEERCRED): a process whose
host uid and gid are not the ones its run was given (`listen(peers=)`) is refused (403)
and recorded, whatever path it found the socket by (on the Landlock fallback another run
can see the host's paths): one run never uses another's grant.

It is an HTTP/1.1 forward proxy, parsed with h11 (see `egress.forward` for why):
- `CONNECT host:port`: checked, then 200 and bytes both ways (or, for a host an
  `interceptor` claims, whatever it does with the tunnel: TLS termination to add a
  credential);
- absolute-form requests (`GET http://host/path`): checked, sent on in origin form without
  hop-by-hop and Proxy-* headers, the response streamed back. One request per client
  connection: both sides get `Connection: close` (clients open another; the in-sandbox
  relay makes connections cheap);
- `https://` in absolute form: 400 (clients use CONNECT for https).

Each attempt is decided by name and port before resolving (deny wins), resolved on the
host, decided again by the address actually connected to (a name resolving to a private
or metadata address is refused), then connected to that exact address. Refusals answer
403 (429 for limits, 400 for malformed input) with a short plain-text reason; every attempt
becomes a `ConnectionRecord`. Bounds (`NetworkLimits`) per run: connections open at once,
bytes each way, new connections per second (one request per connection, so this also
bounds requests), the time to send a request head, connect, idle and total timeouts; and
`max_connections` across all runs. Whatever one run does, the loop keeps serving others:
each connection's failures end at its own edge.

Fair shares, checked at accept: a connection over its run's limit (`NetworkLimits.
max_connections`, never above `max_run_connections`, a quarter of the proxy's cap by
default) or over the proxy's cap is answered 429/503 and closed in the same step, before
any byte is read: it is never held, counted or given a timer, so one run's flood of idle
connections cannot fill the proxy for the others. When the process is out of file
descriptors (EMFILE), asyncio stops accepting on that listener for a second; the proxy logs
that once a minute, without a traceback (`_loop_exception`). The proxy's own work is
charged to the run it serves: each connection's CPU time on the proxy's thread and its
bytes are summed per run (`RunEgress.usage`), and the run's result carries them (the
`network_usage` event). The proxy runs in the host process, outside the run's cgroup:
what it spends is counted, not limited by that cgroup (docs/security-model.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import ipaddress
import logging
import os
import re
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable, Coroutine, Generator
from concurrent.futures import Future
from dataclasses import dataclass
from http import HTTPStatus
from pathlib import Path
from typing import Any, Literal, Protocol, TypeVar
from urllib.parse import urlsplit

import h11

from codecage.egress import forward, tls
from codecage.egress.forward import Budget, Cutoff, Meter, Refusal
from codecage.egress.records import ConnectionRecord, RecordLog
from codecage.egress.resolve import ResolveError, Resolver
from codecage.egress.rules import EgressPolicy
from codecage.errors import SandboxError
from codecage.models.hosts import IPAddress, normal_name
from codecage.models.settings import NetworkLimits

log = logging.getLogger(__name__)

MAX_CONNECTIONS = 1024
"""Connections open at once through one proxy, all runs together."""
RUN_SHARE = 4
"""By default one run may hold at most 1/RUN_SHARE of the proxy's connections."""
_FD_RESERVE = 256  # descriptors the rest of the host process keeps (sandboxes, the store)
_CALL_TIMEOUT_S = 30.0
_CLOSE_S = 1.0
_WARN_EVERY_S = 60.0
_ACCEPT_FAILED = "socket.accept() out of system resource"  # asyncio's message, on EMFILE
_PEERCRED = struct.Struct("iII")  # struct ucred: pid, uid, gid
_REFUSED_HEAD_S = 1.0  # how long a client refused for capacity may take to send its head
_HOST_CHARS = re.compile(r"^[a-z0-9_.-]{1,253}$")

T = TypeVar("T")
RunState = Literal["new", "granted", "revoked", "closed"]


@dataclass(frozen=True, slots=True)
class Tunnel:
    """A CONNECT tunnel after the checks and the 200: what an `Interceptor` takes over."""

    host: str
    port: int
    address: IPAddress
    client_reader: asyncio.StreamReader
    client_writer: asyncio.StreamWriter
    upstream_reader: asyncio.StreamReader
    upstream_writer: asyncio.StreamWriter
    preread: bytes
    """Bytes the client sent after its CONNECT head, before the 200 (usually none)."""
    meter: Meter
    """Charge server bytes here (`forward.forward_http`/`relay` take it) to keep the bounds."""


class Interceptor(Protocol):
    """Takes over a tunnel (e.g. terminates TLS to add a credential and scrub echoes)."""

    async def handle(self, tunnel: Tunnel) -> None: ...


InterceptorFactory = Callable[[str, int], Interceptor | None]
"""Given a tunnel's host and port, its interceptor, or None to relay bytes untouched."""
PlainEdge = Callable[[str, int], "tuple[forward.HeaderRewrite, forward.Scrub] | None"]
"""Given a plain HTTP request's host and port, its header rewrite and response filter (a
credential host's, egress/edge.py), or None to forward it as it is."""


class EgressProxy:
    """The proxy of one host process. Thread-safe; its loop starts with the first `listen`."""

    def __init__(
        self,
        resolver: Resolver,
        upstream_ca_file: str | Path | None = None,
        *,
        max_connections: int = MAX_CONNECTIONS,
        max_run_connections: int | None = None,
        interceptor: InterceptorFactory | None = None,
        plain_edge: PlainEdge | None = None,
    ) -> None:
        self.resolver = resolver
        self.upstream_ca_file = upstream_ca_file
        self.max_connections = max_connections
        self.max_run_connections = max(1, max_run_connections or max_connections // RUN_SHARE)
        """The most connections one run may hold, whatever its `NetworkLimits` say."""
        self.interceptor = interceptor
        self.plain_edge = plain_edge
        self.open_connections = 0  # the loop's thread only
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runs: set[RunEgress] = set()
        self._closed = False

    def upstream_ssl_context(self) -> ssl.SSLContext:
        """For TLS to servers (an interceptor's): the system's CAs and `upstream_ca_file`
        (`tls.client_context`, made once per file)."""
        cafile = self.upstream_ca_file
        return tls.client_context(str(cafile) if cafile is not None else None)

    def listen(
        self, socket_path: Path, peers: frozenset[tuple[int, int]] = frozenset()
    ) -> RunEgress:
        """A new run's listener: a Unix socket at `socket_path` (mode 0o666; its directory
        decides who may reach it). Everything is refused until `RunEgress.grant`; with
        `peers`, a client whose host (uid, gid) is not one of them is refused always.

        Raises:
            SandboxError: the socket cannot be made there (the path exists, is too long,
                or its directory is missing), or the proxy is closed.
        """
        sock = _listening_socket(Path(socket_path))
        run = RunEgress(self, Path(socket_path), peers)
        try:
            self._call(run._start(sock))
        except BaseException:
            sock.close()
            with contextlib.suppress(OSError):
                Path(socket_path).unlink()
            raise
        with self._lock:
            self._runs.add(run)
        return run

    def close(self) -> None:
        """Close every run's listener and connection, then stop the loop and its thread."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            runs, loop, thread = list(self._runs), self._loop, self._thread
        if loop is None or thread is None:
            return
        for run in runs:
            asyncio.run_coroutine_threadsafe(run._end("closed"), loop).result(_CALL_TIMEOUT_S)
            self._forget(run)
        loop.call_soon_threadsafe(loop.stop)
        thread.join()

    def _forget(self, run: RunEgress) -> None:
        with self._lock:
            self._runs.discard(run)

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run `coro` on the proxy's loop and wait for it (from any other thread)."""
        try:
            loop = self._ensure_loop()
        except SandboxError:
            coro.close()
            raise
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("EgressProxy methods are for other threads than its own")
        future: Future[T] = asyncio.run_coroutine_threadsafe(coro, loop)
        return future.result(_CALL_TIMEOUT_S)

    def _ensure_loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._closed:
                raise SandboxError(
                    "the egress proxy is closed", hint="make a new EgressProxy for new runs"
                )
            if self._loop is None:
                self.max_connections = min(self.max_connections, _connections_fds_allow())
                self._loop = asyncio.new_event_loop()
                self._loop.set_exception_handler(_loop_exception)
                ready = threading.Event()
                self._thread = threading.Thread(
                    target=_run_loop,
                    args=(self._loop, ready),
                    name="codecage-egress",
                    daemon=True,
                )
                self._thread.start()
                ready.wait()
            return self._loop


def _connections_fds_allow() -> int:
    """Raise RLIMIT_NOFILE's soft limit to the hard one, and say how many connections the
    descriptors then allow (two each: the client's and the server's)."""
    import resource  # Unix only, like the rest of the proxy

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if target > soft:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
    return max(16, (soft - _FD_RESERVE) // 2)


_last_warned: dict[str, float] = {}


def _loop_exception(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """Out of file descriptors: asyncio has stopped accepting on that listener for a
    second already (it retries by itself); say so once a minute, with no traceback.
    Anything else goes to asyncio's own handler."""
    exc = context.get("exception")
    out_of_fds = isinstance(exc, OSError) and exc.errno in (errno.EMFILE, errno.ENFILE)
    if context.get("message") == _ACCEPT_FAILED or out_of_fds:
        now = time.monotonic()
        if now - _last_warned.get("fds", -_WARN_EVERY_S) >= _WARN_EVERY_S:
            _last_warned["fds"] = now
            log.warning(
                "egress_out_of_file_descriptors",
                extra={"error": str(exc), "hint": "raise RLIMIT_NOFILE or lower max_connections"},
            )
        return
    loop.default_exception_handler(context)


def _run_loop(loop: asyncio.AbstractEventLoop, ready: threading.Event) -> None:
    asyncio.set_event_loop(loop)
    loop.call_soon(ready.set)
    try:
        loop.run_forever()
    finally:
        loop.run_until_complete(_settle())
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.run_until_complete(loop.shutdown_default_executor())
        loop.close()


async def _settle() -> None:
    """Cancel what is left and let closed transports release their sockets."""
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for _ in range(3):  # connection_lost runs a loop iteration after close()
        await asyncio.sleep(0)


def _listening_socket(path: Path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(str(path))
        path.chmod(0o666)  # the sandbox's uid connects; the directory keeps others out
        sock.listen(128)
        sock.setblocking(False)
    except OSError as exc:
        sock.close()
        raise SandboxError(
            f"the egress proxy cannot listen at {path}: {exc.strerror or exc}",
            hint="pass a socket_path that does not exist yet, in an existing directory, "
            "under 100 bytes long",
        ) from exc
    return sock


@dataclass(frozen=True, slots=True)
class EgressUsage:
    """What the proxy spent on one run since its grant."""

    connections: int
    """Connections accepted and served (refused ones not included)."""
    refused_at_accept: int
    """Connections refused at accept, over the run's or the proxy's cap."""
    bytes_out: int
    """Bytes sent to servers for this run."""
    bytes_in: int
    """Bytes received from servers for this run."""
    cpu_ms: float
    """CPU time of the proxy's thread while running this run's connections (parsing,
    policy, TLS at the edge, copying): not the kernel's socket work done in the loop's
    callbacks, nor name lookups (another thread)."""


class _Usage:
    """The running sums behind `EgressUsage` (the proxy's loop thread writes them)."""

    def __init__(self) -> None:
        self.connections = 0
        self.refused_at_accept = 0
        self.bytes_out = 0
        self.bytes_in = 0
        self.cpu_s = 0.0

    def frozen(self) -> EgressUsage:
        return EgressUsage(
            self.connections, self.refused_at_accept, self.bytes_out, self.bytes_in,
            round(self.cpu_s * 1000, 3),
        )  # fmt: skip


class _Charged:
    """Awaits `coro`, adding the CPU time of the proxy's thread during each of its steps to
    `usage` (`time.thread_time`: this thread only; the steps of other runs' connections
    are between, not inside, these)."""

    __slots__ = ("_coro", "_usage")

    def __init__(self, coro: Coroutine[Any, Any, None], usage: _Usage) -> None:
        self._coro = coro
        self._usage = usage

    def __await__(self) -> Generator[Any, Any, None]:
        return self  # a generator in all but name: send, throw, close

    def __iter__(self) -> _Charged:
        return self

    def __next__(self) -> Any:
        return self.send(None)

    def send(self, value: Any) -> Any:
        began = time.thread_time()
        try:
            return self._coro.send(value)
        finally:
            self._usage.cpu_s += time.thread_time() - began

    def throw(self, *args: Any) -> Any:
        began = time.thread_time()
        try:
            return self._coro.throw(*args)
        finally:
            self._usage.cpu_s += time.thread_time() - began

    def close(self) -> None:
        self._coro.close()


class RunEgress:
    """One run's listener on the proxy: its grant, its connections and their records."""

    def __init__(
        self, proxy: EgressProxy, path: Path, peers: frozenset[tuple[int, int]] = frozenset()
    ) -> None:
        self.proxy = proxy
        self.path = path
        self.peers = peers  # the host (uid, gid)s that may connect; empty: anyone
        self._state: RunState = "new"
        self._policy = EgressPolicy()
        self._budget = Budget(NetworkLimits())
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._log = RecordLog()
        self._usage = _Usage()

    def grant(self, policy: EgressPolicy, limits: NetworkLimits) -> None:
        """Let this run's connections through `policy`, within `limits`. A new grant
        closes the connections of an earlier one and starts the records afresh."""
        self.proxy._call(self._grant(policy, limits))

    def revoke(self) -> None:
        """The run is over: later attempts are refused, open connections closed."""
        self.proxy._call(self._end("revoked"))

    def records(self) -> list[ConnectionRecord]:
        """What happened since the grant (bounded: see `records.RECORD_LIMIT`)."""
        return self._log.snapshot()

    def usage(self) -> EgressUsage:
        """What the proxy spent on this run since the grant (see `EgressUsage`)."""
        return self._usage.frozen()

    def close(self) -> None:
        """The listener and its socket file go, and every connection is closed."""
        if self._state != "closed":
            with contextlib.suppress(SandboxError):  # the proxy closed first: nothing open
                self.proxy._call(self._end("closed"))
        self.proxy._forget(self)

    # --- on the proxy's loop ---------------------------------------------------------

    async def _start(self, sock: socket.socket) -> None:
        self._server = await asyncio.start_unix_server(self._accept, sock=sock)

    async def _grant(self, policy: EgressPolicy, limits: NetworkLimits) -> None:
        if self._state == "closed":
            raise SandboxError("this run's egress listener is closed", hint="listen again")
        await self._close_connections()
        self._log.clear()
        self._usage = _Usage()
        self._policy, self._budget, self._state = policy, Budget(limits), "granted"

    async def _end(self, state: RunState) -> None:
        if self._state == "closed":
            return
        self._state = state
        if state == "closed" and self._server is not None:
            self._server.close()
            with contextlib.suppress(OSError):
                self.path.unlink()
        await self._close_connections()

    async def _close_connections(self) -> None:
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            _, stuck = await asyncio.wait(tasks, timeout=_CLOSE_S * 5)
            if stuck:  # a bug, not a client's doing: say so rather than hang the caller
                log.error("egress_connections_not_closed", extra={"count": len(stuck)})

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is None:  # never: the server runs this as a task
            return
        full = self._over_capacity()
        if full is not None:
            self._refuse_at_once(writer, full)
            return
        self._tasks.add(task)
        self.proxy.open_connections += 1
        self._usage.connections += 1
        attempt = _Attempt(self, reader, writer)
        try:
            stranger = self._stranger(writer)
            if stranger is not None:
                log.warning("egress_peer_refused", extra={"peer": stranger})
                await attempt.refuse(Refusal(403, stranger))
                await _read_off(reader)
            else:
                await _Charged(attempt.serve(), self._usage)
        except asyncio.CancelledError:
            attempt.record(None, "closed: the run's egress was revoked or closed")
        except Exception:  # one connection's bug must not reach the loop
            log.exception("egress_connection_failed")
            attempt.record(None, "internal error in the egress proxy")
        finally:
            self.proxy.open_connections -= 1
            self._tasks.discard(task)
            self._usage.bytes_out += attempt.meter.bytes_out
            self._usage.bytes_in += attempt.meter.bytes_in
            writer.close()
            with contextlib.suppress(Exception, asyncio.CancelledError):
                async with asyncio.timeout(_CLOSE_S):
                    await writer.wait_closed()

    def _over_capacity(self) -> Refusal | None:
        """Checked before a connection is counted or read: over either cap it is refused."""
        proxy = self.proxy
        if proxy.open_connections >= proxy.max_connections:
            return Refusal(503, f"the egress proxy is at its {proxy.max_connections} connections")
        cap = min(self._budget.limits.max_connections, proxy.max_run_connections)
        if len(self._tasks) >= cap:
            return Refusal(429, f"connection limit: this run has {cap} open already")
        return None

    def _refuse_at_once(self, writer: asyncio.StreamWriter, refusal: Refusal) -> None:
        """The refusal goes into the fresh socket's empty buffer in one send, and the socket
        is closed in the same step: nothing waits for the client. What the client already
        sent is read off first (without waiting), as closing a Unix socket with unread
        bytes makes the peer's next read fail (ECONNRESET) instead of reading the reason;
        a client that sends only after the close sees its write fail."""
        _drain_queued(writer)
        with contextlib.suppress(OSError, RuntimeError):
            writer.write(_refusal_bytes(refusal))
        writer.transport.abort()
        self._usage.refused_at_accept += 1
        self._log.add(
            ConnectionRecord(
                allowed=False, host="", port=0, address=None, method="",
                status=refusal.status, bytes_out=0, bytes_in=0, duration_ms=0.0,
                reason=refusal.reason,
            )
        )  # fmt: skip

    def _stranger(self, writer: asyncio.StreamWriter) -> str | None:
        """Why the client of `writer` is not this run (its kernel credentials); None when
        it is, or when any client may connect."""
        if not self.peers:
            return None
        sock = writer.get_extra_info("socket")
        try:
            creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
            pid, uid, gid = _PEERCRED.unpack(creds)
        except (OSError, AttributeError, struct.error):
            return "refused: the client's credentials cannot be read"
        if (uid, gid) in self.peers:
            return None
        return (
            f"refused: the client (host pid {pid}, uid {uid}, gid {gid}) is not the run "
            "this socket belongs to"
        )

    def _refusal_before_grant(self) -> str | None:
        if self._state == "new":
            return "this run has no network grant"
        if self._state != "granted":
            return f"this run's network grant was {self._state}: the run is over"
        return None


@dataclass(frozen=True, slots=True)
class _Target:
    host: str
    port: int
    path: str  # origin form for plain HTTP; "" for CONNECT


class _Attempt:
    """One client connection: its checks, its exchange, and the record it leaves."""

    def __init__(
        self, run: RunEgress, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        self.run = run
        self.reader = reader
        self.writer = writer
        self.started = time.monotonic()
        self.budget = run._budget
        self.meter = Meter(self.budget)
        self.conn = forward.server_connection()
        self.host = ""
        self.port = 0
        self.method = ""
        self.address: str | None = None
        self.allowed = False
        self.status: int | None = None
        self.recorded = False

    async def serve(self) -> None:
        limits = self.budget.limits
        try:
            async with asyncio.timeout(limits.total_timeout) as total:
                request = await forward.read_head(
                    self.reader, self.conn, self.started + limits.header_timeout
                )
                await self._handle(request)
            self.record(self.status, None)
        except Refusal as refusal:
            await self._answer(refusal)
            self.record(refusal.status, refusal.reason)
        except Cutoff as cutoff:
            self.record(self.status, cutoff.reason)
        except TimeoutError:
            if not total.expired():
                raise
            self.record(self.status, "total timeout")
        except OSError as exc:
            self.record(self.status, f"connection error: {exc.strerror or exc}")

    async def _handle(self, request: h11.Request) -> None:
        self.method = request.method.decode("ascii", "replace")
        refusal = self.run._refusal_before_grant()
        if refusal is not None:
            raise Refusal(403, refusal)
        target = _target(request)
        self.host, self.port = target.host, target.port
        if self.method == "CONNECT":
            _end_of_connect(self.conn)
        limits = self.budget.limits
        if not self.budget.take_token():
            raise Refusal(
                429, f"rate limit: over {limits.requests_per_second:g} requests per second"
            )
        spent = self.budget.exhausted()
        if spent is not None:
            raise Refusal(429, spent)
        address = await self._decide(target)
        self.allowed = True
        upstream_r, upstream_w = await self._connect(address, target.port)
        try:
            if self.method == "CONNECT":
                await self._tunnel(address, upstream_r, upstream_w)
            else:
                await self._forward(request, target, upstream_r, upstream_w)
        finally:
            upstream_w.close()
            with contextlib.suppress(Exception, asyncio.CancelledError):
                async with asyncio.timeout(_CLOSE_S):
                    await upstream_w.wait_closed()

    async def _decide(self, target: _Target) -> IPAddress:
        policy = self.run._policy
        reason = policy.refuse_name(target.host, target.port)
        if reason is not None:
            raise Refusal(403, reason)
        try:
            addresses = await self.run.proxy.resolver.resolve(target.host, target.port)
        except ResolveError as exc:
            raise Refusal(502, str(exc)) from None
        refusals = []
        for address in addresses:
            reason = policy.refuse_address(target.host, target.port, address)
            if reason is None:
                return address
            refusals.append(reason)
        self.address = str(addresses[0])
        raise Refusal(403, refusals[0])

    async def _connect(
        self, address: IPAddress, port: int
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        self.address = str(address)
        timeout_s = self.budget.limits.connect_timeout
        try:
            async with asyncio.timeout(timeout_s):
                return await asyncio.open_connection(str(address), port)
        except TimeoutError:
            reason = f"connecting to {address} port {port} took over {timeout_s:g} s"
            raise Refusal(504, reason) from None
        except OSError as exc:
            raise Refusal(
                502, f"could not connect to {address} port {port}: {exc.strerror or exc}"
            ) from None

    async def _tunnel(
        self,
        address: IPAddress,
        upstream_r: asyncio.StreamReader,
        upstream_w: asyncio.StreamWriter,
    ) -> None:
        preread, _ = self.conn.trailing_data
        await self.meter.send(self.writer, b"HTTP/1.1 200 Connection established\r\n\r\n")
        factory = self.run.proxy.interceptor
        interceptor = factory(self.host, self.port) if factory is not None else None
        if interceptor is not None:
            tunnel = Tunnel(
                self.host, self.port, address, self.reader, self.writer,
                upstream_r, upstream_w, bytes(preread), self.meter,
            )  # fmt: skip
            await interceptor.handle(tunnel)
            return
        await self.meter.send_upstream(upstream_w, bytes(preread))
        await forward.relay(self.reader, self.writer, upstream_r, upstream_w, meter=self.meter)

    async def _forward(
        self,
        request: h11.Request,
        target: _Target,
        upstream_r: asyncio.StreamReader,
        upstream_w: asyncio.StreamWriter,
    ) -> None:
        # RFC 9112 3.2.2: a proxy replaces Host with the authority of the absolute URL.
        headers = [(n, v) for n, v in request.headers if n != b"host"]
        host = f"[{target.host}]" if ":" in target.host else target.host
        authority = host if target.port == 80 else f"{host}:{target.port}"
        headers.insert(0, (b"host", authority.encode("ascii")))
        origin = h11.Request(method=request.method, target=target.path, headers=headers)
        edge = self.run.proxy.plain_edge
        rewrite, scrub = (edge and edge(target.host, target.port)) or (None, None)
        self.status = await forward.forward_http(
            self.reader, self.writer, upstream_r, upstream_w,
            meter=self.meter, request=origin, client_conn=self.conn,
            rewrite_headers=rewrite, scrub=scrub,
        )  # fmt: skip

    async def refuse(self, refusal: Refusal) -> None:
        """Answer `refusal` without reading anything the client sent, and record it."""
        await self._answer(refusal)
        self.record(refusal.status, refusal.reason)

    async def _answer(self, refusal: Refusal) -> None:
        with contextlib.suppress(OSError, Cutoff):
            await self.meter.send(self.writer, _refusal_bytes(refusal))
            if self.writer.can_write_eof():
                self.writer.write_eof()

    def record(self, status: int | None, reason: str | None) -> None:
        if self.recorded:
            return
        self.recorded = True
        self.run._log.add(
            ConnectionRecord(
                allowed=self.allowed,
                host=self.host,
                port=self.port,
                address=self.address,
                method=self.method,
                status=status,
                bytes_out=self.meter.bytes_out,
                bytes_in=self.meter.bytes_in,
                duration_ms=round((time.monotonic() - self.started) * 1000, 3),
                reason=reason,
            )
        )


def _drain_queued(writer: asyncio.StreamWriter, limit: int = forward.MAX_HEAD_BYTES) -> None:
    """Read off, without waiting, up to `limit` bytes the client has already sent."""
    sock = writer.get_extra_info("socket")
    if sock is None:
        return
    fd, left = sock.fileno(), limit
    with contextlib.suppress(OSError):  # BlockingIOError: nothing (more) queued
        while left > 0 and (chunk := os.read(fd, min(left, 16384))):
            left -= len(chunk)


async def _read_off(reader: asyncio.StreamReader, limit: int = 64 * 1024) -> None:
    """Read what a refused client sent, for at most `_REFUSED_HEAD_S` and `limit` bytes:
    a Unix socket closed with unread bytes makes the peer's read fail (ECONNRESET) before
    it reads the answer already written."""
    with contextlib.suppress(OSError, TimeoutError, asyncio.IncompleteReadError):
        async with asyncio.timeout(_REFUSED_HEAD_S):
            while limit > 0:
                chunk = await reader.read(min(limit, 16 * 1024))
                if not chunk:
                    return
                limit -= len(chunk)


def _refusal_bytes(refusal: Refusal) -> bytes:
    body = f"codecage egress proxy: {refusal.reason}\n".encode()
    try:
        phrase = HTTPStatus(refusal.status).phrase
    except ValueError:
        phrase = "Refused"
    head = (
        f"HTTP/1.1 {refusal.status} {phrase}\r\n"
        "Content-Type: text/plain; charset=utf-8\r\n"
        f"Content-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n"
    )
    return head.encode("ascii") + body


def _target(request: h11.Request) -> _Target:
    raw = request.target.decode("latin-1")
    if not raw.isascii():
        raise Refusal(400, "malformed request: the target is not ASCII")
    if request.method == b"CONNECT":
        host, port = _authority(raw, default_port=None)
        return _Target(host, port, "")
    scheme = raw[:8].lower()
    if scheme.startswith("https://"):
        raise Refusal(400, "https:// URLs go through CONNECT: set HTTPS_PROXY, not an https URL")
    if not scheme.startswith("http://"):
        raise Refusal(400, "this is a forward proxy: send the whole URL (GET http://host/path)")
    url = urlsplit(raw)
    if "@" in url.netloc:
        raise Refusal(400, "user:password@ in a URL is not forwarded: send an Authorization header")
    host, port = _authority(url.netloc, default_port=80)
    path = (url.path or "/") + (f"?{url.query}" if url.query else "")
    return _Target(host, port, path)


def _authority(text: str, *, default_port: int | None) -> tuple[str, int]:
    """host:port (or [v6]:port) as the proxy compares it: IP literals in their canonical form."""
    host, port_text = _split_authority(text)
    if not port_text and default_port is not None:
        port = default_port
    elif port_text.isdigit() and 0 < int(port_text) < 65536:
        port = int(port_text)
    else:
        raise Refusal(400, f"malformed request: {text!r} needs host:port, a port from 1 to 65535")
    name = normal_name(host)
    try:
        return str(ipaddress.ip_address(name)), port
    except ValueError:
        pass
    if not _HOST_CHARS.match(name):
        raise Refusal(400, f"malformed request: {host!r} is not a host name")
    return name, port


def _split_authority(text: str) -> tuple[str, str]:
    if text.startswith("["):
        end = text.find("]")
        rest = text[end + 1 :] if end > 0 else "?"
        if rest and not rest.startswith(":"):
            raise Refusal(400, f"malformed request: {text!r} is not [IPv6]:port")
        return text[1:end], rest[1:]
    if text.count(":") > 1:
        raise Refusal(400, f"malformed request: write an IPv6 address as [{text}]")
    host, _, port = text.partition(":")
    return host, port


def _end_of_connect(conn: h11.Connection) -> None:
    """A CONNECT head ends the HTTP part: anything else (a body) is malformed."""
    try:
        event = conn.next_event()
        if isinstance(event, h11.EndOfMessage):
            event = conn.next_event()
    except h11.RemoteProtocolError as exc:
        raise Refusal(400, f"malformed CONNECT: {exc}") from None
    if event is not h11.PAUSED:
        raise Refusal(400, "malformed CONNECT: a CONNECT request has no body")
