"""Human approval of a run before it starts: which runs must wait for a person, how the
answer is recorded, and the library's way of asking (a callback).

What decides is what the run is *granted*, its declared capabilities (`declared_grants`):
the hosts it may reach, the tools it may call that have side effects by their MCP
annotations, a host directory lent read-write, the operator's added packages, a profile
wider than the default, limits above the defaults. The operator's `[approval] require`
says which runs wait: "grants" (a run granted one of `[approval] capabilities`), "always"
(every run). How the code reads never decides: the same payload may be written plainly,
obfuscated, or into a file and imported, and what it can do is what it is granted, which
the OS enforces. Validation's static findings are shown to the person as advice (`advice`)
and are never the reason a run is let through, nor the reason it waits.

Each face asks in its own way (the library: a callback; the CLI: a prompt on a terminal,
`cli/approval.py`; MCP: elicitation, `mcp/approval.py`) and answers with a `Verdict`; the
host turns it into one `approval` event (`event`) on the run's result, which the audit
trail keeps like every event. Anything but "approved" means nothing runs: the result is
`blocked` (`blocked_result`). "unavailable" (no one could be asked) is also an error of
the face, raised after the blocked result is on record (`Unavailable`): a run that needs a
person when there is none is refused, never let through.

A person's answer is only as good as the face that carries it: an MCP client may answer
an elicitation without asking anyone, and a library callback is the caller's own code.
"""

from __future__ import annotations

import contextvars
import datetime
import getpass
import hashlib
import inspect
import logging
import os
import threading
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from codecage.models import (
    ApprovalRequest,
    ApprovalSettings,
    Decision,
    ErrorInfo,
    Event,
    ExecutionResult,
    Finding,
    Grant,
    Limits,
    ValidationReport,
)
from codecage.output import neutralise_line

if TYPE_CHECKING:
    import asyncio

log = logging.getLogger(__name__)

MAX_ASKED_FINDINGS = 50
"""Findings shown to the person as advice (and kept in the event): enough to judge, bounded."""
MAX_ASKED_GRANTS = 50
"""Grants shown to the person (and kept in the event); a run granted more says so."""
_MAX_NAMED = 10  # modules, packages, hosts named in one grant's detail

_ADVICE_KINDS = frozenset({"security", "limit"})


@dataclass(frozen=True, slots=True)
class ToolReach:
    """A tool a run may call over the bridge and what its MCP annotations say of it, MCP's
    defaults where it has none (readOnlyHint false, destructiveHint true, openWorldHint
    true: a tool that says nothing may write, destroy and reach out). `listed` False: the
    server's tools could not be listed (`name` is "server.*"), taken as having every effect."""

    name: str
    read_only: bool = False
    destructive: bool = True
    open_world: bool = True
    listed: bool = True
    server: str = ""  # the server and tool as the broker calls them ("" tool: not listed)
    tool: str = ""


@dataclass(frozen=True, slots=True)
class JudgedTools:
    """The tools a run was judged by when [approval] is on: all it may call. A server may
    add tools while a run goes on (after a login, say), and the broker lists them again
    when the code names one; such a tool was never shown to a person nor weighed by its
    annotations, so it is refused (`not_allowed`). A server whose tools could not be listed
    was judged as having every effect: any of its tools stays callable."""

    listed: frozenset[tuple[str, str]] = frozenset()
    unlisted: frozenset[str] = frozenset()

    @classmethod
    def of(cls, tools: Sequence[ToolReach]) -> JudgedTools:
        return cls(
            listed=frozenset((t.server, t.tool) for t in tools if t.listed),
            unlisted=frozenset(t.server for t in tools if not t.listed),
        )

    def allows(self, server: str, tool: str) -> bool:
        return server in self.unlisted or (server, tool) in self.listed


@dataclass(frozen=True, slots=True)
class Declared:
    """What one run is granted, as the host resolved it before it starts."""

    hosts: tuple[str, ...] = ()  # egress rules it may reach (HOST[:PORT], *.domain)
    tools: tuple[ToolReach, ...] = ()  # tools it may call
    workspace: str | None = None  # a host directory lent read-write at /workspace
    packages: tuple[str, ...] = ()  # added packages its profile imports
    wider_modules: tuple[str, ...] = ()  # modules its profile allows beyond the default's
    every_module: bool = False  # its profile refuses nothing where the default does
    profile: str | None = None  # its profile's name, for the person
    limits: tuple[str, ...] = ()  # "memory_mb 2048 (default 512)"


