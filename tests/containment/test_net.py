"""Network layer: an empty network namespace (only a loopback of its own), and a seccomp
filter that refuses every socket family but AF_UNIX."""

from __future__ import annotations

import secrets
import socket
from collections.abc import Iterator

import pytest

from codecage import Sandbox

from ._support import NetCanary, Runner, answering, assert_absent, guest, report

pytestmark = pytest.mark.timeout(60)


def test_the_net_canary_on_host_loopback_cannot_be_reached(
    runner: Runner, net_canary: NetCanary
) -> None:
    code = guest(
        """
        import json, socket
        attempts = {}
        for host in ("127.0.0.1", "localhost", "::1", "::ffff:127.0.0.1"):
            try:
                with socket.create_connection((host, $port), timeout=2) as s:
                    attempts[host] = s.recv(100).decode()
            except OSError as exc:
                attempts[host] = type(exc).__name__
        print(json.dumps(attempts))
        """,
        port=net_canary.port,
    )
    seen = runner(code, timeout=15)
    assert_absent(net_canary.token, seen)
    attempts = report(seen)
    assert set(attempts.values()) <= {"PermissionError", "OSError", "gaierror"}, attempts
    assert net_canary.connections == []


@pytest.mark.parametrize(
    ("family", "kind", "proto"),
    [
        ("AF_INET", "SOCK_STREAM", 0),
        ("AF_INET", "SOCK_DGRAM", 0),
        ("AF_INET6", "SOCK_STREAM", 0),
        ("AF_NETLINK", "SOCK_RAW", socket.NETLINK_ROUTE),
        ("AF_PACKET", "SOCK_RAW", 0),
    ],
)
def test_a_socket_of_a_network_family_cannot_be_created(
    runner: Runner, family: str, kind: str, proto: int
) -> None:
    code = guest(
        """
        import json, socket
        try:
            socket.socket(getattr(socket, $family), getattr(socket, $kind), $proto).close()
            outcome = "created"
        except OSError as exc:
            outcome = type(exc).__name__
        print(json.dumps(outcome))
        """,
        family=family,
        kind=kind,
        proto=proto,
    )
    assert report(runner(code, timeout=10)) == "PermissionError"


def test_there_is_no_network_interface_but_loopback(runner: Runner) -> None:
    code = """
import json
with open("/proc/net/dev", encoding="ascii") as f:
    names = [line.split(":")[0].strip() for line in f.readlines()[2:]]
with open("/proc/net/route", encoding="ascii") as f:
    routes = f.readlines()[1:]
print(json.dumps({"interfaces": names, "ipv4_routes": routes}))
"""
    assert report(runner(code, timeout=10)) == {"interfaces": ["lo"], "ipv4_routes": []}


@pytest.fixture
def abstract_listener() -> Iterator[bytes]:
    """A host AF_UNIX listener in the abstract namespace (scoped to the network namespace)."""
    name = b"\0codecage-test-" + secrets.token_hex(8).encode()
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(name)
    server.listen()
    server.settimeout(0.2)
    with answering(server, b"host-abstract-socket"):
        yield name


def test_a_host_abstract_unix_socket_cannot_be_reached(
    runner: Runner, abstract_listener: bytes
) -> None:
    code = guest(
        """
        import json, socket
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(2)
        try:
            s.connect($name)
            outcome = s.recv(100).decode()
        except OSError as exc:
            outcome = type(exc).__name__
        print(json.dumps(outcome))
        """,
        name=abstract_listener,
    )
    seen = runner(code, timeout=10)
    assert report(seen) == "ConnectionRefusedError"
    assert "host-abstract-socket" not in seen.stdout


def test_an_af_unix_socketpair_works(sandbox: Sandbox) -> None:
    r = sandbox.run(
        "import socket\na, b = socket.socketpair()\na.sendall(b'ping')\nb.recv(4).decode()"
    )
    assert r.status == "ok", r.error
    assert r.return_value == "ping"
    assert "network_denied" not in [e.kind for e in r.events]


def test_a_refused_socket_leaves_a_network_denied_event(sandbox: Sandbox) -> None:
    r = sandbox.run(
        "import socket\n"
        "try:\n"
        "    socket.socket(socket.AF_INET, socket.SOCK_STREAM)\n"
        "except PermissionError as exc:\n"
        "    refused = exc.errno\n"
        "refused"
    )
    assert r.status == "ok", r.error
    assert r.return_value == 1  # EPERM
    assert [e.kind for e in r.events] == ["network_denied"]


def test_the_network_denied_event_names_the_socket_family(sandbox: Sandbox) -> None:
    r = sandbox.run(
        "import socket\n"
        "try:\n"
        "    socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)\n"
        "except PermissionError:\n"
        "    pass"
    )
    assert [e.detail for e in r.events if e.kind == "network_denied"] == [
        "socket(AF_INET6) attempted: the sandbox has no network"
    ]


def test_an_unhandled_refused_connection_is_an_error_with_the_event(sandbox: Sandbox) -> None:
    r = sandbox.run("import urllib.request\nurllib.request.urlopen('http://127.0.0.1:9/')")
    assert r.status == "error"
    assert r.error is not None
    assert "network_denied" in [e.kind for e in r.events]
