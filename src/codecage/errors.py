"""One exception hierarchy for codecage.

```
CodecageError            anything codecage could not do; `.hint` says what to do
├── ConfigError          refused before anything ran (bad limits, bad arguments)
├── HostError            this host cannot give the isolation asked for
├── SandboxError         the sandbox itself failed, not the user's code
│   └── RemoteRunError   a run sent to a node of a cluster ended without a result (`code`)
├── CapacityError        no room to run it now (every node full): retry after `retry_after_s`
├── SessionError         no such session, or it ended (expired, closed, its interpreter died)
└── BridgeError          the tool bridge failed (e.g. writing the generated tool tree)
```

The agent's code failing is *not* an exception: it is an `ExecutionResult` whose
status is not "ok". An exception means codecage could not do what it was asked.

Hints are written once and read through three faces, each in its own terms: the CLI
(`--memory-mb 256`), the library (`limits={"memory_mb": 256}`) and the MCP tools (their
argument `memory_limit_mb=256`, or "ask the operator" for a setting no argument reaches). A
hint names a setting by its field name in braces, `{memory_mb}` or `{memory_mb=256}`, and
`{info}` / `{doctor}` for the commands that list the settings and the host's layers;
`err.hint_for(face)` renders it (`SETTINGS` says how each setting is spelled where), and
`err.hint` is the library's rendering. Braces around anything else are left as they are.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

Face = Literal["cli", "library", "mcp"]
"""Who reads a hint: `codecage` on a terminal, Python code, or a model over MCP."""


@dataclass(frozen=True, slots=True)
class Spelling:
    """How one setting is named on each face (None: that face cannot set it)."""

    cli: str | None
    """The flag, e.g. "--memory-mb"."""
    library: str
    """A keyword argument (`Sandbox(...)`/`run(...)`) or "limits." + a `Limits` field."""
    mcp: str | None
    """The argument of the MCP tool `execute_code`, if one reaches the setting."""


def _limit(name: str, mcp: str | None = None) -> Spelling:
    return Spelling(cli="--" + name.replace("_", "-"), library="limits." + name, mcp=mcp)


SETTINGS: dict[str, Spelling] = {
    "timeout": _limit("timeout", mcp="timeout"),
    "cpu_seconds": _limit("cpu_seconds"),
    "memory_mb": _limit("memory_mb", mcp="memory_limit_mb"),
    "max_processes": _limit("max_processes"),
    "max_open_files": _limit("max_open_files"),
    "max_file_size_mb": _limit("max_file_size_mb"),
    "workspace_mb": _limit("workspace_mb"),
    "tmp_mb": _limit("tmp_mb"),
    "max_output_bytes": _limit("max_output_bytes"),
    "profile": Spelling(cli="--profile", library="profile", mcp="profile"),
    "allowed_imports": Spelling(
        cli="--allow-import", library="allowed_imports", mcp="allowed_imports"
    ),
    "allow_hosts": Spelling(cli="--allow-host", library="allow_hosts", mcp="allow_hosts"),
    "files": Spelling(cli=None, library="files", mcp="files"),
    "return_files": Spelling(cli=None, library="on_files", mcp="return_files"),
    "workspace": Spelling(cli="--workspace", library="workspace", mcp=None),
    "overwrite": Spelling(cli="--overwrite", library="overwrite=True", mcp=None),
    "keep_files_mb": Spelling(cli=None, library="keep_files_mb", mcp=None),
    "data_dir": Spelling(cli="--data", library="data_dir", mcp=None),
    "allow_degraded": Spelling(cli="--allow-degraded", library="allow_degraded", mcp=None),
    "config": Spelling(cli="--config", library="config", mcp=None),
    "audit": Spelling(cli="--audit", library="audit", mcp=None),
    "session_id": Spelling(cli="codecage session run ID", library="Session.run", mcp="session_id"),
    "reply_max_tokens": Spelling(
        cli="--reply-max-tokens", library="ServerLimits(reply_max_tokens=...)", mcp=None
    ),
}
"""Every setting a hint may name, by its field name (STYLE: one name in four spellings)."""

_COMMANDS: dict[str, dict[Face, str]] = {
    "info": {
        "cli": "`codecage info`",
        "library": "`Sandbox().info()`",
        "mcp": "the get_sandbox_info tool",
    },
    "open_session": {
        "cli": "`codecage session open`",
        "library": "`Sandbox().session()`",
        "mcp": "the open_session tool",
    },
    "close_session": {
        "cli": "`codecage session close ID`",
        "library": "`session.close()`",
        "mcp": "the close_session tool",
    },
    "doctor": {
        "cli": "`codecage doctor`",
        "library": "`Sandbox().doctor()`",
        "mcp": "`codecage doctor` (ask the operator)",
    },
}

_PLACEHOLDER = re.compile(r"\{([a-z_]+)(?:=([^{}\n]*))?\}")


def render_hint(template: str, face: Face) -> str:
    """`template` with each `{setting}`, `{setting=value}`, `{info}` and `{doctor}` spelled
    for `face`; anything else in braces is left as it is.

    Raises:
        Nothing: every str is accepted.
    """

    def spell(match: re.Match[str]) -> str:
        name, value = match.group(1), match.group(2)
        if name in _COMMANDS and value is None:
            return _COMMANDS[name][face]
        spelling = SETTINGS.get(name)
        if spelling is None:
            return match.group()
        return _spelled(name, value, spelling, face)

    return _PLACEHOLDER.sub(spell, template)


def _spelled(name: str, value: str | None, spelling: Spelling, face: Face) -> str:
    if face == "cli":
        if spelling.cli is None:
            return f"{name} (not a flag of the CLI)" if value is None else f"{name}={value}"
        return spelling.cli if value is None else f"{spelling.cli} {value}"
    if face == "mcp":
        if spelling.mcp is None:
            shown = name if value is None else f"{name}={value}"
            return f"the operator's setting {shown} (not an argument of this tool)"
        return spelling.mcp if value is None else f"{spelling.mcp}={value}"
    if spelling.library.startswith("limits."):
        field = spelling.library.removeprefix("limits.")
        return f'limits={{"{field}": {value if value is not None else "…"}}}'
    return spelling.library if value is None else f"{spelling.library}={value}"


class CodecageError(Exception):
    """Base of every codecage error: `str(err)` says what happened, `err.hint` what to do."""

    default_hint = "run {doctor} to see what this host provides"

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint_template = hint if hint is not None else self.default_hint
        """The hint as written, with `{setting}` placeholders (see the module docstring)."""

    @property
    def hint(self) -> str:
        """What to do, in the library's terms (keyword arguments)."""
        return render_hint(self.hint_template, "library")

    def hint_for(self, face: Face) -> str:
        """What to do, in the terms of `face`: flags, keyword arguments or tool arguments.

        Raises:
            Nothing.
        """
        return render_hint(self.hint_template, face)

    def __str__(self) -> str:
        return self.message


