"""codecage: run code written by AI agents with real OS isolation, get a structured result.

The public API is `__all__`; everything else is internal.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

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

if TYPE_CHECKING:
    from codecage.bridge.broker import Broker as Broker

__version__ = "0.1.0"

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


def __getattr__(name: str) -> object:
    """`Broker` on first use: it loads the MCP SDK (~0.5 s), which a plain run never needs."""
    if name == "Broker":
        from codecage.bridge.broker import Broker

        return Broker
    raise AttributeError(f"module 'codecage' has no attribute {name!r}")
