"""codecage: run code written by AI agents with real OS isolation, get a structured result.

The public API is `__all__`; everything else is internal.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from codecage._version import __version__

if TYPE_CHECKING:  # what a type checker sees; at run time `__getattr__` imports them
    from codecage.bridge.broker import Broker
    from codecage.errors import (
        AuditError,
        BridgeError,
        CodecageError,
        ConfigError,
        HostError,
        SandboxError,
        SessionError,
    )
    from codecage.models import (
        ApprovalRequest,
        DisplayOutput,
        DoctorReport,
        ErrorInfo,
        Event,
        ExecutionResult,
        FileInfo,
        HostInfo,
        LayerStatus,
        Limits,
        ScrubSettings,
        Usage,
    )
    from codecage.options import Options
    from codecage.sandbox import Sandbox
    from codecage.session import Session

__all__ = [
    "ApprovalRequest",
    "AuditError",
    "BridgeError",
    "Broker",
    "CodecageError",
    "ConfigError",
    "DisplayOutput",
    "DoctorReport",
    "ErrorInfo",
    "Event",
    "ExecutionResult",
    "FileInfo",
    "HostError",
    "HostInfo",
    "LayerStatus",
    "Limits",
    "Options",
    "Sandbox",
    "SandboxError",
    "ScrubSettings",
    "Session",
    "SessionError",
    "Usage",
    "__version__",
]


# Where each public name lives, imported on first use: `import codecage` alone loads
# nothing heavy, so that a process that needs one part (the CLI's `serve` answering
# `initialize`, a command that needs no sandbox) does not pay for all of them (pydantic's
# models, the host, the engine: ~350 ms). `from codecage import Sandbox` works as before.
_HOMES = {
    **dict.fromkeys(
        (
            "AuditError",
            "BridgeError",
            "CodecageError",
            "ConfigError",
            "HostError",
            "SandboxError",
            "SessionError",
        ),
        "codecage.errors",
    ),
    **dict.fromkeys(
        (
            "ApprovalRequest",
            "DisplayOutput",
            "DoctorReport",
            "ErrorInfo",
            "Event",
            "ExecutionResult",
            "FileInfo",
            "HostInfo",
            "LayerStatus",
            "Limits",
            "ScrubSettings",
            "Usage",
        ),
        "codecage.models",
    ),
    "Options": "codecage.options",
    "Sandbox": "codecage.sandbox",
    "Session": "codecage.session",
    "Broker": "codecage.bridge.broker",  # loads the MCP SDK (~0.5 s)
}


def __getattr__(name: str) -> object:
    """A public name, imported from its module on first use (and kept here after)."""
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'codecage' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
