"""HOST[:PORT] rules and the decisions made with them: wildcards, the ceiling, special
addresses (IPv4-mapped IPv6 too) and parse errors, over generated inputs."""

from __future__ import annotations

import ipaddress

import pytest
from hypothesis import given
from hypothesis import strategies as st

from codecage.egress.rules import EgressPolicy
from codecage.egress.special import (
    SPECIAL_RANGES,
    SpecialRange,
    embedded_ipv4,
    special_address,
    special_reason,
)
from codecage.models.hosts import DEFAULT_PORTS, HostRule, RuleError, parse_rules

label = st.from_regex(r"[a-z0-9]([a-z0-9-]{0,8}[a-z0-9])?", fullmatch=True)
domain = st.lists(label, min_size=2, max_size=4).map(".".join)
port = st.integers(1, 65535)


@given(domain, st.lists(label, min_size=1, max_size=3), port)
def test_a_wildcard_matches_every_subdomain_but_not_the_domain_itself(
    base: str, sub: list[str], p: int
) -> None:
    rule = HostRule.parse(f"*.{base}:{p}")
    host = ".".join([*sub, base])
    assert rule.matches(host, p)
    assert rule.matches(host.upper() + ".", p)  # case and a trailing dot do not matter
    assert not rule.matches(base, p)
    assert not rule.matches("x" + base, p)  # a suffix without the dot is another domain
    assert not rule.matches(host, p % 65535 + 1)


@given(domain)
def test_a_rule_without_a_port_means_443_and_80(host: str) -> None:
    rule = HostRule.parse(host)
    assert rule.ports == DEFAULT_PORTS
    assert rule.matches(host, 443) and rule.matches(host, 80) and not rule.matches(host, 8080)


names = st.builds(
    lambda wild, base, p: ("*." if wild else "") + base + (f":{p}" if p else ""),
    st.booleans(),
    st.sampled_from(["a.example.com", "example.com", "b.a.example.com", "example.org"]),
    st.sampled_from([None, 80, 443, 8443]),
)
hosts = st.sampled_from(
    ["example.com", "a.example.com", "b.a.example.com", "c.example.com", "example.org"]
)


@given(names, names, hosts, st.sampled_from([80, 443, 8443]))
def test_a_ceiling_that_covers_a_rule_allows_everything_that_rule_allows(
    ceiling: str, requested: str, host: str, p: int
) -> None:
    outer, inner = HostRule.parse(ceiling), HostRule.parse(requested)
    if outer.covers(inner) and inner.matches(host, p):
        assert outer.matches(host, p)
    policy = EgressPolicy(allow=(outer,))
    assert policy.outside([inner]) == ([] if outer.covers(inner) else [inner])


@given(names)
def test_a_rule_reads_back_as_itself(text: str) -> None:
    rule = HostRule.parse(text)
    assert HostRule.parse(rule.text) == rule
    assert rule.covers(rule)


special_v4 = st.sampled_from(
    [
        "10.0.0.0/8",
        "127.0.0.0/8",
        "169.254.0.0/16",
        "172.16.0.0/12",
        "192.168.0.0/16",
        "100.64.0.0/10",
        "0.0.0.0/8",
        "224.0.0.0/4",
    ]
).flatmap(
    lambda net: st.integers(0, ipaddress.ip_network(net).num_addresses - 1).map(
        lambda n: ipaddress.ip_network(net)[n]
    )
)


@given(special_v4)
def test_private_and_metadata_addresses_are_special_also_as_ipv4_mapped_ipv6(
    address: ipaddress.IPv4Address,
) -> None:
    mapped = ipaddress.IPv6Address(f"::ffff:{address}")
    assert special_address(address) and special_address(mapped)
    policy = EgressPolicy(allow=parse_rules(["api.example.com"]))
    assert policy.refuse_address("api.example.com", 443, address) is not None
    assert policy.refuse_address("api.example.com", 443, mapped) is not None


@pytest.mark.parametrize("text", ["::1", "fe80::1", "fd00:ec2::254", "fc00::5", "ff02::1"])
def test_special_ipv6_addresses(text: str) -> None:
    assert special_address(ipaddress.ip_address(text))


