"""Static validation's report (the contract of `codecage validate --json`)."""

from __future__ import annotations

from typing import Literal

from pydantic import (
    Field,
)

from codecage.models.base import Model

Severity = Literal["low", "medium", "high"]
"""How much a finding matters; only "high" refuses a run in strict mode."""

FindingKind = Literal["syntax", "policy", "security", "limit"]
"""syntax/policy/limit findings make the code invalid; security findings inform."""


class Finding(Model):
    """One thing validation found, at one place in the code."""

    rule_id: str = Field(description="Rule id: 'CC###' for codecage's rules, 'B###' for bandit's.")
    kind: FindingKind = Field(
        description="syntax, policy and limit findings make the code invalid; security informs."
    )
    severity: Severity = Field(description="low, medium or high.")
    line: int = Field(ge=0, description="1-based line; 0 when it concerns the whole source.")
    col: int = Field(ge=0, description="1-based column; 0 when unknown or the whole source.")
    message: str = Field(description="What was found and, where it helps, what to do.")
    source: Literal["codecage", "bandit"] = Field(description="Which analyser reported it.")


class Analysis(Model):
    """Measurements of the code. Counts are 0 when the code could not be parsed."""

    lines: int = Field(ge=0, description="Number of lines.")
    characters: int = Field(ge=0, description="Number of characters (not bytes).")
    functions: int = Field(ge=0, description="Functions, async functions and lambdas.")
    classes: int = Field(ge=0, description="Class definitions.")
    loops: int = Field(ge=0, description="for, async for, while and comprehension loops.")
    max_nesting_depth: int = Field(
        ge=0, description="Deepest nesting of block statements (if/for/while/with/try/def/...)."
    )
    complexity: int = Field(
        ge=0,
        description="Estimated cyclomatic complexity of the whole module: 1 + decision points "
        "(see the module docstring); 0 when not parsed.",
    )
    imports: list[str] = Field(
        description="Top-level names of the modules imported (relative imports left out), sorted."
    )
    recommendations: list[str] = Field(description="Short suggestions, most useful first.")
    nodes_analysed: int = Field(ge=0, description="AST nodes walked by codecage's rules.")
    bandit_ran: bool = Field(description="Whether bandit's checks ran on this code.")
    skipped: list[str] = Field(
        description="Checks that did not run and why; empty when every check ran."
    )


class ValidationReport(Model):
    """The verdict of static validation (the contract of `codecage validate --json`)."""

    valid: bool = Field(
        description="True when the code parses and would run under the profile without a policy "
        "refusal (and, in strict mode, has no high-severity finding)."
    )
    message: str = Field(description="One line summing up the verdict.")
    profile: str = Field(description="Profile name the imports were checked against.")
    strict: bool = Field(description="Whether high-severity findings make the code invalid.")
    findings: list[Finding] = Field(
        description="What was found, in source order: the first 200 (the verdict counts all)."
    )
    omitted_findings: int = Field(
        0,
        ge=0,
        description="Findings past the first 200, not listed (10 MiB of code can hold "
        "hundreds of thousands, and a report must stay readable).",
    )
    analysis: Analysis = Field(description="Measurements of the code: size, functions, imports.")
