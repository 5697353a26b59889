"""The egress proxy's CA and TLS at the edge, with real TLS over real sockets: a client that
trusts only the CA bundle handshakes with `terminate`; a verified connection to a local
HTTPS server that has its own test CA (`open_verified`)."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import os
import ssl
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from cryptography import x509

from codecage.egress import ca as ca_module
from codecage.egress.ca import CertificateAuthority
from codecage.egress.tls import TLSFailure, open_verified, terminate
from codecage.errors import ConfigError
from codecage.packages import user_data_dir

HOST = "api.example.com"
Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@pytest.fixture
def ca(tmp_path: Path) -> CertificateAuthority:
    return CertificateAuthority.load_or_create(tmp_path / "egress-ca")


# --- the CA on disk ----------------------------------------------------------------------


def test_the_ca_is_made_once_then_loaded_with_a_private_key_and_directory(tmp_path: Path) -> None:
    directory = tmp_path / "data" / "egress-ca"
    first = CertificateAuthority.load_or_create(directory)
    again = CertificateAuthority.load_or_create(directory)
    assert again.cert_pem == first.cert_pem
    assert (directory / "ca.key").stat().st_mode & 0o777 == 0o600
    assert directory.stat().st_mode & 0o777 == 0o700
    assert first.name.startswith("codecage egress CA ")
    constraints = first.cert.extensions.get_extension_for_class(x509.BasicConstraints)
    assert constraints.critical and constraints.value.ca
    lifetime = first.cert.not_valid_after_utc - first.cert.not_valid_before_utc
    assert lifetime > datetime.timedelta(days=3649)


def test_concurrent_starts_share_one_ca(tmp_path: Path) -> None:
    directory = tmp_path / "egress-ca"
    made: list[bytes] = []

    def start() -> None:
        made.append(CertificateAuthority.load_or_create(directory).cert_pem)

    threads = [threading.Thread(target=start) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(made) == 4 and len(set(made)) == 1


def test_the_default_directory_follows_the_packages_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    assert user_data_dir("egress-ca", {"XDG_DATA_HOME": "/srv/data"}) == Path(
        "/srv/data/codecage/egress-ca"
    )
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    assert ca_module.default_directory({}) == Path("/var/lib/codecage/egress-ca")
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert ca_module.default_directory({"XDG_DATA_HOME": "/home/u/.data"}) == Path(
        "/home/u/.data/codecage/egress-ca"
    )


def test_a_world_writable_directory_is_refused(tmp_path: Path) -> None:
    directory = tmp_path / "egress-ca"
    directory.mkdir()
    directory.chmod(0o777)
    with pytest.raises(ConfigError, match="writable by group and others"):
        CertificateAuthority.load_or_create(directory)


def test_a_directory_under_a_world_writable_parent_is_refused(tmp_path: Path) -> None:
    parent = tmp_path / "shared"
    parent.mkdir()
    parent.chmod(0o777)
    with pytest.raises(ConfigError, match="not trusted"):
        CertificateAuthority.load_or_create(parent / "egress-ca")


@pytest.mark.needs_root
def test_a_directory_another_user_owns_is_refused(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("chown to another user needs root")
    directory = tmp_path / "egress-ca"
    directory.mkdir(mode=0o700)
    os.chown(directory, 4242, 4242)
    with pytest.raises(ConfigError, match="owned by uid 4242"):
        CertificateAuthority.load_or_create(directory)


@pytest.mark.needs_root
def test_a_key_another_user_owns_is_refused(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("chown to another user needs root")
    directory = tmp_path / "egress-ca"
    CertificateAuthority.load_or_create(directory)
    os.chown(directory / "ca.key", 4242, 4242)
    with pytest.raises(ConfigError, match="owned by uid 4242"):
        CertificateAuthority.load_or_create(directory)


def test_a_key_others_can_read_is_refused_with_how_to_rotate(tmp_path: Path) -> None:
    directory = tmp_path / "egress-ca"
    CertificateAuthority.load_or_create(directory)
    (directory / "ca.key").chmod(0o644)
    with pytest.raises(ConfigError, match="can be read by group or others") as caught:
        CertificateAuthority.load_or_create(directory)
    assert "delete the directory" in caught.value.hint


def test_a_key_behind_a_link_is_refused(tmp_path: Path) -> None:
    directory = tmp_path / "egress-ca"
    CertificateAuthority.load_or_create(directory)
    moved = tmp_path / "elsewhere.key"
    (directory / "ca.key").rename(moved)
    (directory / "ca.key").symlink_to(moved)
    with pytest.raises(ConfigError, match="cannot be opened"):
        CertificateAuthority.load_or_create(directory)


def test_deleting_the_directory_rotates_the_ca(tmp_path: Path) -> None:
    directory = tmp_path / "egress-ca"
    old = CertificateAuthority.load_or_create(directory)
    for child in directory.iterdir():
        child.unlink()
    directory.rmdir()
    new = CertificateAuthority.load_or_create(directory)
    assert new.cert_pem != old.cert_pem and new.name != old.name


def test_the_bundle_holds_the_system_cas_and_this_one(ca: CertificateAuthority, tmp_path: Path):
    path = ca.bundle_file(tmp_path)
    data = path.read_bytes()
    assert path.stat().st_mode & 0o777 == 0o644
    assert data.endswith(ca.cert_pem)
    system = ca_module.system_ca_pem()
    assert system and data.count(b"BEGIN CERTIFICATE") == system.count(b"BEGIN CERTIFICATE") + 1


# --- leaves ------------------------------------------------------------------------------


def test_leaf_contexts_are_cached_per_host_and_the_cache_is_bounded(tmp_path: Path) -> None:
    ca = CertificateAuthority.load_or_create(tmp_path / "ca")
    ca = CertificateAuthority(ca._key, ca.cert, cache_hosts=2)
    first = ca.server_context("a.example.com")
    assert ca.server_context("A.example.com.") is first
    ca.server_context("b.example.com")
    ca.server_context("c.example.com")
    assert ca.server_context("a.example.com") is not first


def test_leaf_validity_is_bounded_to_one_to_thirty_days(ca: CertificateAuthority) -> None:
    with pytest.raises(ValueError, match="1 to 30"):
        CertificateAuthority(ca._key, ca.cert, leaf_days=31)
    with pytest.raises(ValueError, match="1 to 30"):
        CertificateAuthority(ca._key, ca.cert, leaf_days=0)


def test_a_host_that_is_no_name_gets_no_certificate(ca: CertificateAuthority) -> None:
    with pytest.raises(ValueError, match="not a host name"):
        ca.server_context("bad host/")


# --- terminate: the sandbox's side -------------------------------------------------------


async def _serve(handler: Handler, tls: ssl.SSLContext | None = None) -> tuple[asyncio.Server, int]:
    server = await asyncio.start_server(handler, "127.0.0.1", 0, ssl=tls)
    return server, server.sockets[0].getsockname()[1]


def _proxy(
    ca: CertificateAuthority, host: str, outcome: list[object], timeout_s: float = 10.0
) -> Handler:
    """The proxy's part: answer CONNECT, terminate TLS with the host's leaf, echo a line."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
            await writer.drain()
            reader, writer = await terminate(
                reader, writer, ca.server_context(host), timeout_s=timeout_s
            )
            line = await reader.readline()
            writer.write(b"echo " + line)
            await writer.drain()
            outcome.append(line)
        except TLSFailure as exc:
            outcome.append(exc)
        finally:
            writer.close()

    return handle


