"""A Host's egress, made once from its `[network]` settings at the first run allowed
network: the proxy (with its resolver and, when credentials are configured, the edge that
adds them), and what every egress sandbox is given to reach it."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from codecage.egress.ca import CertificateAuthority
from codecage.egress.credentials import CredentialStore
from codecage.egress.edge import CredentialEdge
from codecage.egress.proxy import EgressProxy, RunEgress
from codecage.egress.resolve import Resolver
from codecage.isolation.identity import Identity
from codecage.models import NetworkSettings


@dataclass(frozen=True, slots=True)
class EgressSetup:
    """How sandboxes made for egress reach the proxy (one Host's, for all its runs)."""

    proxy: EgressProxy
    ca_bundle: bytes | None = None  # the system's CAs + the proxy's own, when it has one
    extra_env: tuple[tuple[str, str], ...] = ()  # credential placeholders, pip's index

    def open_socket(
        self, directory: Path, owner: Identity, *, launcher: Identity | None = None
    ) -> RunEgress:
        """A new socket on the proxy in `directory` (made here, with the CA bundle beside
        it), connectable by the sandbox's own host id (`owner`) only: another local user
        who guessed the path could otherwise use the grant, and another run (of another
        id: `isolation.identity`) that found it is refused by its credentials. `launcher`:
        the host id whose processes connect for the sandbox when that is not `owner`
        (gVisor's Sentry, root's). Everything is refused on it until `RunEgress.grant`;
        the caller closes it."""
        directory.mkdir(exist_ok=True)
        # Searchable by all: the sandbox's own host id reaches the socket (and the CA
        # bundle) by name through it; nothing in it can be listed or written.
        directory.chmod(0o711)
        if self.ca_bundle is not None:
            (directory / "ca-bundle.pem").write_bytes(self.ca_bundle)
        peers = {(owner.uid, owner.gid)}
        if launcher is not None:
            peers.add((launcher.uid, launcher.gid))
        listener = self.proxy.listen(directory / "egress.sock", frozenset(peers))
        if os.geteuid() == 0:
            os.chown(listener.path, owner.uid, owner.gid)
        listener.path.chmod(0o600)
        return listener


def build(
    settings: NetworkSettings, *, base_dir: Path | None = None, ca_dir: Path | None = None
) -> EgressSetup:
    """The proxy for `settings` (its thread starts with the first sandbox's socket).

    Raises:
        ConfigError: a credential cannot be read (its variable unset, its file missing),
            or the CA's directory is not the operator's.
    """
    upstream_ca = Path(settings.upstream_ca_file) if settings.upstream_ca_file else None
    extra_env: list[tuple[str, str]] = []
    if settings.pip_index_url:
        extra_env.append(("PIP_INDEX_URL", settings.pip_index_url))
    resolver = Resolver(settings.resolve)
    cap = settings.max_connections
    if not settings.credentials:
        return EgressSetup(
            EgressProxy(resolver, upstream_ca_file=upstream_ca, max_connections=cap),
            None,
            tuple(extra_env),
        )
    store = CredentialStore.load(settings.credentials, base_dir=base_dir)
    ca = CertificateAuthority.load_or_create(ca_dir)
    proxy = EgressProxy(resolver, upstream_ca_file=upstream_ca, max_connections=cap)
    edge = CredentialEdge(store, ca, proxy.upstream_ssl_context())
    proxy.interceptor, proxy.plain_edge = edge, edge.plain
    extra_env += sorted(store.environment(lambda host, port: True).items())
    return EgressSetup(proxy, ca.bundle_pem(), tuple(extra_env))
