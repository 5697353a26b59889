"""Human approval of a run before it starts: what a person is asked, and the words of the
answer (the `approval` event's `data`; docs/configuration.md, `[approval]`).

What decides is what the run is *granted* (its capabilities: hosts it may reach, tools with
side effects, a host directory lent read-write, ...), never how its code reads: the same
payload may be written plainly, obfuscated, or into a file and imported. Static findings
of validation are shown to the person as advice only."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from codecage.models.base import Model
from codecage.models.validation import Finding

ApprovalLevel = Literal["grants", "always"]
"""Which runs wait for a person: those granted a capability listed in `[approval]
capabilities` ("grants"), or every run ("always")."""

LEGACY_LEVELS = ("high", "medium")
"""The old, text-based levels: read as "grants" (docs/configuration.md says why)."""

Capability = Literal[
    "network",
    "tools",
    "destructive_tools",
    "open_world_tools",
    "workspace",
    "packages",
    "profile",
    "limits",
]
"""What a run may be granted that a person may have to approve:
- network: hosts it may reach through the egress proxy ([network] allow, its profile's
  hosts, the operator's grants, the caller's allow_hosts);
- tools: a tool it may call over the bridge that is not annotated read-only
  (`readOnlyHint` true); MCP's defaults apply to a tool without annotations (it may write);
- destructive_tools: such a tool that may destroy (`destructiveHint` not false);
- open_world_tools: a tool that reaches beyond the server (`openWorldHint` not false);
- workspace: a host directory lent read-write at /workspace;
- packages: packages the operator added (`codecage packages`) that its profile imports;
- profile: an import profile wider than the configured default one;
- limits: a limit above the configured default."""

CAPABILITIES: tuple[Capability, ...] = Capability.__args__  # type: ignore[attr-defined]
DEFAULT_CAPABILITIES: tuple[Capability, ...] = ("network", "tools", "workspace")
"""What reaches outside the sandbox: hosts, tools that change something, the host's files."""

Decision = Literal["approved", "denied", "timeout", "unavailable"]
"""How an approval ended: a person said yes or no, no answer came in time, or no one could
be asked (no terminal, a client without elicitation). Only "approved" lets the code run."""

DECISIONS: tuple[Decision, ...] = Decision.__args__  # type: ignore[attr-defined]


class Grant(Model):
    """One thing a run is granted, as a person reads it."""

    capability: Capability = Field(description="Which capability it is.")
    detail: str = Field(
        max_length=500, description="What exactly: a host rule, a tool and its annotations, a path."
    )

    def __str__(self) -> str:
        return f"{self.capability}: {self.detail}"


class ApprovalRequest(Model):
    """What a person is asked to approve before the code runs (`Sandbox(approve=...)`
    receives it)."""

    code: str = Field(description="The code that would run, as it was given.")
    code_sha256: str = Field(description="SHA-256 of the code's UTF-8 bytes, hex.")
    grants: list[Grant] = Field(
        default_factory=list,
        description="What the run is granted that [approval] asks a person about (for "
        "'always': everything it is granted, possibly nothing); at most 50.",
    )
    findings: list[Finding] = Field(
        description="Advice, not the reason it waits: validation's security findings on the "
        "code's text, in source order, at most 50. Obfuscated code has none; code written "
        "to a file and imported has none for the file's content."
    )
    require: ApprovalLevel = Field(description="The [approval] require setting in force.")
    timeout: float = Field(
        gt=0, description="Seconds the person has; no answer within them is a denial."
    )
    caller: str = Field("", description="Who asked for the run (e.g. 'mcp:claude-code/1.2').")

    @field_validator("require", mode="before")
    @classmethod
    def _legacy(cls, value: object) -> object:
        return "grants" if value in LEGACY_LEVELS else value

    @property
    def rule_ids(self) -> list[str]:
        """The findings' rule ids, in order, each once."""
        return list(dict.fromkeys(f.rule_id for f in self.findings))

    @property
    def capabilities(self) -> list[Capability]:
        """The grants' capabilities, in order, each once."""
        return list(dict.fromkeys(g.capability for g in self.grants))

    @property
    def key(self) -> str:
        """The question's identity: the code and what it is granted (the same code with
        other grants is another question)."""
        return " ".join([self.code_sha256, *sorted(str(g) for g in self.grants)])

    def reason(self) -> str:
        """Why it waits, in one line: its capabilities, or 'every run'."""
        return ", ".join(self.capabilities) or "every run"

    def describe(self) -> str:
        """The grants, the advice and the code's hash, as lines for a person."""
        lines = [f"granted {g}" for g in self.grants]
        if not lines:
            lines = ["nothing granted: [approval] require = 'always' asks for every run"]
        lines += [
            f"advice, line {f.line}: {f.rule_id} ({f.severity}) {f.message}" for f in self.findings
        ]
        return "\n".join([*lines, f"code sha256: {self.code_sha256}"])
