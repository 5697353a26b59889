"""One run's egress from the config, its profile, the operator's grants and the call's
`allow_hosts` (codecage.egress.grants): pure, no sandbox."""

from __future__ import annotations

import pytest

from codecage.egress.grants import Grants
from codecage.egress.rules import EgressPolicy
from codecage.errors import ConfigError
from codecage.models import NetworkSettings
from codecage.policy import profiles


def grants(operator: tuple[str, ...] = (), **network: object) -> Grants:
    return Grants.of(NetworkSettings.model_validate(network), operator, face="library")


def allowed(policy: EgressPolicy | None) -> list[str]:
    assert policy is not None
    return [r.text for r in policy.allow]


def test_without_any_allowed_host_a_run_has_no_network() -> None:
    assert grants().policy("standard") is None
    assert grants(ceiling=["api.example.com"]).policy("standard") is None  # only a ceiling


def test_config_profile_and_operator_hosts_are_the_runs_defaults() -> None:
    g = grants(
        ("pypi.org",),
        allow=["api.example.com"],
        profiles={"data_science": {"allow": ["data.example.org"]}},
    )
    assert allowed(g.policy("basic")) == ["api.example.com", "pypi.org"]
    assert allowed(g.policy("data_science,filesystem")) == [
        "api.example.com",
        "data.example.org",
        "pypi.org",
    ]


def test_a_request_within_the_ceiling_is_added_to_the_defaults() -> None:
    g = grants(allow=["api.example.com"], ceiling=["*.example.org", "files.example.net:8443"])
    policy = g.policy("standard", ["a.example.org", "files.example.net:8443"])
    assert allowed(policy) == ["api.example.com", "a.example.org", "files.example.net:8443"]
    assert policy is not None and policy.refuse_name("a.example.org", 443) is None
    assert policy.refuse_name("b.example.org", 443) is not None  # not asked for: not allowed


def test_a_request_outside_the_ceiling_is_an_error_listing_it_and_what_is_permitted() -> None:
    g = grants(allow=["api.example.com"], ceiling=["*.example.org"])
    with pytest.raises(ConfigError) as caught:
        g.policy("standard", ["evil.example", "a.example.org"])
    message = str(caught.value)
    assert "evil.example" in message and "a.example.org" not in message.split("permits")[0]
    assert "*.example.org" in message and "api.example.com" in message  # what is permitted
    assert "allow_hosts" in message


def test_the_ceiling_checks_wildcards_and_ports() -> None:
    g = grants(ceiling=["*.sub.example.org", "api.example.com:8443"])
    for outside in (
        "sub.example.org",  # a wildcard covers the subdomains, not the domain itself
        "*.example.org",  # wider than the ceiling's wildcard
        "api.example.com",  # ports 443 and 80, the ceiling has 8443 only
        "api.example.com:443",
    ):
        with pytest.raises(ConfigError, match="outside"):
            g.policy("standard", [outside])
    assert allowed(g.policy("standard", ["*.a.sub.example.org", "b.sub.example.org:443"])) == [
        "*.a.sub.example.org",
        "b.sub.example.org:443",
    ]
    assert allowed(g.policy("standard", ["api.example.com:8443"])) == ["api.example.com:8443"]


def test_a_profiles_hosts_are_within_the_ceiling_of_its_runs_only() -> None:
    g = grants(profiles={"data_science": {"allow": ["*.data.org"]}})
    assert allowed(g.policy("data_science", ["x.data.org"])) == ["*.data.org", "x.data.org"]
    with pytest.raises(ConfigError, match="outside"):
        g.policy("basic", ["x.data.org"])


def test_the_operators_grants_widen_the_ceiling() -> None:
    g = grants(("*.example.com",))
    assert allowed(g.policy("standard", ["api.example.com:443"])) == [
        "*.example.com",
        "api.example.com:443",
    ]


def test_a_denied_host_asked_for_is_an_error_even_within_the_ceiling() -> None:
    g = grants(ceiling=["*.example.com"], deny=["secret.example.com"])
    with pytest.raises(ConfigError, match=r"secret\.example\.com is denied"):
        g.policy("standard", ["secret.example.com"])
    with pytest.raises(ConfigError, match="denied"):
        grants(("secret.example.com",), deny=["*.example.com"])  # an operator's grant too
    # A wider request than the deny rule stands; the deny rule still wins at connection time.
    policy = g.policy("standard", ["*.example.com"])
    assert policy is not None and policy.deny[0].text == "secret.example.com"
    assert policy.refuse_name("secret.example.com", 443) is not None
    assert policy.refuse_name("www.example.com", 443) is None


def test_a_deny_rule_on_other_ports_does_not_refuse_the_request() -> None:
    g = grants(ceiling=["api.example.com"], deny=["api.example.com:8080"])
    assert allowed(g.policy("standard", ["api.example.com"])) == ["api.example.com"]


@pytest.mark.parametrize(
    ("rule", "said"),
    [
        ("https://api.example.com/v1", "no URL"),
        ("api.example.com:99999", "port"),
        ("", "empty"),
        ("*.com", "two labels"),
        ("bad_name.example.com", "not a valid part"),
    ],
)
def test_a_malformed_rule_is_refused_with_the_rules_own_message(rule: str, said: str) -> None:
    with pytest.raises(ConfigError, match=said) as caught:
        grants(ceiling=["*.example.com"]).policy("standard", [rule])
    assert str(caught.value).startswith("allow_hosts:")
    assert "HOST[:PORT]" in caught.value.hint


def test_errors_name_the_setting_as_each_face_spells_it() -> None:
    g = grants(ceiling=["*.example.com"])
    for face, spelled in (("cli", "--allow-host"), ("mcp", "allow_hosts")):
        with pytest.raises(ConfigError) as caught:
            g.policy("standard", ["other.example"], face=face)  # type: ignore[arg-type]
        assert str(caught.value).startswith(spelled)
        assert spelled in caught.value.hint_for(face)  # type: ignore[arg-type]
    with pytest.raises(ConfigError) as caught:
        g.policy("standard", ["other.example"], face="mcp")
    assert "ask the operator" in caught.value.hint_for("mcp")
    with pytest.raises(ConfigError) as caught:
        g.policy("standard", ["other.example"], face="library")
    assert "Sandbox(allow_hosts=" in caught.value.hint


def test_a_single_string_is_one_rule_not_its_characters() -> None:
    g = grants(ceiling=["api.example.com"])
    assert allowed(g.policy("standard", "api.example.com")) == ["api.example.com"]


def test_a_run_with_egress_may_import_the_network_modules() -> None:
    basic = profiles.resolve(["basic"])
    assert not basic.allows("urllib.request") and not basic.allows("socket")
    widened = profiles.with_network(basic)
    assert widened is not None and widened.profile == "basic"
    for module in ("urllib.request", "http.client", "socket", "ssl", "requests", "httpx"):
        assert widened.allows(module), module
    standard = profiles.resolve(["standard"])
    assert profiles.with_network(standard) is standard
    assert profiles.with_network(None) is None
