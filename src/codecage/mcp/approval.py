"""The MCP server's way of asking a person to approve code ([approval] in the config): MCP
elicitation (form mode), answered by the client's user with approve yes/no.

Asked before the call takes a run slot (a person may take minutes), on the event loop:
- protocols before 2026-07-28: an `elicitation/create` request in the middle of the call,
  given `[approval] timeout` seconds;
- 2026-07-28 and later: the call returns an `InputRequiredResult` carrying the question
  (the SDK's resolver machinery: it records what was asked and checks the answer is to that
  question); the client retries with the answer. The server cannot wait on a client that
  does not come back, so it keeps each question's deadline (by caller and code hash,
  bounded) and an answer after it is a timeout.

A client that did not declare the elicitation capability cannot be asked: the verdict is
"unavailable", which the host puts on record as a blocked run and the tool reports as an
error saying why. An approval is the client's word: a client may answer without asking
its user (docs/mcp.md).
"""

from __future__ import annotations

import collections
import dataclasses
import datetime
import threading
from typing import Any

import anyio
import anyio.to_thread
from mcp.server.elicitation import AcceptedElicitation, ElicitationResult
from mcp.server.mcpserver import Context
from mcp.server.mcpserver.exceptions import ToolError
from mcp.server.mcpserver.resolve import (
    Elicit,
    Resolve,
    build_resolver_plans,
    resolve_arguments,
)
from mcp_types import InputRequiredResult
from mcp_types.version import is_version_at_least
from pydantic import BaseModel, Field

from codecage.audit import Caller
from codecage.errors import CodecageError
from codecage.host import Host, Request
from codecage.mcp.arguments import refusal
from codecage.models import ApprovalRequest
from codecage.output import neutralise_line
from codecage.policy import approval as approvals

_INPUT_REQUIRED_VERSION = "2026-07-28"
_MAX_QUESTIONS = 1024  # open questions kept (each: a key and a deadline)


class ApprovalForm(BaseModel):
    """What the client's user answers."""

    approve: bool = Field(
        title="Run this code?", description="Yes runs the code in the sandbox; no blocks it."
    )


