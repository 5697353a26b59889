"""The host<->guest wire format: JSON lines over the control socket (the bootstrap's) and
over the tool bridge (`codecage.runtime`'s), written by the guest with the stdlib and
validated here (untrusted: bounded, checked). The version, kinds, ops and caps are the
contract's (codecage.guest.contract, which the guest imports too); the `Literal`s below
spell them again because a type checker needs literals, and a test pins that they agree."""

from __future__ import annotations

import base64
import binascii
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, field_validator

from codecage.errors import Face
from codecage.guest import contract
from codecage.guest.contract import WIRE_VERSION as WIRE_VERSION
from codecage.models.base import Model
from codecage.models.result import DisplayMime, DisplaySource, ErrorInfo


class GuestLimits(Model):
    """Per-run rlimits the guest bootstrap applies before the user's code starts."""

    cpu_seconds: int
    max_open_files: int
    max_file_size_bytes: int
    max_processes: int | None = Field(
        description="RLIMIT_NPROC, only when no pids cgroup enforces the process limit."
    )
    address_space_bytes: int | None = Field(
        description="RLIMIT_AS, only when no memory cgroup enforces the memory limit."
    )
    session_cpu_seconds: int | None = Field(
        None, description="A session's CPU budget for all its runs (the hard RLIMIT_CPU)."
    )


class GuestRequest(Model):
    """host -> guest: the code to run."""

    v: Literal[1] = WIRE_VERSION
    kind: Literal["run"] = "run"
    code: str
    filename: str
    limits: GuestLimits
    return_value_max_bytes: int
    profile: str = Field("", description="Profile name(s), for messages.")
    allowed_modules: list[str] | None = Field(
        None, description="Modules the user's code may import; None = no import policy."
    )
    face: Face = Field("library", description="Who asked: an import refusal's hint says how "
                       "to allow the module in this face's terms.")  # fmt: skip
    installed_packages: list[str] = Field(
        default_factory=list,
        description="Third-party packages the host has: a refusal suggests allowing only "
        "these (or the standard library's), never a module that would then be missing.",
    )
    wider_profile: str | None = Field(
        None, description="A profile the caller may choose that allows every module."
    )
    session: bool = Field(
        False, description="Keep the interpreter for the next run (a session's run)."
    )
    interrupt_after_s: float | None = Field(
        None, description="A session's run: KeyboardInterrupt in the code after this many seconds."
    )


class GuestReady(Model):
    """guest -> host: the interpreter is up and waits for its request."""

    v: Literal[1]
    kind: Literal["ready"]
    pid: int


GuestEventKind = Literal[
    "syscall_blocked",
    "network_denied",
    "return_value_truncated",
    "import_blocked",
    "display_truncated",
]


class GuestEvent(Model):
    kind: GuestEventKind
    detail: Annotated[str, Field(max_length=contract.MAX_EVENT_DETAIL)]


class GuestResult(Model):
    """guest -> host: how the code ended, as the guest saw it. Untrusted: bounded, validated."""

    v: Literal[1]
    kind: Literal["result"]
    pid: int = Field(description="pid (inside the sandbox) of the process that reported.")
    exit_code: int = Field(0, ge=0, le=255, description="The code the guest then exits with.")
    return_value: Any = None
    error: ErrorInfo | None = None
    events: Annotated[list[GuestEvent], Field(max_length=contract.MAX_EVENTS)] = Field(
        default_factory=list
    )


_TEXT_MIMES = frozenset({"text/plain", "text/markdown", "text/html", "image/svg+xml"})
_IMAGE_MAGIC = {"image/png": b"\x89PNG\r\n\x1a\n", "image/jpeg": b"\xff\xd8\xff"}