async def _client(
    port: int, context: ssl.SSLContext, server_hostname: str
) -> tuple[bytes, dict[str, object]]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(f"CONNECT {server_hostname}:443 HTTP/1.1\r\n\r\n".encode())
        assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200")
        await writer.start_tls(context, server_hostname=server_hostname)
        peer = writer.get_extra_info("ssl_object").getpeercert()
        writer.write(b"hello\n")
        await writer.drain()
        return await reader.readline(), peer
    finally:
        writer.close()
        await _closed(writer)


async def _closed(writer: asyncio.StreamWriter) -> None:
    # After a failed handshake the other side has already hung up.
    with contextlib.suppress(OSError, ssl.SSLError):
        await writer.wait_closed()


def _trusting(bundle: Path) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(bundle))


def test_a_client_trusting_the_bundle_handshakes_with_terminate(
    ca: CertificateAuthority, tmp_path: Path
) -> None:
    context = _trusting(ca.bundle_file(tmp_path))
    outcome: list[object] = []

    async def main() -> tuple[bytes, dict[str, object]]:
        server, port = await _serve(_proxy(ca, HOST, outcome))
        async with server:
            return await _client(port, context, HOST)

    echoed, peer = asyncio.run(main())
    assert echoed == b"echo hello\n" and outcome == [b"hello\n"]
    assert peer["subjectAltName"] == (("DNS", HOST),)
    not_after = datetime.datetime.strptime(str(peer["notAfter"]), "%b %d %H:%M:%S %Y %Z")
    days_left = not_after - datetime.datetime.now()
    assert datetime.timedelta(hours=23) < days_left <= datetime.timedelta(days=30)