def test_public_addresses_are_not_special() -> None:
    assert not special_address(ipaddress.ip_address("93.184.216.34"))
    assert not special_address(ipaddress.ip_address("2606:4700::1111"))


def test_a_special_address_is_allowed_only_by_its_own_literal_and_port() -> None:
    local = ipaddress.ip_address("127.0.0.1")
    policy = EgressPolicy(allow=parse_rules(["api.test:8080", "127.0.0.1:8080"]))
    assert policy.refuse_address("api.test", 8080, local) is None
    assert policy.refuse_address("api.test", 8081, local) is not None
    denied = EgressPolicy(allow=policy.allow, deny=parse_rules(["127.0.0.1:8080"]))
    assert "denied" in (denied.refuse_address("api.test", 8080, local) or "")


def test_deny_wins_by_name() -> None:
    policy = EgressPolicy(allow=parse_rules(["*.example.com"]), deny=parse_rules(["x.example.com"]))
    assert policy.refuse_name("a.example.com", 443) is None
    assert "denied" in (policy.refuse_name("X.example.com.", 443) or "")


@pytest.mark.parametrize(
    "text",
    [
        "",
        "http://a.com",
        "a.com/path",
        "a.com:0",
        "a.com:65536",
        "a.com:x",
        "[::1",
        "[::1]x",
        "*.com",
        "a.*.com",
        "-a.com",
        "a_b.com",
        "a..com",
    ],
)
def test_unreadable_rules_say_what_to_write(text: str) -> None:
    with pytest.raises(RuleError) as caught:
        parse_rules([text], what="allow_hosts")
    assert str(caught.value).startswith("allow_hosts:")


@given(st.text(max_size=30))
def test_any_text_parses_or_raises_a_rule_error(text: str) -> None:
    try:
        rule = HostRule.parse(text)
    except RuleError:
        return
    assert rule.ports and all(0 < p < 65536 for p in rule.ports)


# --- the IANA special-purpose registries and the IPv6 forms that embed IPv4 (issue 33) ---

ISSUE_RANGES = [
    "0.0.0.0/8", "10.0.0.0/8", "100.64.0.0/10", "127.0.0.0/8", "169.254.0.0/16",
    "172.16.0.0/12", "192.0.0.0/24", "192.0.2.0/24", "192.31.196.0/24", "192.52.193.0/24",
    "192.88.99.0/24", "192.168.0.0/16", "192.175.48.0/24", "198.18.0.0/15",
    "198.51.100.0/24", "203.0.113.0/24", "240.0.0.0/4", "255.255.255.255/32",
    "::/128", "::1/128", "::ffff:0:0/96", "64:ff9b::/96", "64:ff9b:1::/48", "100::/64",
    "2001::/23", "2001::/32", "2001:db8::/32", "2002::/16", "2620:4f:8000::/48", "fc00::/7",
    "fe80::/10", "ff00::/8", "::ffff:0:0:0/96", "224.0.0.0/4",
]  # fmt: skip
METADATA = ["169.254.169.254", "fd00:ec2::254", "168.63.129.16", "100.100.100.200"]
ANY_HOST = EgressPolicy(allow=parse_rules(["api.example.com"]))


