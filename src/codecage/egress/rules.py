"""Which hosts a run may reach: rules written as HOST[:PORT], and the decisions made with them.

A rule is a host name (`api.example.com`), a wildcard over its subdomains (`*.example.com`:
`a.example.com` and `b.a.example.com`, not `example.com` itself), or an IP literal
(`203.0.113.7`, `[2001:db8::1]`), with an optional port; without one it means 443 and 80.
Names compare without case and without a trailing dot.

Decisions come in two steps, because a name says nothing about where it leads: by name and
port before resolution (`EgressPolicy.refuse_name`), then by the address it resolved to
(`EgressPolicy.refuse_address`): private, loopback, link-local, metadata and every other
special address (`egress.special`: the IANA special-purpose registries, the cloud metadata
addresses, and IPv6 forms that embed an IPv4 address, judged by what they embed too) are
refused even when an allowed name resolves to them (DNS rebinding), unless a rule names
that IP literal itself. Pure: no I/O here.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable
from dataclasses import dataclass

from codecage.egress.special import IPAddress as IPAddress
from codecage.egress.special import embedded_ipv4, special_reason
from codecage.egress.special import special_address as special_address

DEFAULT_PORTS = frozenset({443, 80})

_LABEL = re.compile(r"^(?!-)[a-z0-9-]{1,63}(?<!-)$")
_MAX_NAME = 253


class RuleError(ValueError):
    """A rule that cannot be read; the message says what is wrong with it."""


@dataclass(frozen=True, slots=True)
class HostRule:
    """One allowed (or denied) destination: a name, `*.`-wildcard or IP literal, and ports."""

    host: str  # lower case, no trailing dot; "*.example.com" for a wildcard; an IP's text
    ports: frozenset[int]
    text: str  # as written (normalised), for messages

    @classmethod
    def parse(cls, text: str) -> HostRule:
        """`HOST[:PORT]`. Raises RuleError with what to write instead."""
        raw = text.strip()
        if not raw:
            raise RuleError("an empty host rule: write a host name such as api.example.com")
        if "://" in raw or "/" in raw:
            raise RuleError(f"{raw!r}: write the host alone (api.example.com[:PORT]), no URL")
        host, port = _split_port(raw)
        host = _normal_host(host, raw)
        ports = DEFAULT_PORTS if port is None else frozenset({port})
        shown = host if port is None else f"{_bracketed(host)}:{port}"
        return cls(host=host, ports=ports, text=shown)

    @property
    def wildcard(self) -> bool:
        return self.host.startswith("*.")

    @property
    def address(self) -> IPAddress | None:
        """The IP literal this rule names, if it names one."""
        try:
            return ipaddress.ip_address(self.host)
        except ValueError:
            return None

    def matches(self, host: str, port: int) -> bool:
        """Does this rule cover a connection to `host`:`port` (host as the code asked)?"""
        if port not in self.ports:
            return False
        name = normal_name(host)
        if self.wildcard:
            return name.endswith(self.host[1:]) and len(name) > len(self.host) - 1
        return name == self.host

    def covers(self, other: HostRule) -> bool:
        """Is every destination `other` allows also allowed by this rule (the ceiling)?"""
        if not other.ports <= self.ports:
            return False
        if not self.wildcard:
            return other.host == self.host
        suffix = self.host[1:]  # ".example.com"
        return other.host.endswith(suffix) and len(other.host) > len(suffix)


def parse_rules(texts: Iterable[str], *, what: str = "allow_hosts") -> tuple[HostRule, ...]:
    """Every rule of `texts`; the first bad one raises RuleError naming `what`."""
    rules = []
    for text in texts:
        try:
            rules.append(HostRule.parse(text))
        except RuleError as exc:
            raise RuleError(f"{what}: {exc}") from None
    return tuple(dict.fromkeys(rules))


def normal_name(host: str) -> str:
    """A host as compared: lower case, no trailing dot, IPv6 without brackets."""
    return host.strip().strip("[]").rstrip(".").lower()


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


def _split_port(raw: str) -> tuple[str, int | None]:
    if raw.startswith("["):  # [v6]:port or [v6]
        end = raw.find("]")
        if end < 0:
            raise RuleError(f"{raw!r}: an IPv6 address opened with [ is not closed with ]")
        host, rest = raw[1:end], raw[end + 1 :]
        if not rest:
            return host, None
        if not rest.startswith(":"):
            raise RuleError(f"{raw!r}: write [IPv6]:PORT")
        return host, _port(rest[1:], raw)
    if raw.count(":") > 1:  # a bare IPv6 address: no port
        return raw, None
    host, sep, port = raw.partition(":")
    return host, (_port(port, raw) if sep else None)


def _port(text: str, raw: str) -> int:
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise RuleError(f"{raw!r}: the port must be a number from 1 to 65535")
    return int(text)


def _normal_host(host: str, raw: str) -> str:
    name = normal_name(host)
    try:
        return str(ipaddress.ip_address(name))
    except ValueError:
        pass
    labels = name.split(".")
    if labels[0] == "*":
        labels = labels[1:]
        if len(labels) < 2:
            raise RuleError(f"{raw!r}: a wildcard needs a domain of two labels or more")
    if "*" in name[1:] or not labels or len(name) > _MAX_NAME:
        raise RuleError(f"{raw!r}: write a host name, *.domain, or an IP address")
    bad = next((label for label in labels if not _LABEL.match(label)), None)
    if bad is not None:
        raise RuleError(f"{raw!r}: {bad!r} is not a valid part of a host name")
    return name


def _bracketed(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _shown(host: str, port: int) -> str:
    return f"{_bracketed(normal_name(host))}:{port}"
