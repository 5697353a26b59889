"""Addresses that are never a public server: the IANA special-purpose registries as a table,
the cloud metadata addresses, and the IPv6 forms that embed an IPv4 address.

`special_reason(address)` says why an address is special (None: it is an ordinary public
address). An IPv6 address that embeds an IPv4 one (IPv4-mapped, -compatible, -translated,
NAT64, 6to4, Teredo) is judged by what it embeds as well as by its own range: the reason
names the embedded address and, when that one is special too, why. Every embedding range
is itself in the table, so such a form is refused even when what it embeds is public: a
NAT64 or 6to4 form of a public IPv4 address reaches that address through a translator the
operator may not know of (or, mapped and compatible forms, reaches it directly), and
nothing an ordinary client needs depends on it. An operator who wants one allows it by
its literal (`EgressPolicy.refuse_address`).

Sources: IANA IPv4 and IPv6 Special-Purpose Address Registries (RFC 6890 and the RFCs
named per row), multicast (not in those registries, never a server), and the providers'
documentation for the metadata addresses. Pure: no I/O here.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from codecage.models.hosts import IPAddress

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(frozen=True, slots=True)
class SpecialRange:
    """One row of the table: a network, what it is, and where that is defined."""

    network: Network
    name: str
    source: str


def _rows(*rows: tuple[str, str, str]) -> tuple[SpecialRange, ...]:
    return tuple(SpecialRange(ipaddress.ip_network(n), name, src) for n, name, src in rows)


# Most specific first: the first row an address falls in names it.
SPECIAL_RANGES: tuple[SpecialRange, ...] = _rows(
    # --- cloud metadata and platform services (before their enclosing ranges) ---
    (
        "169.254.169.254/32",
        "the cloud metadata service (AWS, GCP, Azure, OCI, ...)",
        "provider docs",
    ),
    ("169.254.170.2/32", "the AWS ECS task metadata service", "provider docs"),
    ("168.63.129.16/32", "the Azure wire server (platform metadata)", "provider docs"),
    ("100.100.100.200/32", "the Alibaba Cloud metadata service", "provider docs"),
    ("fd00:ec2::254/128", "the AWS IPv6 metadata service", "provider docs"),
    # --- IANA IPv4 Special-Purpose Address Registry ---
    ("0.0.0.0/8", "'this network'", "RFC 791"),
    ("10.0.0.0/8", "private-use", "RFC 1918"),
    ("100.64.0.0/10", "shared address space (carrier-grade NAT)", "RFC 6598"),
    ("127.0.0.0/8", "loopback", "RFC 1122"),
    ("169.254.0.0/16", "link-local", "RFC 3927"),
    ("172.16.0.0/12", "private-use", "RFC 1918"),
    ("192.0.0.0/24", "IETF protocol assignments", "RFC 6890"),
    ("192.0.2.0/24", "documentation (TEST-NET-1)", "RFC 5737"),
    ("192.31.196.0/24", "AS112-v4", "RFC 7535"),
    ("192.52.193.0/24", "AMT", "RFC 7450"),
    ("192.88.99.0/24", "deprecated 6to4 relay anycast", "RFC 7526"),
    ("192.168.0.0/16", "private-use", "RFC 1918"),
    ("192.175.48.0/24", "direct delegation AS112 service", "RFC 7534"),
    ("198.18.0.0/15", "benchmarking", "RFC 2544"),
    ("198.51.100.0/24", "documentation (TEST-NET-2)", "RFC 5737"),
    ("203.0.113.0/24", "documentation (TEST-NET-3)", "RFC 5737"),
    ("224.0.0.0/4", "multicast", "RFC 5771"),
    ("255.255.255.255/32", "limited broadcast", "RFC 919"),
    ("240.0.0.0/4", "reserved", "RFC 1112"),
    # --- IANA IPv6 Special-Purpose Address Registry ---
    ("::/128", "the unspecified address", "RFC 4291"),
    ("::1/128", "loopback", "RFC 4291"),
    ("::ffff:0:0/96", "IPv4-mapped", "RFC 4291"),
    ("::ffff:0:0:0/96", "IPv4-translated (SIIT)", "RFC 2765"),
    ("::/96", "IPv4-compatible (deprecated)", "RFC 4291"),
    ("64:ff9b::/96", "NAT64 well-known prefix", "RFC 6052"),
    ("64:ff9b:1::/48", "NAT64 local-use prefix", "RFC 8215"),
    ("100::/64", "discard-only", "RFC 6666"),
    ("2001::/32", "Teredo", "RFC 4380"),
    ("2001:db8::/32", "documentation", "RFC 3849"),
    ("2001::/23", "IETF protocol assignments", "RFC 2928"),
    ("2002::/16", "6to4", "RFC 3056"),
    ("2620:4f:8000::/48", "direct delegation AS112 service", "RFC 7534"),
    ("3fff::/20", "documentation", "RFC 9637"),
    ("5f00::/16", "segment routing SIDs", "RFC 9602"),
    ("fc00::/7", "unique-local", "RFC 4193"),
    ("fe80::/10", "link-local", "RFC 4291"),
    ("fec0::/10", "site-local (deprecated)", "RFC 3879"),
    ("ff00::/8", "multicast", "RFC 4291"),
)


def special_range(address: IPAddress) -> SpecialRange | None:
    """The table's row `address` falls in (the most specific), or None."""
    return next(
        (
            row
            for row in SPECIAL_RANGES
            if row.network.version == address.version and address in row.network
        ),
        None,
    )


