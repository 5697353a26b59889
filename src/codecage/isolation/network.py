"""Network isolation: by default the sandbox has its own empty network namespace.

No interface but the namespace's own loopback (bwrap brings it up; nothing listens there),
no route, no DNS, and the seccomp filter refuses every socket family but AF_UNIX, so not
even that loopback can be used. Abstract UNIX sockets are scoped to the network namespace,
so the host's are out of reach too. A later policy layer may add declared egress.
"""

from __future__ import annotations

from dataclasses import dataclass

from codecage.models import LayerStatus


@dataclass(frozen=True, slots=True)
class NetworkPlan:
    isolated: bool  # own empty network namespace


def plan(*, allow_network: bool = False) -> NetworkPlan:
    """The network plan for a run (pure). Only isolation exists today."""
    return NetworkPlan(isolated=not allow_network)


def bwrap_args(network: NetworkPlan) -> list[str]:
    return ["--unshare-net"] if network.isolated else ["--share-net"]


def probe(namespaces_ok: bool) -> LayerStatus:
    return LayerStatus(
        name="network",
        active=namespaces_ok,
        mechanism="empty network namespace + seccomp socket filter",
        detail="no interfaces but the sandbox's own loopback; only AF_UNIX sockets may be created",
    )
