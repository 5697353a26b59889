"""Credentials at the edge, in the proxy: for a host with a configured credential, the
request gets its header set here (the sandbox only ever had a placeholder) and the response
comes back with the secret scrubbed out. Every other host is tunnelled untouched.

HTTPS: the sandbox's TLS is terminated with a leaf of the installation's CA (which the
sandbox trusts through its CA bundle), the request is read with h11, and the proxy talks
TLS to the real server itself, verifying it for the host, over the connection the proxy
already opened to the address it checked. Plain HTTP: the same header set and scrub on the
forwarded request. Compressed answers are refused: a scrubber cannot read them.
"""

from __future__ import annotations

import ssl

from codecage.egress import forward, tls
from codecage.egress.ca import CertificateAuthority
from codecage.egress.credentials import CredentialStore, HostCredential, ResponseScrubber
from codecage.egress.forward import HeaderList, Refusal
from codecage.egress.proxy import Interceptor, Tunnel


class CredentialEdge:
    """The proxy's hooks for credential hosts: an interceptor per CONNECT tunnel, and the
    header rewrite and response filter of a plain HTTP request."""

    def __init__(
        self, store: CredentialStore, ca: CertificateAuthority, upstream: ssl.SSLContext
    ) -> None:
        self.store = store
        self.ca = ca
        self.upstream = upstream  # verifying client context for the real servers

    def __call__(self, host: str, port: int) -> Interceptor | None:
        """The interceptor of a tunnel to `host`:`port`: None unless it has a credential."""
        credential = self.store.lookup(host, port)
        return None if credential is None else _TerminateTLS(self, credential)

    def plain(self, host: str, port: int) -> tuple[forward.HeaderRewrite, forward.Scrub] | None:
        """A plain HTTP request's rewrite and response filter, or None (no credential)."""
        credential = self.store.lookup(host, port)
        if credential is None:
            return None
        return credential.rewrite_headers, self.response_filter()

    def response_filter(self) -> _ScrubbedResponse:
        return _ScrubbedResponse(self.store)


class _TerminateTLS:
    def __init__(self, edge: CredentialEdge, credential: HostCredential) -> None:
        self.edge = edge
        self.credential = credential

    async def handle(self, tunnel: Tunnel) -> None:
        if tunnel.preread:
            # The client sent its TLS hello before our 200: too early to take it over.
            raise Refusal(400, "the client spoke before the tunnel was established")
        context = self.edge.ca.server_context(tunnel.host)
        try:
            await tls.terminate(tunnel.client_reader, tunnel.client_writer, context)
            await tunnel.upstream_writer.start_tls(
                self.edge.upstream, server_hostname=tunnel.host.strip("[]")
            )
        except tls.TLSFailure as exc:
            raise forward.Cutoff(exc.reason) from None
        except (ssl.SSLError, OSError) as exc:
            raise forward.Cutoff(f"TLS to {tunnel.host} failed: {exc}") from None
        await forward.forward_http(
            tunnel.client_reader,
            tunnel.client_writer,
            tunnel.upstream_reader,
            tunnel.upstream_writer,
            meter=tunnel.meter,
            rewrite_headers=self.credential.rewrite_headers,
            scrub=self.edge.response_filter(),
        )


class _ScrubbedResponse:
    """A response from a credential host, every secret (and its base64 forms) replaced."""

    def __init__(self, store: CredentialStore) -> None:
        self._store = store
        self._body: ResponseScrubber = store.response_scrubber()

    def headers(self, headers: HeaderList) -> HeaderList:
        for name, value in headers:
            if name.lower() == b"content-encoding" and value.strip().lower() != b"identity":
                raise Refusal(
                    502,
                    "the server answered compressed although asked for identity: a "
                    "credential host's answer must be readable to be scrubbed",
                )
        return self._store.scrub_headers(headers)

    def feed(self, data: bytes) -> bytes:
        return self._body.feed(data)

    def flush(self) -> bytes:
        return self._body.flush()
