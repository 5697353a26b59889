"""The host egress proxy with real parts: HTTP and HTTPS servers on 127.0.0.1, names through
the resolver's static table (there is no DNS here), clients speaking to a run's Unix socket.

The local servers are on 127.0.0.1, a special address: the grants name that IP literal
(with the server's port) alongside the names, as an operator would for a local service.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import http.server
import ipaddress
import os
import shutil
import socket
import ssl
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from tests._certs import self_signed
from tests._forking import in_forked_child

from codecage.egress import forward
from codecage.egress.proxy import EgressProxy, RunEgress, Tunnel
from codecage.egress.records import RECORD_LIMIT, ConnectionRecord, RecordLog
from codecage.egress.resolve import Resolver
from codecage.egress.rules import EgressPolicy
from codecage.models.hosts import parse_rules
from codecage.models.settings import NetworkLimits

BIG = 200_000


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    seen: list[dict[str, str]]  # set per server class

    def log_message(self, format: str, *args: object) -> None:
        pass

    def _reply(self, status: int, body: bytes, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        self.seen.append({**{k.lower(): v for k, v in self.headers.items()}, ":path": self.path})
        if self.path == "/redirect":
            target = "http://denied.test:" + self.headers["x-port"] + "/hello"
            self._reply(302, b"moved", {"Location": target})
        elif self.path == "/big":
            self._reply(200, b"x" * BIG)
        else:
            self._reply(200, b"hello from " + self.path.encode())

    def do_POST(self) -> None:
        self.seen.append({**{k.lower(): v for k, v in self.headers.items()}, ":path": self.path})
        length = int(self.headers.get("Content-Length", "0"))
        self._reply(200, b"got " + str(len(self.rfile.read(length))).encode())


@dataclass
class Servers:
    http_port: int
    https_port: int
    ca_pem: bytes
    seen: list[dict[str, str]]


def _certificate() -> tuple[bytes, bytes]:
    return self_signed("secure.test")


@pytest.fixture(scope="module")
def servers() -> Iterator[Servers]:
    seen: list[dict[str, str]] = []
    handler = type("Handler", (_Handler,), {"seen": seen})
    plain = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    secure = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    cert_pem, key_pem = _certificate()
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "cert.pem").write_bytes(cert_pem)
        (Path(tmp) / "key.pem").write_bytes(key_pem)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(Path(tmp) / "cert.pem", Path(tmp) / "key.pem")
    secure.socket = context.wrap_socket(secure.socket, server_side=True)
    threads = [threading.Thread(target=s.serve_forever, daemon=True) for s in (plain, secure)]
    for thread in threads:
        thread.start()
    yield Servers(plain.server_port, secure.server_port, cert_pem, seen)
    for server in (plain, secure):
        server.shutdown()
        server.server_close()
    for thread in threads:
        thread.join()


STATIC = {
    "api.test": ["127.0.0.1"],
    "denied.test": ["127.0.0.1"],
    "secure.test": ["127.0.0.1"],
    "meta.test": ["169.254.169.254"],
    "private.test": ["10.1.2.3"],
    "mapped.test": ["::ffff:127.0.0.1"],
    "nat64.test": ["64:ff9b::a9fe:a9fe"],
    "sixtofour.test": ["2002:a00:1::1"],
    "azure.test": ["168.63.129.16"],
    "ietf.test": ["192.0.0.9"],
    "nat64-public.test": ["64:ff9b::808:808"],
}


@pytest.fixture(scope="module")
def proxy() -> Iterator[EgressProxy]:
    proxy = EgressProxy(Resolver(STATIC))
    yield proxy
    proxy.close()


@pytest.fixture
def socket_dir() -> Iterator[Path]:
    # Short: a Unix socket path has at most 107 bytes, pytest's tmp_path may be longer.
    path = Path(tempfile.mkdtemp(prefix="cc-egress-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def policy(servers: Servers, *extra: str, deny: tuple[str, ...] = ()) -> EgressPolicy:
    """api.test and secure.test (and 127.0.0.1 on their ports), plus `extra`."""
    allow = [
        f"api.test:{servers.http_port}",
        f"127.0.0.1:{servers.http_port}",
        f"secure.test:{servers.https_port}",
        f"127.0.0.1:{servers.https_port}",
        *extra,
    ]
    return EgressPolicy(allow=parse_rules(allow), deny=parse_rules(deny, what="deny"))


QUICK = NetworkLimits(header_timeout=2.0, idle_timeout=5.0, connect_timeout=5.0)


@pytest.fixture
def run(proxy: EgressProxy, servers: Servers, socket_dir: Path) -> Iterator[RunEgress]:
    run = proxy.listen(socket_dir / "a.sock")
    run.grant(policy(servers), QUICK)
    yield run
    run.close()


# --- clients --------------------------------------------------------------------------


def connect(run: RunEgress) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(20)
    sock.connect(str(run.path))
    return sock


def read_all(sock: socket.socket) -> bytes:
    chunks = []
    try:
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    except ConnectionResetError:
        pass
    return b"".join(chunks)


def raw(run: RunEgress, data: bytes) -> tuple[int, bytes]:
    """Send `data` on a new connection; the status and body of what comes back."""
    with connect(run) as sock:
        sock.sendall(data)
        reply = read_all(sock)
    head, _, body = reply.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


def get(run: RunEgress, url: str, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    """A GET through the proxy with http.client over the run's Unix socket."""

    class UnixConnection(http.client.HTTPConnection):
        def connect(self) -> None:
            self.sock = connect(run)

    conn = UnixConnection("proxy")
    try:
        conn.request("GET", url, headers=headers or {})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def open_tunnel(run: RunEgress, authority: str) -> tuple[socket.socket, bytes]:
    """A CONNECT; the socket (tunnel open if the head says 200) and the reply head."""
    sock = connect(run)
    sock.sendall(f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode())
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = sock.recv(1)
        if not chunk:
            break
        head += chunk
    return sock, head