class GuestDisplay(Model):
    """guest -> host: one rich output, sent as the code made it. Untrusted: the line's size
    is checked before it is parsed (`contract.MAX_DISPLAY_BYTES`, and the run's count and
    bytes by `engine.judge.ControlStream`); text types must be text, images valid base64
    of a PNG or JPEG, text/plain present."""

    v: Literal[1]
    kind: Literal["display"]
    pid: int = Field(description="pid (inside the sandbox) of the process that sent it.")
    source: DisplaySource
    data: dict[DisplayMime, Any]

    @field_validator("data")
    @classmethod
    def _check_bundle(cls, data: dict[str, Any]) -> dict[str, Any]:
        if not isinstance(data.get("text/plain"), str):
            raise ValueError("a display output needs text/plain as a string")
        for mime, value in data.items():
            if mime in _TEXT_MIMES and not isinstance(value, str):
                raise ValueError(f"{mime} must be a string")
            if mime in _IMAGE_MAGIC:
                _check_image(mime, value)
        return data


def _check_image(mime: str, value: Any) -> None:
    if not isinstance(value, str):
        raise ValueError(f"{mime} must be base64 text")
    try:
        raw = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"{mime} is not valid base64") from exc
    if not raw.startswith(_IMAGE_MAGIC[mime]):
        raise ValueError(f"{mime} does not hold a {mime.split('/')[1].upper()} image")


class GuestEnd(Model):
    """guest -> host: the main process's last message; the run is over. Untrusted."""

    v: Literal[1]
    kind: Literal["end"]
    pid: int
    exit_code: int = Field(ge=0, le=255)


# --- the tool bridge (docs/tool-bridge.md) ----------------------------------------------


class _BridgeRequest(BaseModel):
    """guest -> host, one line of the tool bridge. Fields the host does not know are
    ignored, as before there were models; every line is bounded before it is parsed
    (`contract.BRIDGE_MAX_REQUEST_BYTES`, and its nesting by the channel)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    v: Literal[1]
    id: StrictInt


class CallToolRequest(_BridgeRequest):
    """Call `tool` of the upstream server `server` with `arguments`."""

    op: Literal["call_tool"]
    server: StrictStr
    tool: StrictStr
    arguments: dict[str, Any] = Field(default_factory=dict)

    @field_validator("arguments", mode="before")
    @classmethod
    def _none_is_empty(cls, value: Any) -> Any:
        return value or {}  # absent, null or empty: no arguments


class ScrubRequest(_BridgeRequest):
    """Scrub `text` with the host's scrubber."""

    op: Literal["scrub"]
    text: StrictStr


BridgeRequest = Annotated[CallToolRequest | ScrubRequest, Field(discriminator="op")]
"""A request, told apart by its `op`."""

BridgeErrorKind = Literal[
    "bad_request",
    "no_servers",
    "unknown_server",
    "not_allowed",
    "limit",
    "timeout",
    "tool_error",
    "upstream_error",
]
"""Why a request failed (the guest raises `ToolCallError` with it as `.kind`)."""


class BridgeAnswer(Model):
    """host -> guest: the request `id` succeeded; `result` is a tool's result
    (`{"structured", "text", "is_error"}`) or the scrubbed text."""

    v: Literal[1] = WIRE_VERSION
    id: int
    ok: Literal[True] = True
    result: Any

    def to_dict(self) -> dict[str, Any]:
        """The line's JSON object, with `result` as it is (not copied: it may be MiBs)."""
        return {"v": self.v, "id": self.id, "ok": self.ok, "result": self.result}


class BridgeErrorInfo(Model):
    kind: BridgeErrorKind
    message: Annotated[str, Field(max_length=4000)]


class BridgeFailure(Model):
    """host -> guest: the request `id` failed."""

    v: Literal[1] = WIRE_VERSION
    id: int
    ok: Literal[False] = False
    error: BridgeErrorInfo


class BridgeClosed(Model):
    """host -> guest: the last line before the host ends the channel, and why."""

    v: Literal[1] = WIRE_VERSION
    closed: Annotated[str, Field(max_length=contract.BRIDGE_MAX_CLOSED_REASON)]