def embedded_ipv4(address: IPAddress) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 form carries (what it reaches), or None.

    IPv4-mapped `::ffff:a.b.c.d`, -translated `::ffff:0:a.b.c.d`, -compatible `::a.b.c.d`
    and NAT64 `64:ff9b::a.b.c.d` carry it in their low 32 bits; the NAT64 local-use prefix
    is read the same way (its /96 use, the common one); 6to4 `2002:AABB:CCDD::/48` in bits
    16-47; Teredo `2001:0:SERVER::` carries two, and the client (the host reached) is the
    one returned.
    """
    if isinstance(address, ipaddress.IPv4Address):
        return None
    if address.teredo is not None:
        return address.teredo[1]
    if address.sixtofour is not None:
        return address.sixtofour
    row = special_range(address)
    if row is not None and row.network.prefixlen >= 48 and row.source in _LOW_32_SOURCES:
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    return None


# The rows whose addresses carry an IPv4 address in their low 32 bits.
_LOW_32_SOURCES = frozenset({"RFC 4291", "RFC 2765", "RFC 6052", "RFC 8215"})
_SELF = (ipaddress.IPv6Address("::"), ipaddress.IPv6Address("::1"))  # not embeddings


def special_reason(address: IPAddress) -> str | None:
    """Why `address` is not a public server ("10.0.0.5 is private-use (RFC 1918)"), or
    None for an ordinary public address. Embedded IPv4 forms name what they embed."""
    row = special_range(address)
    inner = None if address in _SELF else embedded_ipv4(address)
    if inner is not None:
        what = f"{row.name} ({row.source})" if row is not None else "an IPv4 embedding"
        inner_reason = special_reason(inner)
        if inner_reason is None:  # refused by its form: see the module's docstring
            inner_reason = f"{inner} is public, but only its own IPv4 form is reached"
        return f"{address} is {what}, embedding {inner}: {inner_reason}"
    if row is not None:
        return f"{address} is {row.name} ({row.source})"
    # What Python knows beyond the table (a registry newer than this file, for one).
    if not address.is_global or address.is_multicast:
        return f"{address} is not a globally reachable address"
    return None


def special_address(address: IPAddress) -> bool:
    """Private, loopback, link-local, metadata, documentation, an IPv4 embedding, or any
    other address that is not a public server."""
    return special_reason(address) is not None
