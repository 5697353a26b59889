"""A Host's egress, made once from its `[network]` settings at the first run allowed
network: the proxy (with its resolver and, when credentials are configured, the edge that
adds them), and what every egress sandbox is given to reach it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from codecage.egress import tls
from codecage.egress.ca import CertificateAuthority
from codecage.egress.credentials import CredentialStore
from codecage.egress.edge import CredentialEdge
from codecage.egress.proxy import EgressProxy
from codecage.egress.resolve import Resolver
from codecage.isolation import rootfs
from codecage.models import NetworkSettings


@dataclass(frozen=True, slots=True)
class EgressSetup:
    """How sandboxes made for egress reach the proxy (one Host's, for all its runs)."""

    proxy: EgressProxy
    ca_bundle: Path | None = None  # the system's CAs + the proxy's own, when it has one
    extra_env: tuple[tuple[str, str], ...] = ()  # credential placeholders, pip's index


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
    if not settings.credentials:
        return EgressSetup(
            EgressProxy(resolver, upstream_ca_file=upstream_ca), None, tuple(extra_env)
        )
    store = CredentialStore.load(settings.credentials, base_dir=base_dir)
    ca = CertificateAuthority.load_or_create(ca_dir)
    upstream = tls.client_context(str(upstream_ca) if upstream_ca else None)
    edge = CredentialEdge(store, ca, upstream)
    proxy = EgressProxy(
        resolver, upstream_ca_file=upstream_ca, interceptor=edge, plain_edge=edge.plain
    )
    bundle = ca.bundle_file(_bundle_dir())
    extra_env += sorted(store.environment(lambda host, port: True).items())
    return EgressSetup(proxy, bundle, tuple(extra_env))


def _bundle_dir() -> Path:
    directory = rootfs.cache_dir() / "egress"
    directory.mkdir(parents=True, exist_ok=True)
    return directory
