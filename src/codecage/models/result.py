"""The result of one run (the `codecage run --json` contract) and its parts."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any, Final, Literal

from pydantic import (
    Field,
    ModelWrapValidatorHandler,
    PrivateAttr,
    field_validator,
    model_validator,
)

from codecage.errors import ConfigError
from codecage.kept import KeptFiles, check_relpath
from codecage.models.base import Model
from codecage.models.settings import Limits
from codecage.models.status import Status
from codecage.output import neutralise_line

EventKind = Literal[
    "import_blocked",
    "syscall_blocked",
    "network_denied",
    "network_allowed",
    "network_usage",
    "output_truncated",
    "files_truncated",
    "workspace_full",
    "return_value_truncated",
    "guest_report_invalid",
    "degraded_isolation",
    "validation_finding",
    "cancelled",
    "tool_call",
    "bridge_closed",
    "reply_trimmed",
    "display_truncated",
    "session_ended",
    "approval",
]
"""Things worth knowing that happened during a run (see docs/security-model.md)."""

EventSource = Literal["host", "guest"]
"""Who says an event happened: the host observed it (its proxy, cgroup, broker, judge), or
the guest reported it (the code's own interpreter: a claim the code can forge or suppress)."""

EVENT_KINDS: tuple[EventKind, ...] = EventKind.__args__  # type: ignore[attr-defined]


MAX_CODE_BYTES = 10 * 1024 * 1024
"""Largest submission accepted: agent code is small; this only stops absurd input early."""


class ErrorInfo(Model):
    """An exception raised by the user's code."""

    type: str = Field(description="Exception class name, e.g. 'ZeroDivisionError'.")
    message: str = Field(description="str() of the exception.")
    traceback: str = Field(description="Traceback limited to frames of the user's code.")


class FileInfo(Model):
    """A regular file the code left in the workspace.

    The code chooses the name, so `path` is neutralised to one line when the model is made
    (`output.neutralise_line`: ESC, C1, bidi controls, newline and tab become visible
    escapes; an undecodable byte shows as ``\\x80``). The name as it is on disk is kept
    aside, out of the JSON, for reading the file back (`raw_path`).
    """

    path: str = Field(
        description="Path relative to /workspace, '/'-separated; control, bidi and newline "
        "characters in it are shown as backslash escapes."
    )
    size: int = Field(ge=0, description="Size in bytes.")
    sha256: str | None = Field(
        description="SHA-256 of the content; None when the file was over the read bound."
    )
    mime: str = Field(description="MIME type guessed from the name and first bytes.")

    # The path as on disk when it differs from `path` (None: the same); not part of the JSON.
    _raw_path: str | None = PrivateAttr(default=None)

    @model_validator(mode="wrap")
    @classmethod
    def _neutralise_path(cls, data: Any, handler: ModelWrapValidatorHandler[FileInfo]) -> FileInfo:
        raw = data.get("path") if isinstance(data, dict) else None
        if not isinstance(raw, str):
            return handler(data)  # an instance already made, or a type error to report
        info = handler({**data, "path": neutralise_line(raw)})
        if info.path != raw:
            info._raw_path = raw
        return info

    def raw_path(self) -> str:
        """The path as it is on disk, for `workspace.read_file`: `path` itself unless
        neutralising changed it. A FileInfo read back from JSON only has `path`."""
        return self.path if self._raw_path is None else self._raw_path


DisplayMime = Literal[
    "text/plain",
    "text/markdown",
    "text/html",
    "image/png",
    "image/jpeg",
    "image/svg+xml",
    "application/json",
]
"""The MIME types a display output may carry (a notebook's), text first, richest last."""

DISPLAY_MIME_TYPES: tuple[DisplayMime, ...] = DisplayMime.__args__  # type: ignore[attr-defined]

DisplaySource = Literal["display", "figure", "last_expression"]
"""What made a display output: `display(obj)`, a matplotlib figure (at `plt.show()` or at
the end of the run), or the value of the run's last expression."""


class DisplayOutput(Model):
    """One rich output of a run, in the order the code made it: a MIME bundle, as a
    notebook cell has them. Text types hold text; image/png and image/jpeg hold base64;
    application/json holds a JSON value. Every bundle has text/plain."""

    index: int = Field(ge=0, description="Position among the run's display outputs.")
    source: DisplaySource = Field(description="display, figure or last_expression.")
    data: dict[DisplayMime, Any] = Field(
        description="MIME type -> content: text, base64 for raster images, JSON for "
        "application/json. text/plain is always there."
    )


class Usage(Model):
    """What the run consumed, as measured by the host."""

    wall_ms: int = Field(ge=0, description="Wall-clock time in milliseconds.")
    cpu_ms: int | None = Field(description="CPU time in ms of every process; None if unknown.")
    peak_memory_mb: float | None = Field(
        description="Peak memory in MiB from the cgroup; None where no cgroup was used."
    )
    waited_ms: int = Field(
        0,
        ge=0,
        description="Milliseconds the call waited for a warm sandbox (one the pool was still "
        "starting) before the run began; not part of wall_ms. 0 when it did not wait.",
    )


MAX_EVENT_DETAIL: Final = 2000
"""Characters of an event's detail, and of each string in its data, after neutralising."""

_MAX_EVENT_DATA_DEPTH: Final = 8
_TOO_DEEP: Final = "(nested too deep)"


class Event(Model):
    """Something worth knowing that happened during the run.

    Details and data hold text the code chose (module, server and tool names, file names),
    so they are neutralised where the event is made, whoever makes it: the detail and every
    string in `data` (keys and values, at any depth up to 8) go through
    `output.neutralise_line` and are cut to `MAX_EVENT_DETAIL` characters. What prints or
    returns an event (the CLI, the MCP summary, a JSON consumer) cannot meet a raw escape
    sequence or a line break in it. Idempotent: validating a dumped event again changes
    nothing. (`model_copy(update=...)` does not validate: pass only neutralised text to it.)
    """

    kind: EventKind
    detail: str = Field(
        max_length=MAX_EVENT_DETAIL,
        description="One line; control, bidi and newline characters shown as backslash escapes.",
    )
    data: dict[str, Any] | None = Field(
        default=None,
        description="Machine-readable facts of the event (a tool_call's server, tool, "
        "duration_ms, status, request_bytes, result_bytes), strings neutralised like the "
        "detail; None for most kinds.",
    )
    source: EventSource = Field(
        default="host",
        description="'host': the host observed it; 'guest': the guest reported it, a claim "
        "the code can forge or suppress (never counted as a denial by stats, metrics or alerts).",
    )

    @field_validator("detail", mode="before")
    @classmethod
    def _one_line_detail(cls, value: Any) -> Any:
        if isinstance(value, str):
            return neutralise_line(value)[:MAX_EVENT_DETAIL]
        return value

    @field_validator("data", mode="before")
    @classmethod
    def _neutralised_data(cls, value: Any) -> Any:
        if isinstance(value, dict):
            return _neutralised_tree(value, 0)
        return value


def _neutralised_tree(value: Any, depth: int) -> Any:
    """`value` with every string in it, dict keys included, one-line neutralised and cut."""
    if isinstance(value, str):
        return neutralise_line(value)[:MAX_EVENT_DETAIL]
    if isinstance(value, dict | list | tuple) and depth >= _MAX_EVENT_DATA_DEPTH:
        return _TOO_DEEP
    if isinstance(value, dict):
        return {
            _neutralised_tree(k, depth + 1): _neutralised_tree(v, depth + 1)
            for k, v in value.items()
        }
    if isinstance(value, list | tuple):
        return [_neutralised_tree(v, depth + 1) for v in value]
    return value


def any_json_value(schema: dict[str, Any]) -> None:
    """Any JSON value, spelled as one single-type branch per JSON type: a schema without a type
    validates anything but tells a client nothing (the MCP Inspector warns on it), and a type
    array is less portable than anyOf. Integers are numbers."""
    schema["anyOf"] = [
        {"type": "object", "additionalProperties": True},
        {"type": "array"},
        {"type": "string"},
        {"type": "number"},
        {"type": "boolean"},
        {"type": "null"},
    ]


class ExecutionResult(Model):
    """The structured result of one run (the contract of `codecage run --json`)."""

    execution_id: str = Field(description="Unique id of this run; log lines about it carry it.")
    status: Status = Field(
        description="How the run ended, judged by the host: ok, error (an exception or a "
        "non-zero exit), timeout, cpu_limit, memory_limit, killed, blocked."
    )
    exit_code: int | None = Field(description="Exit code of the program, None if it was signalled.")
    signal: str | None = Field(description="Name of the signal that ended it, e.g. 'SIGKILL'.")
    stdout: str = Field(description="What the code printed (control characters neutralised).")
    stderr: str = Field(description="What the code wrote to stderr (the traceback is in error).")
    stdout_truncated: bool = Field(description="True when stdout passed max_output_bytes.")
    stderr_truncated: bool = Field(description="True when stderr passed max_output_bytes.")
    return_value: Any = Field(
        description="The value of the code's last expression, if it is one: as JSON when it is "
        "JSON-able (any JSON value, at most 1 MiB encoded), else its repr() as a string "
        "(bounded; a return_value_truncated event says so); null when there is none.",
        json_schema_extra=any_json_value,
    )
    error: ErrorInfo | None = Field(
        description="The exception the code raised, with a traceback of its own frames; "
        "null when it raised none."
    )
    files: list[FileInfo] = Field(
        description="Regular files in /workspace after the run (uploads included)."
    )
    usage: Usage = Field(description="Time and memory the run used, measured by the host.")
    limits: Limits = Field(description="The limits the run had.")
    events: list[Event] = Field(
        description="What else happened: blocked imports or syscalls, truncation, tool calls."
    )
    backend: str = Field(description="The isolation backend that ran the code.")
    displays: list[DisplayOutput] = Field(
        default_factory=list,
        description="Rich outputs in order (figures, display(obj), the last expression's "
        "rich form), as MIME bundles; empty when the code made none.",
    )
    session_id: str | None = Field(
        None, description="The session the run belongs to; null for a one-off run."
    )
    redactions: dict[str, int] = Field(
        default_factory=dict,
        description="How many values the host replaced by a placeholder ([EMAIL], [SECRET], "
        "...) in this result, by category (email, phone, ssn, credit_card, iban, ip, secret); "
        "empty when nothing was found or scrubbing is off.",
    )
    node: str | None = Field(
        None,
        description="The Ray node that ran it (its node id), when a server sends runs to a "
        "cluster (`codecage serve --ray`); null: the host that answered ran it.",
    )

    # The bytes as printed, before neutralising; not part of the JSON contract (`--raw`).
    _raw_stdout: bytes = PrivateAttr(default=b"")
    _raw_stderr: bytes = PrivateAttr(default=b"")
    # The files' bytes, read before the workspace went (library runs); not part of the JSON.
    _kept: KeptFiles | None = PrivateAttr(default=None)

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def read_file(self, path: str) -> bytes:
        """The content of a file the run left in /workspace, by its path as `files` lists
        it (e.g. "out/chart.png"). The workspace is gone: the bytes were kept when the run
        ended, up to `keep_files_mb` for all files together; regular files only, never
        through a link.

        Raises:
            ConfigError: the path is empty, absolute, has a '..' component or a NUL; the run
                left no such file; it was over the bound (the message says so); or this
                result kept no files (read back from JSON, or keep_files_mb=0).
        """
        check_relpath(path)
        return self._kept_files().read(path)

    def save_files(
        self, directory: str | Path, *, overwrite: bool = False, partial: bool = False
    ) -> list[Path]:
        """Write the files the run left into `directory` (made when missing), under their
        relative paths, and return where they went. No link in `directory` is followed
        (each component is opened with O_NOFOLLOW, files made with O_EXCL).

        Args:
            directory: an existing or new directory (not a symlink).
            overwrite: replace files that exist there; else refuse before writing any.
            partial: save what was kept when some file was not (over `keep_files_mb`);
                else refuse before writing any.

        Raises:
            ConfigError: a file exists (without overwrite), a file was not kept (without
                partial), a link or a file is in the way, or this result kept no files.
        """
        return self._kept_files().save(Path(directory), overwrite=overwrite, partial=partial)

    @classmethod
    def blocked(
        cls, *, error: ErrorInfo, events: list[Event], limits: Limits, backend: str
    ) -> ExecutionResult:
        """The result of code refused before it ran (validation, approval): `blocked`,
        nothing ran, nothing used."""
        return cls(
            execution_id=uuid.uuid4().hex,
            status="blocked",
            exit_code=None,
            signal=None,
            stdout="",
            stderr="",
            stdout_truncated=False,
            stderr_truncated=False,
            return_value=None,
            error=error,
            files=[],
            usage=Usage(wall_ms=0, cpu_ms=None, peak_memory_mb=None),
            limits=limits,
            events=events,
            backend=backend,
        )

    def with_kept_files(self, kept: KeptFiles) -> ExecutionResult:
        """This result, holding `kept` for `read_file` and `save_files`."""
        self._kept = kept
        return self

    def _kept_files(self) -> KeptFiles:
        if self._kept is None and self.session_id is not None:
            raise ConfigError(
                f"a run in session {self.session_id} keeps no copies of its files: they stay "
                "in the session's /workspace",
                hint="read them with session.read_file(path) while the session is open",
            )
        if self._kept is None:
            raise ConfigError(
                "this result holds no files' content: it was not returned by "
                "Sandbox.run/arun, or they ran with keep_files_mb=0",
                hint="run with {keep_files_mb} above 0, or read the files in an `on_files` "
                "callback",
            )
        return self._kept

    def raw_stdout(self) -> bytes:
        """stdout exactly as the program wrote it (up to the cap): may hold escape codes."""
        return self._raw_stdout

    def raw_stderr(self) -> bytes:
        """stderr exactly as the program wrote it (up to the cap): may hold escape codes."""
        return self._raw_stderr

    def with_raw_output(self, stdout: bytes, stderr: bytes) -> ExecutionResult:
        self._raw_stdout, self._raw_stderr = stdout, stderr
        return self
