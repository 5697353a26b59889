"""Network isolation: by default the sandbox has its own empty network namespace.

No interface but the namespace's own loopback (bwrap brings it up; nothing listens there),
no route, no DNS, and the seccomp filter refuses every socket family but AF_UNIX, so not
even that loopback can be used. Abstract UNIX sockets are scoped to the network namespace,
so the host's are out of reach too. A run allowed egress (docs/security-model.md) keeps the
same namespace; seccomp then allows AF_INET/AF_INET6 too, which reach only that loopback,
where the relay to the host proxy listens.
"""

from __future__ import annotations

from dataclasses import dataclass

from codecage.models import LayerStatus


@dataclass(frozen=True, slots=True)
class NetworkPlan:
    isolated: bool  # own network namespace (always: egress goes through the host proxy)
    inet_sockets: bool  # seccomp lets the code make IP sockets (for the egress relay)


def plan(*, allow_network: bool = False) -> NetworkPlan:
    """The network plan for a run (pure). A run allowed egress keeps its own namespace,
    with nothing but loopback: its only way out is the relay to the host proxy's Unix
    socket (engine/egress.py); the host's network is never shared."""
    return NetworkPlan(isolated=True, inet_sockets=allow_network)


def bwrap_args(network: NetworkPlan) -> list[str]:
    return ["--unshare-net"] if network.isolated else ["--share-net"]


def probe(namespaces_ok: bool) -> LayerStatus:
    return LayerStatus(
        name="network",
        active=namespaces_ok,
        mechanism="empty network namespace + seccomp socket filter",
        detail="no interfaces but the sandbox's own loopback; only AF_UNIX sockets may be created",
    )