def last(run: RunEgress) -> ConnectionRecord:
    records = run.records()
    assert records, "no record"
    return records[-1]


def wait_for_records(run: RunEgress, n: int) -> list[ConnectionRecord]:
    """Records are written when a connection ends, a moment after the client saw it end."""
    deadline = time.monotonic() + 10
    while len(records := run.records()) < n and time.monotonic() < deadline:
        time.sleep(0.01)
    return records


# --- allowed ----------------------------------------------------------------------------


def test_an_allowed_get_is_forwarded_and_recorded(run: RunEgress, servers: Servers) -> None:
    status, body = get(run, f"http://api.test:{servers.http_port}/hello?x=1")
    assert (status, body) == (200, b"hello from /hello?x=1")
    record = wait_for_records(run, 1)[-1]
    assert record.allowed and record.reason is None
    assert (record.host, record.port) == ("api.test", servers.http_port)
    assert record.address == "127.0.0.1"
    assert (record.method, record.status) == ("GET", 200)
    assert record.bytes_out > 0 and record.bytes_in > len(body)
    assert record.duration_ms >= 0


def test_the_server_gets_origin_form_without_proxy_or_hop_by_hop_headers(
    run: RunEgress, servers: Servers
) -> None:
    headers = {
        "Proxy-Authorization": "Basic c2VjcmV0",
        "Connection": "keep-alive, X-Drop",
        "X-Drop": "1",
        "X-Keep": "2",
        "Host": "somewhere.else",
    }
    status, _ = get(run, f"http://api.test:{servers.http_port}/headers", headers)
    assert status == 200
    seen = next(s for s in reversed(servers.seen) if s[":path"] == "/headers")
    assert seen["host"] == f"api.test:{servers.http_port}"
    assert seen["x-keep"] == "2"
    assert "proxy-authorization" not in seen and "x-drop" not in seen
    assert seen["connection"] == "close"


