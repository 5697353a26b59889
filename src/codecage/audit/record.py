"""One execution as the audit trail keeps it: who asked, what ran, under which rules, what
it used, what happened, and what it left.

`record_of` builds an `AuditRecord` from a finished run (`Finished`); everything in it that
came from the code or its output has passed the host's scrubber first (the code itself is
kept only when the operator asks, scrubbed and cut to `[audit] max_code_bytes`), so the
store holds nothing personal in clear that a result would not show scrubbed. The record is
plain data: the stores (`audit.sqlite`, `audit.postgres`) lay it out in tables.
"""

from __future__ import annotations

import datetime
import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from codecage.models import ExecutionResult

CallerKind = Literal["http", "mcp", "library", "cli"]
MAX_CALLER_FIELD = 200
"""Characters of a caller's name or version (both may come from a client)."""


@dataclass(frozen=True, slots=True)
class Caller:
    """Who asked for a run: an HTTP client by its token's name, an MCP client by the name
    and version it gave in `initialize`, or the library's / CLI's user (a login name)."""

    kind: CallerKind
    name: str = ""
    version: str = ""

    def __post_init__(self) -> None:
        # The MCP client names itself: keep it one bounded, printable line.
        object.__setattr__(self, "name", _printable(self.name))
        object.__setattr__(self, "version", _printable(self.version))

    @property
    def label(self) -> str:
        """One word for tables: "http:alice", "mcp:claude-code/1.2", "cli:root"."""
        who = f"{self.name}/{self.version}" if self.version else self.name
        return f"{self.kind}:{who}" if who else self.kind


def _printable(text: str) -> str:
    return "".join(c if c.isprintable() else "?" for c in text)[:MAX_CALLER_FIELD]


@dataclass(frozen=True, slots=True)
class Finished:
    """A run as it ended, with what the host knew of it beyond its result."""

    result: ExecutionResult
    code: str
    caller: Caller
    face: str
    profile: str | None  # the import profile; None: no import policy
    allowed_imports: tuple[str, ...]
    started_at: datetime.datetime  # UTC
    finished_at: datetime.datetime


class RecordedEvent(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    kind: str
    detail: str
    data: dict[str, Any] | None = None


class RecordedToolCall(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    server: str
    tool: str
    status: str
    duration_ms: int | None = None
    bytes: int | None = Field(None, description="Request plus result bytes.")


class RecordedFile(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    path: str
    size: int
    sha256: str | None = None


class AuditRecord(BaseModel):
    """One execution on record (docs/audit.md: the schema)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    execution_id: str
    started_at: datetime.datetime
    finished_at: datetime.datetime
    caller_kind: CallerKind
    caller_name: str
    caller_version: str
    face: str
    session_id: str | None
    backend: str
    profile: str | None
    allowed_imports: list[str]
    limits: dict[str, Any]
    code_sha256: str
    code_bytes: int
    code: str | None = Field(description="Scrubbed and cut; None unless [audit] keep_code.")
    code_truncated: bool
    status: str
    exit_code: int | None
    signal: str | None
    error_type: str | None
    wall_ms: int
    cpu_ms: int | None
    peak_memory_mb: float | None
    bytes_written: int = Field(description="Sizes of the files the run left, summed.")
    events: list[RecordedEvent]
    tool_calls: list[RecordedToolCall]
    files: list[RecordedFile]
    redactions: dict[str, int]


class AlertRecord(BaseModel):
    """An alert that was sent (or tried): `outcome` says which ("sent", "failed: ...",
    "suppressed" when over its rate)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    alert_id: str
    at: datetime.datetime
    kind: str
    execution_id: str | None
    caller_name: str
    detail: str
    target: str = Field(description="The webhook's host or the command's name; no secrets.")
    outcome: str


def record_of(
    finished: Finished, *, keep_code: bool, max_code_bytes: int, scrub: Callable[[str], str]
) -> AuditRecord:
    """The audit record of `finished`. The result was scrubbed already; the code is scrubbed
    here (when kept) with the same scrubber."""
    result = finished.result
    raw = finished.code.encode("utf-8", "surrogatepass")
    code, truncated = _kept_code(finished.code, keep_code, max_code_bytes, scrub)
    return AuditRecord(
        execution_id=result.execution_id,
        started_at=finished.started_at,
        finished_at=finished.finished_at,
        caller_kind=finished.caller.kind,
        caller_name=finished.caller.name,
        caller_version=finished.caller.version,
        face=finished.face,
        session_id=result.session_id,
        backend=result.backend,
        profile=finished.profile,
        allowed_imports=list(finished.allowed_imports),
        limits=result.limits.model_dump(),
        code_sha256=hashlib.sha256(raw).hexdigest(),
        code_bytes=len(raw),
        code=code,
        code_truncated=truncated,
        status=result.status,
        exit_code=result.exit_code,
        signal=result.signal,
        error_type=result.error.type if result.error is not None else None,
        wall_ms=result.usage.wall_ms,
        cpu_ms=result.usage.cpu_ms,
        peak_memory_mb=result.usage.peak_memory_mb,
        bytes_written=sum(f.size for f in result.files),
        events=[
            RecordedEvent(kind=e.kind, detail=e.detail, data=e.data)
            for e in result.events
            if e.kind != "tool_call"
        ],
        tool_calls=[_tool_call(e.data or {}) for e in result.events if e.kind == "tool_call"],
        files=[RecordedFile(path=f.path, size=f.size, sha256=f.sha256) for f in result.files],
        redactions=dict(result.redactions),
    )


def _kept_code(
    code: str, keep: bool, max_bytes: int, scrub: Callable[[str], str]
) -> tuple[str | None, bool]:
    if not keep:
        return None, False
    encoded = code.encode("utf-8", "replace")
    truncated = len(encoded) > max_bytes
    if truncated:  # cut on a character boundary
        code = encoded[:max_bytes].decode("utf-8", "ignore")
    return scrub(code), truncated


def _tool_call(data: dict[str, Any]) -> RecordedToolCall:
    def as_int(key: str) -> int | None:
        value = data.get(key)  # the bridge gives durations as floats (ms), sizes as ints
        if isinstance(value, bool) or not isinstance(value, int | float):
            return None
        return round(value) if value == value and abs(value) < 2**62 else None  # not NaN/inf

    sizes = [n for n in (as_int("request_bytes"), as_int("result_bytes")) if n is not None]
    return RecordedToolCall(
        server=str(data.get("server", "")),
        tool=str(data.get("tool", "")),
        status=str(data.get("status", "")),
        duration_ms=as_int("duration_ms"),
        bytes=sum(sizes) if sizes else None,
    )


def utc_now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)
