"""Hosts as settings and calls name them: `HOST[:PORT]` rules (`HostRule`: the `[network]`
allow, deny and ceiling lists, a call's `allow_hosts`) and a host's credential as the config
declares it (`Credential`). Parsing only: `egress.rules` decides with the rules and
`egress.credentials` adds the credentials at the edge. Pure, and below both the settings
that validate with it and the egress that uses it.

A rule is a host name (`api.example.com`), a wildcard over its subdomains (`*.example.com`:
`a.example.com` and `b.a.example.com`, not `example.com` itself), or an IP literal
(`203.0.113.7`, `[2001:db8::1]`), with an optional port; without one it means 443 and 80.
Names compare without case and without a trailing dot.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from pydantic import Field, model_validator

from codecage.models.base import Model

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

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
        shown = host if port is None else f"{bracketed(host)}:{port}"
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


def bracketed(host: str) -> str:
    """An IPv6 address in brackets (as a URL or a HOST:PORT writes it), any other host as is."""
    return f"[{host}]" if ":" in host else host


_FIELD_NAME = r"^[!#$%&'*+.^_`|~0-9A-Za-z-]{1,64}$"  # RFC 9110 field-name
# Headers that frame or route the message: the proxy owns them, a credential may not.
_RESERVED = frozenset(
    {
        "host",
        "content-length",
        "transfer-encoding",
        "connection",
        "keep-alive",
        "upgrade",
        "te",
        "trailer",
        "proxy-authorization",
        "proxy-connection",
        "accept-encoding",
    }
)
CONTROL = re.compile(r"[\x00-\x1f\x7f]")
"""Control characters: refused in a credential's `format` and in its secret."""


class Credential(Model):
    """One host's credential: the header the proxy sets and where its value is on the host."""

    header: str = Field(
        pattern=_FIELD_NAME,
        description='The request header the proxy sets, e.g. "Authorization" or "X-Api-Key".',
    )
    env: str | None = Field(
        None,
        pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,127}$",
        description="The host environment variable holding the secret (or give `file`).",
    )
    file: Path | None = Field(
        None,
        description="A host file holding the secret, surrounding whitespace ignored (or give "
        "`env`); a relative path is relative to the config file.",
    )
    format: str = Field(
        "{}",
        max_length=256,
        description='The header\'s value, with {} where the secret goes, e.g. "Bearer {}".',
    )

    @model_validator(mode="after")
    def _one_source(self) -> Credential:
        if (self.env is None) == (self.file is None):
            raise ValueError("give exactly one of env (a variable) or file (a path)")
        if self.format.count("{}") != 1 or CONTROL.search(self.format):
            raise ValueError('format must hold {} once and no control characters: "Bearer {}"')
        if self.header.lower() in _RESERVED:
            raise ValueError(f"the header {self.header} is the proxy's own; name another")
        return self