def test_a_post_body_is_forwarded(run: RunEgress, servers: Servers) -> None:
    body = b"y" * 5000
    request = (
        f"POST http://api.test:{servers.http_port}/echo HTTP/1.1\r\n"
        f"Host: api.test\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    assert raw(run, request) == (200, b"got 5000")


def test_a_connect_tunnel_carries_tls_verified_against_the_servers_certificate(
    run: RunEgress, servers: Servers
) -> None:
    sock, head = open_tunnel(run, f"secure.test:{servers.https_port}")
    assert head.startswith(b"HTTP/1.1 200")
    context = ssl.create_default_context(cadata=servers.ca_pem.decode())
    with context.wrap_socket(sock, server_hostname="secure.test") as tls:
        tls.sendall(b"GET /tls HTTP/1.1\r\nHost: secure.test\r\nConnection: close\r\n\r\n")
        reply = read_all(tls)
    assert reply.startswith(b"HTTP/1.1 200") and reply.endswith(b"hello from /tls")
    record = wait_for_records(run, 1)[-1]
    assert (record.method, record.host, record.status, record.allowed) == (
        "CONNECT",
        "secure.test",
        None,
        True,
    )
    assert record.bytes_in > len(servers.ca_pem) // 2  # the server's certificate came back


def test_an_ip_literal_allowed_explicitly_passes(run: RunEgress, servers: Servers) -> None:
    status, body = get(run, f"http://127.0.0.1:{servers.http_port}/literal")
    assert (status, body) == (200, b"hello from /literal")


# --- refused ----------------------------------------------------------------------------


def test_a_host_not_allowed_is_refused_with_a_reason(run: RunEgress, servers: Servers) -> None:
    status, body = get(run, f"http://denied.test:{servers.http_port}/hello")
    assert status == 403
    assert b"not in this run's allowed hosts" in body
    record = wait_for_records(run, 1)[-1]
    assert not record.allowed and record.address is None and record.host == "denied.test"
    assert record.reason is not None and "allowed hosts" in record.reason


@pytest.mark.parametrize(
    ("name", "address"),
    [
        ("meta.test", "169.254.169.254"),
        ("private.test", "10.1.2.3"),
        ("mapped.test", "::ffff:7f00:1"),
        ("nat64.test", "64:ff9b::a9fe:a9fe"),
        ("sixtofour.test", "2002:a00:1::1"),
        ("azure.test", "168.63.129.16"),
        ("ietf.test", "192.0.0.9"),
        ("nat64-public.test", "64:ff9b::808:808"),
    ],
)
def test_an_allowed_name_resolving_to_a_special_address_is_refused(
    proxy: EgressProxy, servers: Servers, socket_dir: Path, name: str, address: str
) -> None:
    run = proxy.listen(socket_dir / "m.sock")
    try:
        run.grant(policy(servers, f"{name}:{servers.http_port}"), QUICK)
        status, body = get(run, f"http://{name}:{servers.http_port}/")
        assert status == 403 and b"private, loopback, link-local or metadata" in body
        record = wait_for_records(run, 1)[-1]
        assert not record.allowed
        assert record.address == address and address in (record.reason or "")
    finally:
        run.close()


def test_deny_wins_over_allow(proxy: EgressProxy, servers: Servers, socket_dir: Path) -> None:
    run = proxy.listen(socket_dir / "d.sock")
    try:
        allowed = f"denied.test:{servers.http_port}"
        run.grant(policy(servers, allowed, deny=(allowed,)), QUICK)
        status, body = get(run, f"http://denied.test:{servers.http_port}/")
        assert status == 403 and b"denied by the operator's rule" in body
    finally:
        run.close()


def test_a_redirect_to_a_denied_host_is_refused_on_the_next_request(
    run: RunEgress, servers: Servers
) -> None:
    port = str(servers.http_port)
    status, _ = get(run, f"http://api.test:{port}/redirect", {"X-Port": port})
    assert status == 302
    seen = next(s for s in reversed(servers.seen) if s[":path"] == "/redirect")
    location = f"http://denied.test:{port}/hello"
    assert seen  # the first request reached the server; the client follows the Location:
    status, body = get(run, location)
    assert status == 403 and b"not in this run's allowed hosts" in body


def test_a_run_without_a_grant_is_refused(
    proxy: EgressProxy, servers: Servers, socket_dir: Path
) -> None:
    run = proxy.listen(socket_dir / "n.sock")
    try:
        assert run.path.stat().st_mode & 0o777 == 0o666
        status, body = get(run, f"http://api.test:{servers.http_port}/")
        assert status == 403 and b"no network grant" in body
    finally:
        run.close()
    assert not run.path.exists()


def test_a_revoked_run_is_refused_and_its_open_tunnels_are_closed(
    run: RunEgress, servers: Servers
) -> None:
    sock, head = open_tunnel(run, f"api.test:{servers.http_port}")
    with sock:
        assert head.startswith(b"HTTP/1.1 200")
        run.revoke()
        assert read_all(sock) == b""  # closed by the proxy, not by a timeout
    status, body = get(run, f"http://api.test:{servers.http_port}/")
    assert status == 403 and b"revoked" in body
    reasons = [r.reason or "" for r in wait_for_records(run, 2)]
    assert any("revoked or closed" in reason for reason in reasons)


def test_two_runs_cannot_use_each_others_grants(
    proxy: EgressProxy, servers: Servers, socket_dir: Path
) -> None:
    first = proxy.listen(socket_dir / "1.sock")
    second = proxy.listen(socket_dir / "2.sock")
    try:
        http_only = [f"api.test:{servers.http_port}", f"127.0.0.1:{servers.http_port}"]
        https_only = [f"secure.test:{servers.https_port}", f"127.0.0.1:{servers.https_port}"]
        first.grant(EgressPolicy(allow=parse_rules(http_only)), QUICK)
        second.grant(EgressPolicy(allow=parse_rules(https_only)), QUICK)
        assert get(first, f"http://api.test:{servers.http_port}/")[0] == 200
        assert get(second, f"http://api.test:{servers.http_port}/")[0] == 403
        sock, head = open_tunnel(first, f"secure.test:{servers.https_port}")
        sock.close()
        assert head.startswith(b"HTTP/1.1 403")
        first_records = wait_for_records(first, 2)
        assert [r.allowed for r in first_records] == [True, False]
        assert [r.allowed for r in wait_for_records(second, 1)] == [False]
    finally:
        first.close()
        second.close()


# --- bounds -----------------------------------------------------------------------------


def test_a_slowloris_client_is_cut_off_while_another_is_served(
    proxy: EgressProxy, servers: Servers, socket_dir: Path
) -> None:
    run = proxy.listen(socket_dir / "s.sock")
    try:
        run.grant(policy(servers), NetworkLimits(header_timeout=1.5))
        slow = connect(run)
        head = f"GET http://api.test:{servers.http_port}/ HTTP/1.1\r\nHost: api.test\r\n"
        cut_off = threading.Event()

        def trickle() -> None:
            try:
                for byte in head.encode() * 10:
                    slow.send(bytes([byte]))
                    time.sleep(0.25)
            except OSError:
                cut_off.set()

        sender = threading.Thread(target=trickle)
        sender.start()
        assert get(run, f"http://api.test:{servers.http_port}/fast") == (200, b"hello from /fast")
        reply = read_all(slow)
        sender.join()
        slow.close()
        assert reply.startswith(b"HTTP/1.1 408") and b"header timeout" in reply
        reasons = [r.reason for r in wait_for_records(run, 2)]
        assert any(reason and "header timeout" in reason for reason in reasons)
    finally:
        run.close()


def test_a_huge_request_head_is_refused(run: RunEgress, servers: Servers) -> None:
    head = f"GET http://api.test:{servers.http_port}/ HTTP/1.1\r\nHost: api.test\r\n"
    filler = b"X-Fill: " + b"a" * 1000 + b"\r\n"
    with connect(run) as sock:
        sock.sendall(head.encode())
        with contextlib.suppress(OSError):  # the proxy answered and closed: the point
            for _ in range(200):  # 200 KB of header, far over the head bound
                sock.sendall(filler)
        reply = read_all(sock)
    assert reply.startswith(b"HTTP/1.1 431")


Bounded = Callable[..., RunEgress]


@pytest.fixture
def bounded(proxy: EgressProxy, servers: Servers, socket_dir: Path) -> Iterator[Bounded]:
    """A run granted the test's policy under the `NetworkLimits` it is called with (one a
    test), closed after the test."""
    runs: list[RunEgress] = []

    def make(**limits: float) -> RunEgress:
        run = proxy.listen(socket_dir / "b.sock")
        runs.append(run)
        run.grant(policy(servers), NetworkLimits(**limits))  # type: ignore[arg-type]
        return run

    yield make
    for run in runs:
        run.close()


def test_the_bytes_in_limit_cuts_a_download_and_refuses_later_ones(
    bounded: Bounded, servers: Servers
) -> None:
    run = bounded(max_bytes_in=50_000)
    request = f"GET http://api.test:{servers.http_port}/big HTTP/1.1\r\nHost: a\r\n\r\n"
    with connect(run) as sock:
        sock.sendall(request.encode())
        reply = read_all(sock)
    assert len(reply) < BIG
    record = wait_for_records(run, 1)[0]
    assert record.allowed and record.reason is not None and "byte limit" in record.reason
    assert record.bytes_in <= 50_000
    status, body = get(run, f"http://api.test:{servers.http_port}/small")
    assert status == 429 and b"byte limit" in body


def test_the_bytes_out_limit_cuts_an_upload(bounded: Bounded, servers: Servers) -> None:
    run = bounded(max_bytes_out=10_000)
    body = b"z" * 100_000
    request = (
        f"POST http://api.test:{servers.http_port}/echo HTTP/1.1\r\n"
        f"Host: a\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    with connect(run) as sock:
        sock.sendall(request)
        with contextlib.suppress(OSError):  # cut off mid-body: that is the point
            sock.sendall(body)
        reply = read_all(sock)
    assert b"got 100000" not in reply
    record = wait_for_records(run, 1)[0]
    assert record.reason is not None and "byte limit" in record.reason
    assert record.bytes_out <= 10_000


def test_the_rate_limit_answers_429_and_is_recorded(bounded: Bounded, servers: Servers) -> None:
    # One token, refilled every 100 s: the second request finds none, however slow the host.
    run = bounded(requests_per_second=0.01)
    assert get(run, f"http://api.test:{servers.http_port}/")[0] == 200
    status, body = get(run, f"http://api.test:{servers.http_port}/")
    assert status == 429 and b"rate limit" in body
    assert [r.reason for r in wait_for_records(run, 2)][1].startswith("rate limit")


def test_connections_over_the_runs_limit_are_refused(bounded: Bounded, servers: Servers) -> None:
    run = bounded(max_connections=1)
    held, head = open_tunnel(run, f"api.test:{servers.http_port}")
    with held:
        assert head.startswith(b"HTTP/1.1 200")
        with connect(run) as sock:
            # Refused at accept, maybe before this request arrives (then the write
            # fails); what was sent before is read off, so the reason can be read.
            with contextlib.suppress(OSError):
                sock.sendall(f"GET http://api.test:{servers.http_port}/ HTTP/1.1\r\n\r\n".encode())
            reply = read_all(sock)
    assert reply == b"" or (reply.startswith(b"HTTP/1.1 429") and b"connection limit" in reply)
    refused = [r for r in wait_for_records(run, 2) if r.status == 429]
    assert refused and "connection limit" in (refused[0].reason or "")


def test_an_idle_tunnel_is_closed_at_the_idle_timeout(bounded: Bounded, servers: Servers) -> None:
    run = bounded(idle_timeout=0.5)
    sock, head = open_tunnel(run, f"api.test:{servers.http_port}")
    with sock:
        assert head.startswith(b"HTTP/1.1 200")
        assert read_all(sock) == b""
    assert wait_for_records(run, 1)[0].reason == "idle timeout"


# --- malformed --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("request_bytes", "status", "says"),
    [
        (b"GARBAGE\r\n\r\n", 400, b"malformed request"),
        (b"GET /relative HTTP/1.1\r\nHost: api.test\r\n\r\n", 400, b"send the whole URL"),
        (b"GET https://api.test/ HTTP/1.1\r\nHost: api.test\r\n\r\n", 400, b"CONNECT"),
        (b"CONNECT api.test HTTP/1.1\r\nHost: api.test\r\n\r\n", 400, b"host:port"),
        (b"CONNECT api.test:99999 HTTP/1.1\r\nHost: a\r\n\r\n", 400, b"host:port"),
        (b"CONNECT ::1:80 HTTP/1.1\r\nHost: a\r\n\r\n", 400, b"IPv6"),
        (b"GET http://a/b/../%00 HTTP/1.1\r\n\r\n", 400, b"malformed request"),
        (b"GET http://user:pw@api.test/ HTTP/1.1\r\nHost: a\r\n\r\n", 400, b"user:password"),
        (b"GET http://exa$mple.test/ HTTP/1.1\r\nHost: a\r\n\r\n", 400, b"not a host name"),
    ],
)
def test_malformed_requests_get_400_and_the_proxy_goes_on(
    run: RunEgress, servers: Servers, request_bytes: bytes, status: int, says: bytes
) -> None:
    got, body = raw(run, request_bytes)
    assert got == status and says in body
    assert get(run, f"http://api.test:{servers.http_port}/after")[0] == 200


def test_a_client_that_closes_at_once_is_recorded_and_harmless(
    run: RunEgress, servers: Servers
) -> None:
    connect(run).close()
    assert get(run, f"http://api.test:{servers.http_port}/")[0] == 200
    assert any(r.reason and "closed" in r.reason for r in wait_for_records(run, 2))


# --- records, the interceptor hook ------------------------------------------------------


def test_records_keep_the_first_ones_and_count_the_rest() -> None:
    log = RecordLog(limit=3)
    for n in range(5):
        log.add(ConnectionRecord(n % 2 == 0, "h", 80, None, "GET", 200, 1, 2, 0.0))
    records = log.snapshot()
    assert len(records) == 4
    assert records[-1].reason == "2 more connections not listed (1 allowed, 1 refused)"
    assert (records[-1].bytes_out, records[-1].bytes_in) == (2, 4)
    assert RECORD_LIMIT == 500


class _Hider:
    """Replaces "hello" in the body (a word split across pieces would pass: a test only)."""

    def headers(self, headers: forward.HeaderList) -> forward.HeaderList:
        return headers

    def feed(self, data: bytes) -> bytes:
        return data.replace(b"hello", b"HIDDEN")

    def flush(self) -> bytes:
        return b""


class _Rewriter:
    """An interceptor without TLS: forward_http over the tunnel with a header rewrite and a
    scrubber, as the credentials helper's TLS interceptor will do over a decrypted one."""

    async def handle(self, tunnel: Tunnel) -> None:
        assert tunnel.preread == b""

        def add_header(headers: forward.HeaderList) -> forward.HeaderList:
            return [*headers, (b"x-injected", b"yes")]

        await forward.forward_http(
            tunnel.client_reader,
            tunnel.client_writer,
            tunnel.upstream_reader,
            tunnel.upstream_writer,
            meter=tunnel.meter,
            rewrite_headers=add_header,
            scrub=_Hider(),
        )


def test_an_interceptor_can_run_forward_http_over_a_tunnel(
    servers: Servers, socket_dir: Path
) -> None:
    proxy = EgressProxy(Resolver(STATIC), interceptor=lambda host, port: _Rewriter())
    try:
        run = proxy.listen(socket_dir / "i.sock")
        run.grant(policy(servers), QUICK)
        sock, head = open_tunnel(run, f"api.test:{servers.http_port}")
        with sock:
            assert head.startswith(b"HTTP/1.1 200")
            sock.sendall(b"GET /intercepted HTTP/1.1\r\nHost: api.test\r\n\r\n")
            reply = read_all(sock)
        assert b"HIDDEN from /intercepted" in reply and b"hello" not in reply
        seen = next(s for s in reversed(servers.seen) if s[":path"] == "/intercepted")
        assert seen["x-injected"] == "yes"
    finally:
        proxy.close()


def test_the_resolver_answers_literals_the_table_and_refuses_unknown_names() -> None:
    resolver = Resolver({"API.Test.": ["192.0.2.1", "2001:db8::1"]})

    async def go() -> list[object]:
        results: list[object] = [
            await resolver.resolve("api.test", 443),
            await resolver.resolve("[2001:db8::2]", 443),
        ]
        try:
            await resolver.resolve("no-such-name.invalid", 443)
        except Exception as exc:
            results.append(str(exc))
        return results

    table, literal, error = asyncio.run(go())
    assert table == [ipaddress.ip_address("192.0.2.1"), ipaddress.ip_address("2001:db8::1")]
    assert literal == [ipaddress.ip_address("2001:db8::2")]
    assert isinstance(error, str) and "no-such-name.invalid" in error


# --- fair shares, refusal at accept, the proxy's work charged (issue 33, item 5) ---------


def _tracebacks(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [f"{r.name}: {r.getMessage()}" for r in caplog.records if r.exc_info]


def _refused_at_once(sock: socket.socket) -> bytes:
    """What a connection that sent nothing reads: the refusal and the end, or b"" when the
    proxy's close came first. A connection held open would block here (20 s timeout)."""
    with sock:
        return read_all(sock)


def test_one_runs_idle_connections_cannot_starve_another_run(
    servers: Servers, socket_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # A proxy of 8 connections: each run may hold 2 (a quarter), whatever its limits say.
    small = EgressProxy(Resolver(STATIC), max_connections=8)
    greedy, other = small.listen(socket_dir / "g.sock"), small.listen(socket_dir / "o.sock")
    try:
        greedy.grant(policy(servers), NetworkLimits(max_connections=1000))
        other.grant(policy(servers), QUICK)
        tunnels = [open_tunnel(greedy, f"api.test:{servers.http_port}") for _ in range(2)]
        assert all(head.startswith(b"HTTP/1.1 200") for _, head in tunnels)
        idle = [connect(greedy) for _ in range(30)]  # idle: they never send a byte
        # The other run is served while the greedy one holds its share and 30 more.
        assert get(other, f"http://api.test:{servers.http_port}/fair") == (
            200,
            b"hello from /fair",
        )
        replies = [_refused_at_once(sock) for sock in idle]
        assert all(r == b"" or r.startswith(b"HTTP/1.1 429") for r in replies)
        assert any(b"connection limit: this run has 2 open already" in r for r in replies)
        for sock, _ in tunnels:
            sock.close()
        refused = [r for r in wait_for_records(greedy, 32) if r.reason and "limit" in r.reason]
        assert len(refused) == 30 and all(r.duration_ms == 0.0 for r in refused)
        assert greedy.usage().refused_at_accept == 30
        assert greedy.usage().connections == 2
    finally:
        small.close()
    assert not _tracebacks(caplog)


def test_over_the_proxys_cap_a_connection_is_answered_503_and_closed_at_once(
    servers: Servers, socket_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    small = EgressProxy(Resolver(STATIC), max_connections=4, max_run_connections=4)
    first, second = small.listen(socket_dir / "f.sock"), small.listen(socket_dir / "s.sock")
    try:
        first.grant(policy(servers), QUICK)
        second.grant(policy(servers), QUICK)
        tunnels = [open_tunnel(first, f"api.test:{servers.http_port}") for _ in range(4)]
        assert all(head.startswith(b"HTTP/1.1 200") for _, head in tunnels)
        reply = _refused_at_once(connect(second))  # sends nothing, is not waited for
        assert reply == b"" or reply.startswith(b"HTTP/1.1 503")
        record = wait_for_records(second, 1)[0]
        assert record.status == 503 and "at its 4 connections" in (record.reason or "")
        for sock, _ in tunnels:
            sock.close()
        wait_for_records(first, 4)
        assert get(second, f"http://api.test:{servers.http_port}/again")[0] == 200
    finally:
        small.close()
    assert not _tracebacks(caplog)


def test_the_proxys_work_is_charged_to_the_run(run: RunEgress, servers: Servers) -> None:
    assert get(run, f"http://api.test:{servers.http_port}/big")[0] == 200
    assert get(run, f"http://api.test:{servers.http_port}/small")[0] == 200
    wait_for_records(run, 2)
    used = run.usage()
    assert used.connections == 2 and used.refused_at_accept == 0
    assert used.bytes_in >= BIG and used.bytes_out > 0
    assert used.bytes_in == sum(r.bytes_in for r in run.records())
    assert used.cpu_ms > 0  # parsing two requests and copying 200 KB is not free


_HOLD_CONNECTIONS = """
import resource, socket, sys
hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # its parent's is lowered
sys.stdin.readline()  # "go": the parent has lowered its limit by now
held = []
for _ in range(int(sys.argv[2])):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(sys.argv[1])
    held.append(s)
print("held", flush=True)
sys.stdin.read()
"""


def test_out_of_file_descriptors_the_proxy_backs_off_logs_once_and_recovers(
    servers: Servers, socket_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The descriptors run out for real: this process's soft RLIMIT_NOFILE is lowered to
    a few above what is open while another process opens connections (its own
    descriptors are its own), then restored."""
    import resource
    import subprocess
    import sys

    from codecage.egress import proxy as proxy_module

    proxy_module._last_warned.clear()
    caplog.set_level("WARNING")
    fresh = EgressProxy(Resolver(STATIC))
    run = fresh.listen(socket_dir / "fd.sock")  # the loop starts (and raises the limit) here
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    holder = None
    try:
        run.grant(policy(servers), NetworkLimits(max_connections=200, header_timeout=5.0))
        # The holder is started before the limit is lowered: starting a process takes
        # descriptors of its own (pipes), and which numbers are free is not ours to know.
        holder = subprocess.Popen(
            [sys.executable, "-c", _HOLD_CONNECTIONS, str(run.path), "60"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert holder.stdin is not None and holder.stdout is not None
        room = len(os.listdir("/proc/self/fd")) + 4
        resource.setrlimit(resource.RLIMIT_NOFILE, (room, hard))
        try:
            holder.stdin.write("go\n")
            holder.stdin.flush()
            assert holder.stdout.readline() == "held\n"
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and not any(
                "out_of_file_descriptors" in r.getMessage() for r in caplog.records
            ):
                time.sleep(0.05)
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        holder.communicate("", timeout=30)
        warned = [r for r in caplog.records if "out_of_file_descriptors" in r.getMessage()]
        assert len(warned) == 1, [r.getMessage() for r in caplog.records]
        assert not _tracebacks(caplog)
        # Accepting resumes by itself once descriptors are free again.
        assert get(run, f"http://api.test:{servers.http_port}/back")[0] == 200
    finally:
        if holder is not None:
            if holder.poll() is None:
                holder.kill()
            holder.communicate()
        fresh.close()


def test_a_runs_share_over_a_quarter_of_the_proxy_is_refused_in_config() -> None:
    from pydantic import ValidationError

    from codecage.models.settings import NetworkSettings

    with pytest.raises(ValidationError, match="quarter of \\[network\\] max_connections"):
        NetworkSettings(max_connections=16, limits=NetworkLimits(max_connections=5))
    assert NetworkSettings(max_connections=16, limits=NetworkLimits(max_connections=4))
    # Made in code, a proxy clamps a run's limit to its share instead.
    assert EgressProxy(Resolver(), max_connections=16).max_run_connections == 4


# --- who may connect: the run's own host id (SO_PEERCRED) ----------------------------------


def _as_other_id(
    path: Path, request: bytes, ids: tuple[int, int], send_after_s: float = 0.0
) -> bytes:
    """What comes back on a connection to `path` made by a forked child that is host uid
    and gid `ids` (a process of another run, as the kernel sees it), which sends `request`
    `send_after_s` after connecting."""

    def work() -> bytes:
        os.setgroups([])
        os.setresgid(ids[1], ids[1], ids[1])
        os.setresuid(ids[0], ids[0], ids[0])
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(20)
        sock.connect(str(path))
        time.sleep(send_after_s)
        sock.sendall(request)
        return read_all(sock) or b"(nothing)"

    got = in_forked_child(work, timeout=30)
    assert got, "the child could not connect"
    return got


@pytest.mark.skipif(os.geteuid() != 0, reason="only root can be another id in a child")
def test_a_client_that_is_not_the_runs_id_is_refused_and_recorded(
    proxy: EgressProxy, servers: Servers, socket_dir: Path
) -> None:
    """The socket's file mode is opened to all here, as a path another run can reach
    would be: the kernel's credentials of the client alone decide."""
    own, other = (2_000_000_101, 2_000_000_101), (2_000_000_102, 2_000_000_102)
    run = proxy.listen(socket_dir / "a.sock", frozenset({own}))
    try:
        run.grant(policy(servers), QUICK)
        socket_dir.chmod(0o755)
        run.path.chmod(0o777)
        request = f"GET http://api.test:{servers.http_port}/x HTTP/1.1\r\nHost: a\r\n\r\n"
        # Sent after the refusal is written: the client still reads it (no reset, no EPIPE).
        refused = _as_other_id(run.path, request.encode(), other, send_after_s=0.3)
        assert refused.startswith(b"HTTP/1.1 403"), refused
        assert b"not the run this socket belongs to" in refused
        (record,) = run.records()
        assert not record.allowed and record.status == 403
        assert "uid 2000000102" in (record.reason or "")
        served = _as_other_id(run.path, request.encode(), own)
        assert served.startswith(b"HTTP/1.1 200"), served
    finally:
        run.close()
