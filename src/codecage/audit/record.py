"""One execution as the audit trail keeps it: who asked, what ran, under which rules, what
it used, what happened, and what it left.

`record_of` builds an `AuditRecord` from a finished run (`Finished`); everything in it that
came from the code or its output has passed the host's scrubber first (the code itself is
kept only when the operator asks, scrubbed and cut to `[audit] max_code_bytes`), so the
store holds nothing personal in clear that a result would not show scrubbed. The record is
plain data: the stores (`audit.sqlite`, `audit.postgres`) lay it out in tables.

A record is bounded whatever the run did (`MAX_RECORD_BYTES` besides its code): at most
`MAX_FILES` files, `MAX_EVENTS` events (what the host observed first: the guest's claims
cannot push it out) and `MAX_TOOL_CALLS` tool calls, each text cut to its bound in bytes as
JSON encodes it. What was left out is on the record: `omitted` counts it by what it was, and
`truncated` says that anything was left out or cut.
"""

from __future__ import annotations

import datetime
import hashlib
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field

from codecage.models import Event, EventSource, ExecutionResult, FileInfo

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


MAX_FILES: Final = 64
"""Files listed per record; the rest are counted (`omitted["files"]`)."""
MAX_PATH_BYTES: Final = 160
MAX_EVENTS: Final = 48
"""Events per record, the host's first, then the guest's; the rest are counted."""
MAX_DETAIL_BYTES: Final = 200
MAX_DATA_BYTES: Final = 256
"""An event's data as JSON; longer strings in it are cut first, then it is left out."""
MAX_DATA_STRING_BYTES: Final = 48
MAX_APPROVAL_DATA_BYTES: Final = 2048
"""The data of a record's one `approval` event (the host's): who decided, when, on which
code (its sha256, whole) and for which grants. The common bound would leave it out whole."""
MAX_APPROVAL_STRING_BYTES: Final = 200
MAX_TOOL_CALLS: Final = 32
MAX_NAME_BYTES: Final = 64
"""A tool's server, name and status, a module name, a redaction's category."""
MAX_IMPORTS_BYTES: Final = 4096
"""The import policy's modules, all of them together."""
MAX_REDACTION_KINDS: Final = 32
MAX_FIELD_BYTES: Final = 200
"""Any other text from a request or a result: the profile, an error's type, a signal."""
MAX_RECORD_BYTES: Final = 64 * 1024
"""The most a record takes as JSON besides its code (which `[audit] max_code_bytes` bounds):
the bounds above, added up with their keys, are under it (tests/test_audit_bounds.py fills
every one of them)."""
CUT_MARK: Final = "\u2026"


@dataclass(slots=True)
class _Cuts:
    """What bounding a record left out, by what it was, and how many texts it cut."""

    omitted: dict[str, int] = field(default_factory=dict)
    cut: int = 0

    def leave_out(self, what: str, count: int) -> None:
        if count > 0:
            self.omitted[what] = self.omitted.get(what, 0) + count

    def text(self, value: str, max_bytes: int) -> str:
        kept = cut_text(value, max_bytes)
        if kept != value:
            self.cut += 1
        return kept


def _json_bytes(char: str) -> int:
    return len(json.dumps(char, ensure_ascii=False).encode("utf-8", "surrogatepass")) - 2


def cut_text(value: str, max_bytes: int) -> str:
    """`value` if it takes at most `max_bytes` as JSON (UTF-8, escapes counted), else its
    longest head that fits with `CUT_MARK` after it."""
    if len(value) * 6 <= max_bytes or _size(value) <= max_bytes:
        return value
    budget = max_bytes - _json_bytes(CUT_MARK)
    kept = []
    for char in value:
        budget -= _json_bytes(char)
        if budget < 0:
            break
        kept.append(char)
    return "".join(kept) + CUT_MARK


def _size(value: str) -> int:
    return len(json.dumps(value, ensure_ascii=False).encode("utf-8", "surrogatepass")) - 2


