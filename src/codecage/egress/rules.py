"""Which hosts a run may reach: the decisions made with HOST[:PORT] rules (`HostRule`, parsed
in `models.hosts`, where the settings reach it too).

Decisions come in two steps, because a name says nothing about where it leads: by name and
port before resolution (`EgressPolicy.refuse_name`), then by the address it resolved to
(`EgressPolicy.refuse_address`): private, loopback, link-local, metadata and every other
special address (`egress.special`: the IANA special-purpose registries, the cloud metadata
addresses, and IPv6 forms that embed an IPv4 address, judged by what they embed too) are
refused even when an allowed name resolves to them (DNS rebinding), unless a rule names
that IP literal itself. Pure: no I/O here.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from codecage.egress.special import embedded_ipv4, special_reason
from codecage.models.hosts import HostRule, IPAddress, bracketed, normal_name


@dataclass(frozen=True, slots=True)
class EgressPolicy:
    """What one run may reach: `allow` minus `deny` (deny wins)."""

    allow: tuple[HostRule, ...] = ()
    deny: tuple[HostRule, ...] = ()

    @property
    def any_allowed(self) -> bool:
        return bool(self.allow)

    def refuse_name(self, host: str, port: int) -> str | None:
        """Why a connection to `host`:`port` is refused before resolving it; None: go on."""
        rule = next((r for r in self.deny if r.matches(host, port)), None)
        if rule is not None:
            return f"denied by the operator's rule {rule.text}"
        if not any(r.matches(host, port) for r in self.allow):
            return f"{_shown(host, port)} is not in this run's allowed hosts"
        return None

    def refuse_address(self, host: str, port: int, address: IPAddress) -> str | None:
        """Why a connection to `address` (what `host` resolved to) is refused; None: allowed.

        A special address is allowed only when an allow rule names that very address as an
        IP literal: an allowed *name* that resolves to 10.0.0.5 or 169.254.169.254 is
        refused, and so is 64:ff9b::a9fe:a9fe (NAT64 of the metadata address) unless that
        literal itself is allowed. A deny rule naming an IPv4 literal also refuses the IPv6
        forms that embed it.
        """
        forms = {address, embedded_ipv4(address) or address}
        denied = next((r for r in self.deny if r.address in forms and port in r.ports), None)
        if denied is not None:
            return f"denied by the operator's rule {denied.text}"
        why = special_reason(address)
        if why is None:
            return None
        if any(r.address == address and port in r.ports for r in self.allow):
            return None
        return (
            f"{host} resolved to a private, loopback, link-local or metadata address, or "
            f"another special one ({why}): refused unless that IP is allowed by itself"
        )

    def outside(self, requested: Iterable[HostRule]) -> list[HostRule]:
        """The rules of `requested` that this policy (as a ceiling) does not cover."""
        return [r for r in requested if not any(c.covers(r) for c in self.allow)]


def _shown(host: str, port: int) -> str:
    return f"{bracketed(normal_name(host))}:{port}"