def declared_grants(declared: Declared) -> list[Grant]:
    """Every grant of a run, in a fixed order (network, tools, workspace, packages,
    profile, limits); a tool may give several (tools, destructive_tools, open_world_tools)."""
    grants: list[Grant] = []
    if declared.hosts:
        grants.append(Grant(capability="network", detail=_named(declared.hosts)))
    for tool in declared.tools:
        grants += _tool_grants(tool)
    if declared.workspace is not None:
        grants.append(
            Grant(capability="workspace", detail=f"{declared.workspace} (read-write)"[:500])
        )
    if declared.packages:
        grants.append(Grant(capability="packages", detail=_named(declared.packages)))
    if declared.every_module or declared.wider_modules:
        what = "no import policy" if declared.every_module else _named(declared.wider_modules)
        grants.append(
            Grant(capability="profile", detail=f"{declared.profile or 'none'}: {what}"[:500])
        )
    if declared.limits:
        grants.append(Grant(capability="limits", detail=", ".join(declared.limits)[:500]))
    return grants


def _tool_grants(tool: ToolReach) -> list[Grant]:
    if not tool.listed:
        detail = f"{tool.name} (its tools could not be listed: taken to have side effects)"
        return [
            Grant(capability=c, detail=detail[:500])
            for c in ("tools", "destructive_tools", "open_world_tools")
        ]
    grants: list[Grant] = []
    if not tool.read_only:
        effects = ["not read-only"]
        effects += ["destructive"] if tool.destructive else []
        effects += ["open world"] if tool.open_world else []
        grants.append(Grant(capability="tools", detail=f"{tool.name} ({', '.join(effects)})"))
        if tool.destructive:
            grants.append(Grant(capability="destructive_tools", detail=tool.name[:500]))
    if tool.open_world:
        grants.append(Grant(capability="open_world_tools", detail=tool.name[:500]))
    return grants


def _named(names: Sequence[str]) -> str:
    shown = ", ".join(names[:_MAX_NAMED])
    more = len(names) - _MAX_NAMED
    return (shown + (f" and {more} more" if more > 0 else ""))[:500]


def waiting_for(grants: Sequence[Grant], settings: ApprovalSettings) -> list[Grant] | None:
    """The grants that make a run wait for a person under `settings` (bounded), or None
    when it need not wait. "always": every run waits, shown all it is granted."""
    if settings.require is None:
        return None
    if settings.require == "always":
        return list(grants[:MAX_ASKED_GRANTS])
    found = [g for g in grants if g.capability in settings.capabilities]
    return found[:MAX_ASKED_GRANTS] or None


def advice(report: ValidationReport) -> list[Finding]:
    """Validation's security findings, shown to the person as advice (bounded). Never a
    reason to wait or to pass: obfuscation hides them, an imported file escapes them."""
    return [f for f in report.findings if f.kind in _ADVICE_KINDS][:MAX_ASKED_FINDINGS]


@dataclass(frozen=True, slots=True)
class Verdict:
    """A face's answer: the decision, who gave it (as the face knows them), when, and for
    "unavailable" why no one could be asked and what to do (in the face's own terms)."""

    decision: Decision
    who: str
    when: datetime.datetime = field(default_factory=lambda: datetime.datetime.now(datetime.UTC))
    reason: str = ""
    hint: str = ""
    # The grants the person was shown, when the face asked ahead of the run (MCP): the host
    # judges again at the run, and an answer covers only what was shown.
    shown: tuple[str, ...] | None = None


Approver = Callable[[ApprovalRequest], Verdict]
"""A face's way of asking: given what to approve, return a verdict within
`ApprovalRequest.timeout` seconds (a late answer is "timeout"). Called on the run's thread."""

Callback = Callable[[ApprovalRequest], bool] | Callable[[ApprovalRequest], Awaitable[bool]]
"""The library's `Sandbox(approve=...)`: True approves; anything else, or raising, denies."""


class Unavailable(Exception):
    """No one could be asked. Carries the blocked result (put on record by the host before it
    raises the face's ConfigError) and the verdict's reason and hint."""

    def __init__(self, result: ExecutionResult, verdict: Verdict) -> None:
        super().__init__(verdict.reason)
        self.result = result
        self.verdict = verdict


def granted_lines(asked: ApprovalRequest, bullet: str) -> list[str]:
    """What a person asked to approve is shown of the run's grants, one a line after
    `bullet` (neutralised: a grant names hosts and modules the caller chose), then the
    heading of the advice when there is any: the terminal's prompt and the MCP
    elicitation say the same."""
    shown = [f"{bullet}{neutralise_line(str(grant))}" for grant in asked.grants]
    shown = shown or [f"{bullet}nothing"]
    if asked.findings:
        shown.append("Advice from static checks of the code's text (they can be evaded):")
    return shown


def code_sha256(code: str) -> str:
    return hashlib.sha256(code.encode("utf-8", "surrogatepass")).hexdigest()