class ConfigError(CodecageError):
    """A request or setting was refused before anything ran."""

    default_hint = "{info} lists the defaults and the ceilings of this host"


class HostError(CodecageError):
    """This host cannot provide the isolation that was asked for."""

    default_hint = (
        "run {doctor} to see which layer is missing; "
        "pass {allow_degraded} to run without it (the result will say so)"
    )


class SandboxError(CodecageError):
    """The sandbox failed to start or to report, through no fault of the user's code."""


RemoteErrorCode = Literal["node_lost", "timed_out", "sandbox_error"]
"""How a run sent to another node ended without a result (`codecage.ray`'s batch error codes)."""


class RemoteRunError(SandboxError):
    """A run sent to a node of a cluster (`serve --ray`) ended without a result: its node
    went away while it may have been running (`node_lost`), did not answer within the
    run's wall time and a margin (`timed_out`), or failed outside the code
    (`sandbox_error`). The message starts with the code, for a pipeline to act on."""

    def __init__(self, code: RemoteErrorCode, message: str, hint: str) -> None:
        super().__init__(f"{code}: {message}", hint=hint)
        self.code: RemoteErrorCode = code


class CapacityError(CodecageError):
    """No room to run it now (every node of the cluster holds as many runs as it may):
    busy, not wrong; retry after `retry_after_s` (an HTTP face answers 503)."""

    def __init__(self, message: str, hint: str, retry_after_s: int = 1) -> None:
        super().__init__(message, hint=hint)
        self.retry_after_s = retry_after_s
        """Seconds after which the same call may find room (at least 1)."""


class SessionError(CodecageError):
    """A session could not be used: unknown, ended (expired, closed, its interpreter died),
    or one too many."""

    default_hint = "open a new session with {open_session}"


class BridgeError(CodecageError):
    """The tool bridge between the sandbox and the host failed."""


class AuditError(CodecageError):
    """The audit store cannot be read or written (a full disk, a locked or read-only
    database, a server that is down). With `[audit] required`, new runs are refused."""

    default_hint = "check the audit store named in the message (`codecage audit stats`)"
