"""A Host's egress, made once from its `[network]` settings at the first run allowed
network: the proxy (with its resolver), and what every egress sandbox is given to reach it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from codecage.egress.proxy import EgressProxy
from codecage.egress.resolve import Resolver
from codecage.models import NetworkSettings


@dataclass(frozen=True, slots=True)
class EgressSetup:
    """How sandboxes made for egress reach the proxy (one Host's, for all its runs)."""

    proxy: EgressProxy
    ca_bundle: Path | None = None  # the system's CAs + the proxy's own, when it has one
    extra_env: tuple[tuple[str, str], ...] = ()  # credential placeholders, pip's index


def build(settings: NetworkSettings) -> EgressSetup:
    """Start the proxy for `settings` (its thread starts at the first connection)."""
    upstream_ca = Path(settings.upstream_ca_file) if settings.upstream_ca_file else None
    proxy = EgressProxy(Resolver(settings.resolve), upstream_ca_file=upstream_ca)
    extra_env: list[tuple[str, str]] = []
    if settings.pip_index_url:
        extra_env.append(("PIP_INDEX_URL", settings.pip_index_url))
    return EgressSetup(proxy=proxy, extra_env=tuple(extra_env))
