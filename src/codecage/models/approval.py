"""Human approval of code before it runs: what a person is asked, and the words of the
answer (the `approval` event's `data`; docs/configuration.md, `[approval]`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from codecage.models.base import Model
from codecage.models.validation import Finding

ApprovalLevel = Literal["high", "medium", "always"]
"""Which code waits for a person: findings of at least that severity, or every run."""

Decision = Literal["approved", "denied", "timeout", "unavailable"]
"""How an approval ended: a person said yes or no, no answer came in time, or no one could
be asked (no terminal, a client without elicitation). Only "approved" lets the code run."""

DECISIONS: tuple[Decision, ...] = Decision.__args__  # type: ignore[attr-defined]


class ApprovalRequest(Model):
    """What a person is asked to approve before the code runs (`Sandbox(approve=...)`
    receives it)."""

    code: str = Field(description="The code that would run, as it was given.")
    code_sha256: str = Field(description="SHA-256 of the code's UTF-8 bytes, hex.")
    findings: list[Finding] = Field(
        description="The validation findings that reached the required level (for "
        "'always': every security finding, possibly none), in source order; at most 50."
    )
    require: ApprovalLevel = Field(description="The [approval] require setting in force.")
    timeout: float = Field(
        gt=0, description="Seconds the person has; no answer within them is a denial."
    )
    caller: str = Field("", description="Who asked for the run (e.g. 'mcp:claude-code/1.2').")

    @property
    def rule_ids(self) -> list[str]:
        """The findings' rule ids, in order, each once."""
        return list(dict.fromkeys(f.rule_id for f in self.findings))

    def describe(self) -> str:
        """The findings and the code's hash, as lines for a person (one line a finding)."""
        lines = [f"line {f.line}: {f.rule_id} ({f.severity}) {f.message}" for f in self.findings]
        if not lines:
            lines = ["no findings: [approval] require = 'always' asks for every run"]
        return "\n".join([*lines, f"code sha256: {self.code_sha256}"])
