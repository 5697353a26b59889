"""Human approval of high-risk code: which code must wait for a person, how the answer is
recorded, and the library's way of asking (a callback).

The operator's `[approval] require` says which code waits: "high" (a high-severity security
finding of validation, or code too large or deep to analyse: what cannot be looked at is
not waved through), "medium" (medium or high), "always" (every run). Syntax errors and
imports outside the profile do not count: such code cannot do anything the sandbox would
not refuse anyway.

Each face asks in its own way (the library: a callback; the CLI: a prompt on a terminal,
`cli/approval.py`; MCP: elicitation, `mcp/approval.py`) and answers with a `Verdict`; the
host turns it into one `approval` event (`event`) on the run's result, which the audit
trail keeps like every event. Anything but "approved" means nothing runs: the result is
`blocked` (`blocked_result`). "unavailable" (no one could be asked) is also an error of
the face, raised after the blocked result is on record (`Unavailable`).

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
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from codecage.models import (
    ApprovalLevel,
    ApprovalRequest,
    Decision,
    ErrorInfo,
    Event,
    ExecutionResult,
    Finding,
    Limits,
    ValidationReport,
)

if TYPE_CHECKING:
    import asyncio

log = logging.getLogger(__name__)

MAX_ASKED_FINDINGS = 50
"""Findings shown to the person (and kept in the event): enough to judge, bounded."""

_RANK = {"low": 0, "medium": 1, "high": 2}
_COUNTED_KINDS = frozenset({"security", "limit"})


@dataclass(frozen=True, slots=True)
class Verdict:
    """A face's answer: the decision, who gave it (as the face knows them), when, and for
    "unavailable" why no one could be asked and what to do (in the face's own terms)."""

    decision: Decision
    who: str
    when: datetime.datetime = field(default_factory=lambda: datetime.datetime.now(datetime.UTC))
    reason: str = ""
    hint: str = ""


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


def code_sha256(code: str) -> str:
    return hashlib.sha256(code.encode("utf-8", "surrogatepass")).hexdigest()


def reaching(report: ValidationReport, require: ApprovalLevel) -> list[Finding] | None:
    """The findings that make code wait for a person under `require` (bounded), or None
    when it need not wait."""
    counted = [f for f in report.findings if f.kind in _COUNTED_KINDS]
    if require == "always":
        return counted[:MAX_ASKED_FINDINGS]
    floor = _RANK[require]
    found = [f for f in counted if _RANK[f.severity] >= floor]
    return found[:MAX_ASKED_FINDINGS] or None


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
        "rule_ids": asked.rule_ids,
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
            message=f"not run: approval required ([approval] require = '{asked.require}'), "
            f"{recorded.detail}",
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
