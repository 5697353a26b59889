"""The host<->guest wire format: JSON lines over the control socket, written by the guest
with the stdlib and validated here (untrusted: bounded, checked)."""

from __future__ import annotations

from typing import Annotated, Any, Final, Literal

from pydantic import (
    Field,
)

from codecage.errors import Face
from codecage.models.base import Model
from codecage.models.result import ErrorInfo

WIRE_VERSION: Final = 1
"""Version of the JSON-lines protocol between host and guest bootstrap."""


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


class GuestReady(Model):
    """guest -> host: the interpreter is up and waits for its request."""

    v: Literal[1]
    kind: Literal["ready"]
    pid: int


GuestEventKind = Literal[
    "syscall_blocked", "network_denied", "return_value_truncated", "import_blocked"
]


class GuestEvent(Model):
    kind: GuestEventKind
    detail: Annotated[str, Field(max_length=500)]


class GuestResult(Model):
    """guest -> host: how the code ended, as the guest saw it. Untrusted: bounded, validated."""

    v: Literal[1]
    kind: Literal["result"]
    pid: int = Field(description="pid (inside the sandbox) of the process that reported.")
    exit_code: int = Field(0, ge=0, le=255, description="The code the guest then exits with.")
    return_value: Any = None
    error: ErrorInfo | None = None
    events: Annotated[list[GuestEvent], Field(max_length=50)] = Field(default_factory=list)


class GuestEnd(Model):
    """guest -> host: the main process's last message; the run is over. Untrusted."""

    v: Literal[1]
    kind: Literal["end"]
    pid: int
    exit_code: int = Field(ge=0, le=255)