@pytest.mark.parametrize("net", ISSUE_RANGES)
def test_every_special_purpose_range_is_refused_at_its_edges_and_middle(net: str) -> None:
    network = ipaddress.ip_network(net)
    size = network.num_addresses
    for address in {network[0], network[size // 2], network[size - 1]}:
        assert special_address(address), address
        reason = ANY_HOST.refuse_address("api.example.com", 443, address)
        assert reason is not None and str(address) in reason


@pytest.mark.parametrize("text", METADATA)
def test_cloud_metadata_addresses_are_refused_and_named(text: str) -> None:
    reason = ANY_HOST.refuse_address("api.example.com", 80, ipaddress.ip_address(text))
    assert reason is not None and ("metadata" in reason or "wire server" in reason)


@pytest.mark.parametrize("row", SPECIAL_RANGES, ids=lambda r: str(r.network))
def test_every_row_of_the_table_is_special_and_names_its_source(row: SpecialRange) -> None:
    assert row.source.startswith("RFC ") or row.source == "provider docs"
    assert special_address(row.network[0]) and special_address(row.network[-1])


def _embeddings(v4: ipaddress.IPv4Address) -> dict[str, ipaddress.IPv6Address]:
    n = int(v4)
    return {
        "mapped": ipaddress.IPv6Address((0xFFFF << 32) | n),
        "translated": ipaddress.IPv6Address((0xFFFF << 48) | n),
        "compatible": ipaddress.IPv6Address(n),
        "nat64": ipaddress.IPv6Address(f"64:ff9b::{v4}"),
        "nat64-local": ipaddress.IPv6Address(f"64:ff9b:1::{v4}"),
        "6to4": ipaddress.IPv6Address((0x2002 << 112) | (n << 80) | 1),
        "teredo": ipaddress.IPv6Address(
            (0x20010000 << 96) | (0x01020304 << 64) | (~n & 0xFFFFFFFF)
        ),
    }


any_v4 = st.integers(0, 2**32 - 1).map(ipaddress.IPv4Address)
special_v4_anywhere = st.sampled_from(
    [n for n in ISSUE_RANGES if "." in n] + [f"{m}/32" for m in METADATA if "." in m]
).flatmap(
    lambda net: st.integers(0, ipaddress.ip_network(net).num_addresses - 1).map(
        lambda n: ipaddress.ip_network(net)[n]
    )
)


@given(
    st.one_of(any_v4, special_v4_anywhere),
    st.sampled_from(sorted(_embeddings(ipaddress.IPv4Address(1)))),
)
def test_an_ipv6_form_embedding_ipv4_is_refused_by_what_it_embeds(
    v4: ipaddress.IPv4Address, form: str
) -> None:
    address = _embeddings(v4)[form]
    if address in (ipaddress.IPv6Address("::"), ipaddress.IPv6Address("::1")):
        return  # :: and ::1 are themselves, not IPv4-compatible forms
    assert embedded_ipv4(address) == v4
    reason = ANY_HOST.refuse_address("api.example.com", 443, address)
    # Refused whatever it embeds (a public IPv4 is reached only by its own form) ...
    assert reason is not None and f"embedding {v4}" in reason
    # ... and when what it embeds is special, the reason says why.
    if special_address(v4):
        assert special_reason(v4) in reason  # type: ignore[operator]
    # An operator who allows that very literal gets it, as for any special address.
    literal = EgressPolicy(allow=parse_rules(["api.example.com", f"[{address}]"]))
    assert literal.refuse_address("api.example.com", 443, address) is None
    # A deny of the IPv4 literal also denies its IPv6 forms.
    deny = EgressPolicy(allow=literal.allow, deny=parse_rules([str(v4)]))
    assert "denied" in (deny.refuse_address("api.example.com", 443, address) or "")


@given(any_v4)
def test_a_public_ipv4_is_allowed_and_a_special_one_refused(v4: ipaddress.IPv4Address) -> None:
    refused = ANY_HOST.refuse_address("api.example.com", 443, v4) is not None
    assert refused == special_address(v4)
    in_table = any(v4 in ipaddress.ip_network(n) for n in ISSUE_RANGES if "." in n)
    if in_table or not v4.is_global:
        assert refused


@pytest.mark.parametrize(
    "text",
    ["64:ff9b::808:808", "64:ff9b::a9fe:a9fe", "2002:a9fe:a9fe::1", "::ffff:168.63.129.16",
     "::169.254.169.254", "::ffff:0:10.0.0.1", "2001:0:4136:e378:8000:63bf:5601:56fe",
     "64:ff9b:1::7f00:1"],
)  # fmt: skip
def test_the_reviews_bypass_forms_are_refused(text: str) -> None:
    assert ANY_HOST.refuse_address("api.example.com", 443, ipaddress.ip_address(text))