class RecordedEvent(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    kind: str
    detail: str
    data: dict[str, Any] | None = None
    source: EventSource | None = Field(
        None,
        description="'host': observed by the host; 'guest': the guest's claim; None: not "
        "known (recorded before the origin was kept: a schema 1 row, an older journal).",
    )


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
    truncated: bool = Field(
        False, description="Something was left out of the record or cut to its bound."
    )
    omitted: dict[str, int] = Field(
        default_factory=dict,
        description="What was left out, counted: files, events, tool_calls, allowed_imports, "
        "redactions, and cut (texts cut to their bound).",
    )


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
    """The audit record of `finished`, bounded (`MAX_RECORD_BYTES` besides the code). The
    result was scrubbed already; the code is scrubbed here (when kept) with the same
    scrubber."""
    result = finished.result
    raw = finished.code.encode("utf-8", "surrogatepass")
    code, truncated = _kept_code(finished.code, keep_code, max_code_bytes, scrub)
    cuts = _Cuts()
    calls = [e for e in result.events if e.kind == "tool_call"]
    record = AuditRecord(
        execution_id=cuts.text(result.execution_id, MAX_FIELD_BYTES),
        started_at=finished.started_at,
        finished_at=finished.finished_at,
        caller_kind=finished.caller.kind,
        caller_name=finished.caller.name,
        caller_version=finished.caller.version,
        face=cuts.text(finished.face, MAX_NAME_BYTES),
        session_id=_cut_or_none(cuts, result.session_id, MAX_FIELD_BYTES),
        backend=cuts.text(result.backend, MAX_NAME_BYTES),
        profile=_cut_or_none(cuts, finished.profile, MAX_FIELD_BYTES),
        allowed_imports=_imports(cuts, finished.allowed_imports),
        limits=result.limits.model_dump(),
        code_sha256=hashlib.sha256(raw).hexdigest(),
        code_bytes=len(raw),
        code=code,
        code_truncated=truncated,
        status=result.status,
        exit_code=result.exit_code,
        signal=_cut_or_none(cuts, result.signal, MAX_NAME_BYTES),
        error_type=_cut_or_none(
            cuts, result.error.type if result.error is not None else None, MAX_FIELD_BYTES
        ),
        wall_ms=result.usage.wall_ms,
        cpu_ms=result.usage.cpu_ms,
        peak_memory_mb=result.usage.peak_memory_mb,
        bytes_written=sum(f.size for f in result.files),
        events=_events(cuts, [e for e in result.events if e.kind != "tool_call"]),
        tool_calls=[_tool_call(e.data or {}, cuts) for e in calls[:MAX_TOOL_CALLS]],
        files=_files(cuts, result.files),
        redactions=_redactions(cuts, result.redactions),
    )
    cuts.leave_out("tool_calls", len(calls) - MAX_TOOL_CALLS)
    cuts.leave_out("cut", cuts.cut)
    if not cuts.omitted:
        return record
    return record.model_copy(update={"truncated": True, "omitted": cuts.omitted})


def bounded_events(events: Iterable[RecordedEvent]) -> list[RecordedEvent]:
    """Events added to a record later (`AuditTrail.note`), each cut as `record_of` cuts a
    record's; at most `MAX_EVENTS` of them."""
    cuts = _Cuts()
    return [_recorded(cuts, e.kind, e.detail, e.data, e.source) for e in list(events)[:MAX_EVENTS]]


def _cut_or_none(cuts: _Cuts, value: str | None, max_bytes: int) -> str | None:
    return None if value is None else cuts.text(value, max_bytes)


def _imports(cuts: _Cuts, modules: Iterable[str]) -> list[str]:
    kept: list[str] = []
    budget = MAX_IMPORTS_BYTES
    every = list(modules)
    for name in every:
        name = cuts.text(name, MAX_NAME_BYTES)
        budget -= _size(name) + 3  # quotes and a comma
        if budget < 0:
            break
        kept.append(name)
    cuts.leave_out("allowed_imports", len(every) - len(kept))
    return kept


def _events(cuts: _Cuts, events: list[Event]) -> list[RecordedEvent]:
    """The host's events first, then the guest's, up to `MAX_EVENTS`, in their order: a
    guest that floods its report cannot push out what the host saw."""
    host = [i for i, e in enumerate(events) if e.source == "host"]
    guest = [i for i, e in enumerate(events) if e.source != "host"]
    kept = sorted((host + guest)[:MAX_EVENTS])
    cuts.leave_out("events", len(events) - len(kept))
    approval = next((i for i in kept if _is_approval(events[i])), None)
    return [
        _recorded(cuts, e.kind, e.detail, e.data, e.source, approval=i == approval)
        for i, e in ((i, events[i]) for i in kept)
    ]


def _is_approval(event: Event) -> bool:
    return event.kind == "approval" and event.source == "host"


def _recorded(
    cuts: _Cuts,
    kind: str,
    detail: str,
    data: dict[str, Any] | None,
    source: EventSource | None,
    *,
    approval: bool = False,
) -> RecordedEvent:
    bounds = (
        (MAX_APPROVAL_DATA_BYTES, MAX_APPROVAL_STRING_BYTES)
        if approval
        else (MAX_DATA_BYTES, MAX_DATA_STRING_BYTES)
    )
    return RecordedEvent(
        kind=cuts.text(kind, MAX_NAME_BYTES),
        detail=cuts.text(detail, MAX_DETAIL_BYTES),
        data=_data(cuts, data, *bounds),
        source=source,
    )


def _data(
    cuts: _Cuts,
    data: dict[str, Any] | None,
    max_bytes: int = MAX_DATA_BYTES,
    string_bytes: int = MAX_DATA_STRING_BYTES,
) -> dict[str, Any] | None:
    """`data` within `max_bytes` as JSON: its strings cut to `string_bytes` first, then its
    lists shortened from the end (an approval's grants), then left out whole (counted)."""
    if not data or _json_size(data) <= max_bytes:
        return data
    short = _short_strings(data, 0, string_bytes)
    while isinstance(short, dict) and _json_size(short) > max_bytes and _drop_last_item(short):
        pass
    if isinstance(short, dict) and _json_size(short) <= max_bytes:
        cuts.cut += 1
        return short
    cuts.leave_out("event_data", 1)
    return None


def _json_size(value: Any) -> int:
    return len(json.dumps(value, ensure_ascii=False).encode())


def _drop_last_item(data: dict[str, Any]) -> bool:
    """Take the last item off the longest top-level list of `data`; False: none left."""
    lists = [v for v in data.values() if isinstance(v, list) and v]
    if not lists:
        return False
    max(lists, key=len).pop()
    return True


def _short_strings(value: Any, depth: int, string_bytes: int = MAX_DATA_STRING_BYTES) -> Any:
    if isinstance(value, str):
        return cut_text(value, string_bytes)
    if depth >= 4 and isinstance(value, dict | list):
        return None
    if isinstance(value, dict):
        return {
            cut_text(str(k), string_bytes): _short_strings(v, depth + 1, string_bytes)
            for k, v in value.items()
        }
    if isinstance(value, list):
        return [_short_strings(v, depth + 1, string_bytes) for v in value]
    return value


def _files(cuts: _Cuts, files: list[FileInfo]) -> list[RecordedFile]:
    cuts.leave_out("files", len(files) - MAX_FILES)
    return [
        RecordedFile(path=cuts.text(f.path, MAX_PATH_BYTES), size=f.size, sha256=f.sha256)
        for f in files[:MAX_FILES]
    ]


def _redactions(cuts: _Cuts, redactions: dict[str, int]) -> dict[str, int]:
    items = list(redactions.items())
    cuts.leave_out("redactions", len(items) - MAX_REDACTION_KINDS)
    return {cuts.text(k, MAX_NAME_BYTES): n for k, n in items[:MAX_REDACTION_KINDS]}


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


def _tool_call(data: dict[str, Any], cuts: _Cuts | None = None) -> RecordedToolCall:
    cuts = cuts if cuts is not None else _Cuts()

    def as_int(key: str) -> int | None:
        value = data.get(key)  # the bridge gives durations as floats (ms), sizes as ints
        if isinstance(value, bool) or not isinstance(value, int | float):
            return None
        return round(value) if value == value and abs(value) < 2**62 else None  # not NaN/inf

    sizes = [n for n in (as_int("request_bytes"), as_int("result_bytes")) if n is not None]
    return RecordedToolCall(
        server=cuts.text(str(data.get("server", "")), MAX_NAME_BYTES),
        tool=cuts.text(str(data.get("tool", "")), MAX_NAME_BYTES),
        status=cuts.text(str(data.get("status", "")), MAX_NAME_BYTES),
        duration_ms=as_int("duration_ms"),
        bytes=sum(sizes) if sizes else None,
    )


def utc_now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)