class Questions:
    """The deadlines of questions asked through an `InputRequiredResult` (2026-07-28 and
    later), by caller and code hash: a retry within it is an answer, after it a timeout.
    Bounded: the oldest question goes when there are too many (its late answer is then
    asked again, never taken as approval)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._deadlines: collections.OrderedDict[tuple[str, str], datetime.datetime] = (
            collections.OrderedDict()
        )

    def deadline(self, asked: ApprovalRequest) -> datetime.datetime:
        """When the answer to `asked` must have come (set the first time it is asked)."""
        key = (asked.caller, asked.key)
        with self._lock:
            if key not in self._deadlines:
                now = datetime.datetime.now(datetime.UTC).replace(microsecond=0)
                self._deadlines[key] = now + datetime.timedelta(seconds=asked.timeout)
                while len(self._deadlines) > _MAX_QUESTIONS:
                    self._deadlines.popitem(last=False)
            return self._deadlines[key]

    def answered(self, asked: ApprovalRequest) -> None:
        with self._lock:
            self._deadlines.pop((asked.caller, asked.key), None)


async def verdict(
    ctx: Context[Any, Any], host: Host, request: Request, questions: Questions
) -> approvals.Verdict | InputRequiredResult | None:
    """The client's verdict on `request` (judged by what it is granted), or None when it
    needs no approval, or the question to return (2026-07-28 and later, first round).

    Raises:
        ToolError: the client's answer did not match the question's form, or the request
            was refused (a malformed pattern, another client's session).
    """
    try:
        asked = await anyio.to_thread.run_sync(lambda: host.approval_for(request))
    except CodecageError as exc:
        raise ToolError(refusal(exc)) from exc
    if asked is None:
        return None
    answered = await _answer(ctx, asked, request.asker.caller, questions)
    if isinstance(answered, approvals.Verdict):  # it covers what was shown, no more
        return dataclasses.replace(answered, shown=tuple(str(g) for g in asked.grants))
    return answered


async def _answer(
    ctx: Context[Any, Any], asked: ApprovalRequest, caller: Caller, questions: Questions
) -> approvals.Verdict | InputRequiredResult:
    who = f"{caller.label} (its user, asked by elicitation)"
    if not _can_elicit(ctx):
        return _unavailable(asked, caller)
    version = ctx.protocol_version
    if version is not None and is_version_at_least(version, _INPUT_REQUIRED_VERSION):
        return await _by_input_required(ctx, asked, who, questions)
    with anyio.move_on_after(asked.timeout):
        outcome = await ctx.elicit(_message(asked, None), ApprovalForm)
        return _decided(outcome, who)
    return approvals.Verdict("timeout", who)


def given(verdict: approvals.Verdict | None) -> approvals.Approver:
    """The host's approver for a call whose verdict was obtained before it ran. The host
    judges the run again when it starts; a grant the person was not shown (a tool an
    upstream added meanwhile) is not covered by their answer: the run is refused."""

    def approve(asked: ApprovalRequest) -> approvals.Verdict:
        if verdict is None:  # needed nothing before, and something now: refuse
            return approvals.Verdict("unavailable", "", reason="the client was not asked")
        unseen = [str(g) for g in asked.grants if str(g) not in (verdict.shown or ())]
        if verdict.decision == "approved" and verdict.shown is not None and unseen:
            return approvals.Verdict(
                "unavailable",
                verdict.who,
                reason="the run is granted what its approver was not shown (an upstream "
                f"added it since): {', '.join(unseen)[:500]}",
                hint="call again: the client's user is then asked about all of it",
            )
        return verdict

    return approve


async def _by_input_required(
    ctx: Context[Any, Any], asked: ApprovalRequest, who: str, questions: Questions
) -> approvals.Verdict | InputRequiredResult:
    deadline = questions.deadline(asked)
    message = _message(asked, deadline)

    def question() -> Elicit[ApprovalForm]:
        return Elicit(message, ApprovalForm)

    params = {"approval": (Resolve(question), True)}
    resolved = await resolve_arguments(params, build_resolver_plans(params, set()), {}, ctx)
    if isinstance(resolved, InputRequiredResult):
        return resolved
    questions.answered(asked)
    if datetime.datetime.now(datetime.UTC) > deadline:
        return approvals.Verdict("timeout", who)
    return _decided(resolved["approval"], who)


def _decided(outcome: ElicitationResult[ApprovalForm], who: str) -> approvals.Verdict:
    if isinstance(outcome, AcceptedElicitation) and outcome.data.approve is True:
        return approvals.Verdict("approved", who)
    return approvals.Verdict("denied", who)  # no, declined or cancelled


def _can_elicit(ctx: Context[Any, Any]) -> bool:
    """Whether the client declared form elicitation (a bare `elicitation: {}` counts)."""
    capabilities = ctx.client_capabilities
    elicitation = capabilities.elicitation if capabilities is not None else None
    return elicitation is not None and (elicitation.form is not None or elicitation.url is None)


def _unavailable(asked: ApprovalRequest, caller: Caller) -> approvals.Verdict:
    return approvals.Verdict(
        "unavailable",
        caller.label,
        reason=f"approval required: this server has a person approve a run by what it is "
        f"granted ([approval] require = '{asked.require}'; this call: {asked.reason()}), "
        "and this client did not declare the elicitation capability, so its user cannot be "
        "asked; nothing ran",
        hint="use a client that supports MCP elicitation (form mode), or call without what "
        "needs approval (allow_hosts, tools with side effects)",
    )


def _message(asked: ApprovalRequest, deadline: datetime.datetime | None) -> str:
    lines = [
        f"Approve running this code in the sandbox? The server requires a person's approval "
        f"([approval] require = '{asked.require}'). It is granted:"
    ]
    lines += approvals.granted_lines(asked, "- ")
    lines += [
        f"- line {f.line}: {f.rule_id} ({f.severity}) {neutralise_line(f.message)}"
        for f in asked.findings
    ]
    lines.append(f"Code sha256: {asked.code_sha256}")
    if deadline is not None:
        lines.append(f"Answer by {deadline.isoformat()} (later is a denial).")
    else:
        lines.append(f"Answer within {asked.timeout:g} s (later is a denial).")
    return "\n".join(lines)
