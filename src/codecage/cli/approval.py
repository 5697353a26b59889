"""The CLI's way of asking a person to approve a run ([approval] in the config): a prompt on
the terminal the command runs in, showing what the run is granted (the reason it waits),
the static findings as advice, each with its line of code, and the code's hash. Without a
terminal (stdin or stderr not a tty: a pipe, a CI job, an agent's subprocess) no one can be
asked, and the run is refused (policy/approval.py)."""

from __future__ import annotations

import os
import select
from collections.abc import Callable
from typing import TextIO

from codecage.models import ApprovalRequest
from codecage.output import neutralise_line
from codecage.policy import approval as approvals

_SHOWN_CODE_CHARS = 120


class TerminalPrompt:
    """An `approvals.Approver` asking on the terminal: y or yes runs the code; anything
    else, end of input or no answer within the timeout does not.

    `before_prompt` is called first (the CLI stops its spinner there)."""

    def __init__(self, stdin: TextIO, stderr: TextIO) -> None:
        self.stdin = stdin
        self.stderr = stderr
        self.before_prompt: Callable[[], None] = lambda: None

    def __call__(self, asked: ApprovalRequest) -> approvals.Verdict:
        if not (self.stdin.isatty() and self.stderr.isatty()):
            return self._unavailable(asked)
        who = f"{approvals.login_name()} on {os.ttyname(self.stdin.fileno())}"
        self.before_prompt()
        self.stderr.write(_question(asked))
        self.stderr.flush()
        ready, _, _ = select.select([self.stdin], [], [], asked.timeout)
        if not ready:
            self.stderr.write(f"\nno answer within {asked.timeout:g} s: not run\n")
            return approvals.Verdict("timeout", who)
        answer = self.stdin.readline().strip().lower()
        return approvals.Verdict("approved" if answer in ("y", "yes") else "denied", who)

    def _unavailable(self, asked: ApprovalRequest) -> approvals.Verdict:
        return approvals.Verdict(
            "unavailable",
            f"cli:{approvals.login_name()}",
            reason=f"this run needs a person's approval before it starts ([approval] require "
            f"= '{asked.require}' in the config; granted: {asked.reason()}) and there is no "
            "terminal to ask on (stdin and stderr must both be a terminal); nothing ran",
            hint="run `codecage run --file FILE` (or --code) from a terminal and answer the "
            "prompt, or run it without what needs approval (--workspace, --allow-host)",
        )


def _question(asked: ApprovalRequest) -> str:
    lines = asked.code.splitlines()
    shown = [
        f"This run needs your approval before it starts ([approval] require = "
        f"'{asked.require}'). It is granted:"
    ]
    shown += approvals.granted_lines(asked, "  ")
    for finding in asked.findings:
        shown.append(
            f"  line {finding.line}: {finding.rule_id} ({finding.severity}) "
            f"{neutralise_line(finding.message)}"
        )
        if 0 < finding.line <= len(lines):
            shown.append(f"      | {neutralise_line(lines[finding.line - 1])[:_SHOWN_CODE_CHARS]}")
    shown.append(f"  code sha256: {asked.code_sha256}")
    shown.append(f"Run it? [y/N] (no after {asked.timeout:g} s) ")
    return "\n".join(shown)
