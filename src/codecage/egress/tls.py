"""TLS at the edge, for the credential hosts only: the sandbox's side terminated with the
CA's leaf (`terminate`), the real server's side opened and verified (`open_verified`).

Both sides speak HTTP/1.1 only (ALPN), since the proxy reads the requests in between. A
handshake that does not finish within its timeout, or fails (the sandbox does not trust
the CA, the real server's certificate does not verify for the host), raises `TLSFailure`,
whose `reason` is short enough for a `network_denied` event.
"""

from __future__ import annotations

import asyncio
import functools
import ssl

HANDSHAKE_TIMEOUT_S = 10.0


class TLSFailure(Exception):
    """A TLS handshake at the edge failed or timed out; `reason` says which, for an event."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


async def terminate(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    context: ssl.SSLContext,
    *,
    timeout_s: float = HANDSHAKE_TIMEOUT_S,
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Upgrade a connection the proxy accepted (with `asyncio.start_server` or
    `start_unix_server`), after it answered CONNECT with 200, to server-side TLS with
    `context` (`CertificateAuthority.server_context(host)`). The same reader and writer
    then carry the plaintext. Call it before reading past the CONNECT request's head: bytes
    already read would be lost to TLS. On failure the connection is closed.

    Raises:
        TLSFailure: the handshake failed or took longer than `timeout_s`.
    """
    try:
        async with asyncio.timeout(timeout_s + 1.0):  # start_tls's own bound, held by ours
            await writer.start_tls(context, ssl_handshake_timeout=timeout_s)
    except (ssl.SSLError, OSError) as exc:  # TimeoutError is an OSError
        writer.transport.abort()
        if _timed_out(exc):
            raise TLSFailure(
                f"TLS handshake with the sandbox timed out after {timeout_s:g} s"
            ) from exc
        raise TLSFailure(f"TLS handshake with the sandbox failed: {_described(exc)}") from exc
    return reader, writer


async def open_verified(
    host: str,
    port: int,
    address: str,
    *,
    cafile: str | None = None,
    timeout_s: float = HANDSHAKE_TIMEOUT_S,
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A TLS connection to the real server at `address` (already resolved and allowed by the
    proxy), sending SNI for `host` and verifying its certificate for `host` against the
    system's CAs, plus `cafile` (a test's own CA) when given.

    Raises:
        TLSFailure: the connection, the handshake or the verification failed, or it took
            longer than `timeout_s`.
    """
    context = client_context(cafile)
    try:
        async with asyncio.timeout(timeout_s + 1.0):
            return await asyncio.open_connection(
                address,
                port,
                ssl=context,
                server_hostname=host.strip("[]"),
                ssl_handshake_timeout=timeout_s,
            )
    except (ssl.SSLError, OSError) as exc:
        if _timed_out(exc):
            raise TLSFailure(f"TLS connection to {host} timed out after {timeout_s:g} s") from exc
        raise TLSFailure(f"TLS connection to {host} failed: {_described(exc)}") from exc


@functools.lru_cache(maxsize=8)
def client_context(cafile: str | None = None) -> ssl.SSLContext:
    """The verifying client context (system CAs, and `cafile`), made once per `cafile`:
    loading the system's CAs costs milliseconds, a context is safe to share."""
    context = ssl.create_default_context()
    if cafile is not None:
        context.load_verify_locations(cafile=cafile)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.set_alpn_protocols(["http/1.1"])
    return context


def _timed_out(exc: BaseException) -> bool:
    # asyncio's own handshake bound aborts with ConnectionAbortedError("... taking longer ...")
    return isinstance(exc, TimeoutError) or (
        isinstance(exc, ConnectionAbortedError) and "taking longer" in str(exc)
    )


def _described(exc: BaseException) -> str:
    if isinstance(exc, ssl.SSLCertVerificationError):
        return f"certificate verify failed: {exc.verify_message}"
    if isinstance(exc, ssl.SSLError):
        return exc.reason or str(exc)
    return str(exc) or type(exc).__name__
