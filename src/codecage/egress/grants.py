"""The hosts one run may reach: the config's, its profile's, the operator's and the caller's
rules made into one `EgressPolicy` (or None: no network at all).

Who may grant what:

- the operator, through the config (`[network] allow`, `deny`, `ceiling`, and
  `[network.profiles.NAME] allow`) and through the process it starts (`codecage run
  --allow-host`, `codecage serve --allow-host`, `Sandbox(allow_hosts=[...])`): these hold
  for every run of that process;
- the caller, per call (`execute_code(allow_hosts=[...])`, `Sandbox.run(allow_hosts=[...])`):
  only within the ceiling, which is `[network] ceiling` + `[network] allow` + the run's
  profiles' hosts + the operator's grants. Asking for more is an error naming the rules
  outside it and what is permitted, never a silent clamp.

`deny` wins over every allow when a connection is decided (egress/rules.py); a rule asked
for (per call or as an operator's grant) that a deny rule covers is refused outright, so
that nobody believes a host allowed that never will be. Pure: no I/O here.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from codecage.egress.rules import EgressPolicy
from codecage.errors import SETTINGS, ConfigError, Face
from codecage.models.hosts import HostRule, RuleError, parse_rules
from codecage.models.settings import NetworkSettings


@dataclass(frozen=True, slots=True)
class Grants:
    """What a host runtime may give its runs: the config's rules and the operator's grants,
    parsed once. `policy()` makes one run's `EgressPolicy` of them."""

    allow: tuple[HostRule, ...] = ()  # [network] allow: every run
    deny: tuple[HostRule, ...] = ()  # [network] deny: no run
    ceiling: tuple[HostRule, ...] = ()  # [network] ceiling: what a call may ask for besides
    profiles: Mapping[str, tuple[HostRule, ...]] | None = None  # [network.profiles.NAME]
    operator: tuple[HostRule, ...] = ()  # --allow-host / Sandbox(allow_hosts=)

    @classmethod
    def of(cls, network: NetworkSettings, operator: Iterable[str] = (), *, face: Face) -> Grants:
        """The grants of `network` (already validated by its model) and the operator's.

        Raises:
            ConfigError: an operator's rule does not parse, or a deny rule covers it.
        """
        grants = cls(
            allow=parse_rules(network.allow, what="[network] allow"),
            deny=parse_rules(network.deny, what="[network] deny"),
            ceiling=parse_rules(network.ceiling, what="[network] ceiling"),
            profiles={
                name: parse_rules(p.allow, what=f"[network.profiles.{name}] allow")
                for name, p in network.profiles.items()
            },
            operator=parse_requested(operator, face),
        )
        grants.refuse_denied(grants.operator, face)
        return grants

    def defaults(self, profile: str) -> tuple[HostRule, ...]:
        """What a run of `profile` ("data_science,filesystem": each one's) may reach
        without asking: `allow`, the profiles' hosts and the operator's grants."""
        names = [n.strip() for n in profile.split(",") if n.strip()]
        own = [r for n in names for r in (self.profiles or {}).get(n, ())]
        return tuple(dict.fromkeys([*self.allow, *own, *self.operator]))

    def ceiling_of(self, profile: str) -> tuple[HostRule, ...]:
        """The most a call of `profile` may ask for: its defaults and `[network] ceiling`."""
        return tuple(dict.fromkeys([*self.ceiling, *self.defaults(profile)]))

    def policy(
        self, profile: str, requested: Iterable[str] | None = None, *, face: Face = "library"
    ) -> EgressPolicy | None:
        """The egress of one run of `profile`, with the caller's `requested` rules added.
        None when nothing is allowed: the run has no network at all.

        Raises:
            ConfigError: a requested rule does not parse, lies outside the ceiling, or is
                covered by a deny rule; the message lists them and what is permitted.
        """
        asked = parse_requested(requested or (), face)
        self.refuse_denied(asked, face)
        ceiling = self.ceiling_of(profile)
        outside = EgressPolicy(allow=ceiling).outside(asked)
        if outside:
            raise _outside_error(outside, ceiling, face)
        allow = tuple(dict.fromkeys([*self.defaults(profile), *asked]))
        return EgressPolicy(allow=allow, deny=self.deny) if allow else None

    def refuse_denied(self, asked: Iterable[HostRule], face: Face) -> None:
        """Refuse a rule that a deny rule covers (by name, on any of its ports).

        Raises:
            ConfigError: naming the rule and the deny rule.
        """
        for rule in asked:
            denying = next((d for d in self.deny if _denies(d, rule)), None)
            if denying is not None:
                raise ConfigError(
                    f"{_spelled(face)}: {rule.text} is denied by the operator's [network] deny "
                    f"rule {denying.text}",
                    hint=f"leave {rule.text} out of {{allow_hosts}}: no run may reach it "
                    "(the operator's config denies it)",
                )


def parse_requested(texts: Iterable[str], face: Face) -> tuple[HostRule, ...]:
    """Rules as a face received them (`--allow-host`, `allow_hosts=`).

    Raises:
        ConfigError: one does not parse; the message is the rule's own.
    """
    if isinstance(texts, str):  # one host given where a list belongs: take it as one
        texts = [texts]
    try:
        rules = parse_rules(texts, what=_spelled(face))
    except RuleError as exc:
        raise ConfigError(
            str(exc),
            hint="give each host as HOST[:PORT]: api.example.com, *.example.com, "
            "api.example.com:8443, 203.0.113.7 (port 443 and 80 when omitted) in {allow_hosts}",
        ) from None
    for rule in rules:
        if rule.host == "localhost" or rule.host.endswith(".localhost"):
            port = f":{min(rule.ports)}" if len(rule.ports) == 1 else ":PORT"
            raise ConfigError(
                f"{_spelled(face)}: {rule.text} names the sandbox itself: inside a sandbox, "
                "localhost is its own loopback, never the host's",
                hint=f"to reach a service on the host's loopback, allow 127.0.0.1{port} in "
                f"{{allow_hosts}} and connect to http://127.0.0.1{port} from the code",
            )
    return rules


def _denies(deny: HostRule, rule: HostRule) -> bool:
    """`deny` covers `rule`'s name and shares a port with it."""
    if not deny.ports & rule.ports:
        return False
    return deny.covers(HostRule(host=rule.host, ports=deny.ports, text=rule.text))


def _outside_error(
    outside: list[HostRule], ceiling: tuple[HostRule, ...], face: Face
) -> ConfigError:
    listed = ", ".join(r.text for r in outside)
    permitted = ", ".join(r.text for r in ceiling) or "no host at all"
    raise_more = {
        "cli": "give it with --allow-host, or the operator adds it to the config's "
        "[network] ceiling or allow",
        "library": "grant it to the Sandbox (Sandbox(allow_hosts=[...])), or add it to the "
        "config's [network] ceiling or allow",
        "mcp": "ask the operator to permit it (the config's [network] ceiling, or "
        "`codecage serve --allow-host`)",
    }[face]
    return ConfigError(
        f"{_spelled(face)} asks for {listed}, outside what this host permits per call: {permitted}",
        hint=f"ask only for hosts within that in {{allow_hosts}}; to reach more, {raise_more}",
    )


def _spelled(face: Face) -> str:
    """How the per-call rules are named on `face`: --allow-host, allow_hosts."""
    spelling = SETTINGS["allow_hosts"]
    return (spelling.cli if face == "cli" else spelling.mcp if face == "mcp" else None) or (
        spelling.library
    )