def event(asked: ApprovalRequest, verdict: Verdict) -> Event:
    """The run's record of the decision: who, when, on which code, for which findings."""
    by = f" by {verdict.who}" if verdict.who else ""
    detail = {
        "approved": f"approved{by}",
        "denied": f"denied{by}",
        "timeout": f"no answer within {asked.timeout:g} s{by}: denied",
        "unavailable": f"no one could be asked: {verdict.reason}",
    }[verdict.decision]
    data: dict[str, object] = {
        "decision": verdict.decision,
        "who": verdict.who,
        "when": verdict.when.isoformat(),
        "code_sha256": asked.code_sha256,
        "capabilities": asked.capabilities,
        "grants": [str(g) for g in asked.grants],
        "rule_ids": asked.rule_ids,  # advice shown, not the reason
        "require": asked.require,
    }
    if verdict.reason:
        data["reason"] = verdict.reason
    return Event(kind="approval", detail=detail[:2000], data=data)


def blocked_result(
    asked: ApprovalRequest, verdict: Verdict, limits: Limits, backend: str
) -> ExecutionResult:
    """The result of code a person did not approve: `blocked`, nothing ran."""
    recorded = event(asked, verdict)
    return ExecutionResult.blocked(
        error=ErrorInfo(
            type="ApprovalDenied",
            message=f"not run: approval required ([approval] require = '{asked.require}'; "
            f"granted: {asked.reason()}), {recorded.detail}",
            traceback=asked.describe(),
        ),
        events=[recorded],
        limits=limits,
        backend=backend,
    )


# --- the library's face: a callback ----------------------------------------------------------

caller_loop: contextvars.ContextVar[asyncio.AbstractEventLoop | None] = contextvars.ContextVar(
    "codecage_approval_loop", default=None
)
"""The event loop of an `arun` caller (its worker thread inherits the context): a coroutine
callback is awaited there, next to the caller's other work."""


_R = TypeVar("_R")


def on_loop(loop: asyncio.AbstractEventLoop, run: Callable[..., _R]) -> Callable[..., _R]:
    """`run`, for a worker thread of an `arun` on `loop`: a coroutine callback it asks is
    awaited there (set in the thread's own copy of the context: nothing leaks back)."""

    def in_thread(*args: Any, **kwargs: Any) -> _R:
        caller_loop.set(loop)
        return run(*args, **kwargs)

    return in_thread


def from_callback(callback: Callback) -> Approver:
    """The library's approver: `callback(request)` in a thread of its own (a coroutine one on
    the `arun` caller's loop, else on a loop of its own), given `request.timeout` seconds.
    A callback still busy then is left behind and its answer ignored."""
    who = f"library callback {_name_of(callback)} (user {login_name()})"

    def approve(asked: ApprovalRequest) -> Verdict:
        loop = caller_loop.get()
        if inspect.iscoroutinefunction(callback) and loop is not None:
            answer = _on_loop(callback, asked, loop)
        else:
            answer = _on_thread(callback, asked)
        if answer is None:
            return Verdict("timeout", who)
        return Verdict("approved" if answer else "denied", who)

    return approve


def _on_loop(
    callback: Callable[[ApprovalRequest], Awaitable[bool]],
    asked: ApprovalRequest,
    loop: asyncio.AbstractEventLoop,
) -> bool | None:
    import asyncio  # here: a plain `run` (the CLI's) need not pay its import (~15 ms)

    async def ask() -> bool:
        return await callback(asked)

    future = asyncio.run_coroutine_threadsafe(ask(), loop)
    try:
        return future.result(asked.timeout) is True
    except TimeoutError:
        future.cancel()
        return None
    except Exception as exc:  # the caller's code failed: no approval
        log.warning("approval.callback_failed", extra={"error": type(exc).__name__})
        return False


def _on_thread(callback: Callback, asked: ApprovalRequest) -> bool | None:
    answers: list[bool] = []
    done = threading.Event()

    def ask() -> None:
        try:
            answer = callback(asked)
            if inspect.isawaitable(answer):
                import asyncio  # as in `_on_loop`

                answer = asyncio.run(_awaited(answer))
            answers.append(answer is True)
        except Exception as exc:  # the caller's code failed: no approval
            log.warning("approval.callback_failed", extra={"error": type(exc).__name__})
            answers.append(False)
        finally:
            done.set()

    threading.Thread(target=ask, name="codecage-approval", daemon=True).start()
    if not done.wait(asked.timeout):
        return None
    return answers[0]


async def _awaited(answer: Awaitable[bool]) -> bool:
    return await answer


def _name_of(callback: object) -> str:
    name = getattr(callback, "__qualname__", None) or type(callback).__qualname__
    return str(name)[:100]


def login_name() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no passwd entry (a container's arbitrary uid)
        return str(os.getuid())