def test_an_ip_literal_host_gets_an_ip_address_certificate(
    ca: CertificateAuthority, tmp_path: Path
) -> None:
    context = _trusting(ca.bundle_file(tmp_path))

    async def main() -> tuple[bytes, dict[str, object]]:
        server, port = await _serve(_proxy(ca, "127.0.0.1", []))
        async with server:
            return await _client(port, context, "127.0.0.1")

    echoed, peer = asyncio.run(main())
    assert echoed == b"echo hello\n"
    assert peer["subjectAltName"] == (("IP Address", "127.0.0.1"),)


def test_the_wrong_host_name_fails_verification(ca: CertificateAuthority, tmp_path: Path) -> None:
    context = _trusting(ca.bundle_file(tmp_path))
    outcome: list[object] = []

    async def main() -> None:
        server, port = await _serve(_proxy(ca, HOST, outcome))
        async with server:
            with pytest.raises(ssl.SSLCertVerificationError, match="Hostname mismatch"):
                await _client(port, context, "other.example.com")
            await _until(lambda: bool(outcome))

    asyncio.run(main())
    assert isinstance(outcome[0], TLSFailure)


def test_a_client_without_the_bundle_does_not_trust_the_proxy(ca: CertificateAuthority) -> None:
    async def main() -> None:
        server, port = await _serve(_proxy(ca, HOST, []))
        async with server:
            with pytest.raises(ssl.SSLCertVerificationError, match="unable to get local issuer"):
                await _client(port, ssl.create_default_context(), HOST)

    asyncio.run(main())


def test_a_client_that_never_says_hello_is_dropped(ca: CertificateAuthority) -> None:
    outcome: list[object] = []

    async def main() -> None:
        server, port = await _serve(_proxy(ca, HOST, outcome, timeout_s=0.2))
        async with server:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"CONNECT api.example.com:443 HTTP/1.1\r\n\r\n")
            await reader.readuntil(b"\r\n\r\n")
            assert await reader.read() == b""  # the proxy hung up: no TLS ever started
            writer.close()
            await _closed(writer)
            await _until(lambda: bool(outcome))

    asyncio.run(main())
    assert isinstance(outcome[0], TLSFailure) and "timed out" in outcome[0].reason


async def _until(condition: Callable[[], bool]) -> None:
    async with asyncio.timeout(10):
        while not condition():
            await asyncio.sleep(0.01)


# --- open_verified: the real server's side -----------------------------------------------


async def _answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """The real server's part (it listens with its test CA's leaf): answer one line."""
    try:
        writer.write(b"hi " + await reader.readline())
        await writer.drain()
    except (OSError, ssl.SSLError):
        pass  # a client that refused our certificate
    finally:
        writer.close()


def _test_ca(tmp_path: Path) -> tuple[CertificateAuthority, str]:
    test_ca = CertificateAuthority.load_or_create(tmp_path / "test-ca")
    cafile = tmp_path / "test-ca.pem"
    cafile.write_bytes(test_ca.cert_pem)
    return test_ca, str(cafile)


async def _ask(host: str, port: int, *, cafile: str | None) -> bytes:
    reader, writer = await open_verified(host, port, "127.0.0.1", cafile=cafile)
    try:
        writer.write(b"there\n")
        await writer.drain()
        return await reader.readline()
    finally:
        writer.close()
        await _closed(writer)


def test_open_verified_reaches_a_server_whose_certificate_names_the_host(tmp_path: Path) -> None:
    test_ca, cafile = _test_ca(tmp_path)

    async def main() -> bytes:
        server, port = await _serve(_answer, test_ca.server_context("api.test"))
        async with server:
            return await _ask("api.test", port, cafile=cafile)

    assert asyncio.run(main()) == b"hi there\n"


@pytest.mark.parametrize(
    ("asked", "trusted", "reason"),
    [
        ("other.test", True, "Hostname mismatch"),
        ("api.test", False, "unable to get local issuer"),
    ],
)
def test_open_verified_refuses_a_server_it_cannot_verify_for_the_host(
    tmp_path: Path, asked: str, trusted: bool, reason: str
) -> None:
    test_ca, cafile = _test_ca(tmp_path)

    async def main() -> None:
        server, port = await _serve(_answer, test_ca.server_context("api.test"))
        async with server:
            with pytest.raises(TLSFailure, match=reason):
                await _ask(asked, port, cafile=cafile if trusted else None)

    asyncio.run(main())
