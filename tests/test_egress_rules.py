"""HOST[:PORT] rules and the decisions made with them: wildcards, the ceiling, special
addresses (IPv4-mapped IPv6 too) and parse errors, over generated inputs."""

from __future__ import annotations

import ipaddress

import pytest
from hypothesis import given
from hypothesis import strategies as st

from codecage.egress.rules import (
    DEFAULT_PORTS,
    EgressPolicy,
    HostRule,
    RuleError,
    parse_rules,
    special_address,
)

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
