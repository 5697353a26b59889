"""codecage: run code written by AI agents with real OS isolation, get a structured result.

The public API is `__all__`; everything else is internal.
"""

from __future__ import annotations

from codecage._version import __version__
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
from codecage.sandbox import Sandbox
from codecage.session import Session

__all__ = [
    "ApprovalRequest",
    "AuditError",
    "BridgeError",
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
    "Sandbox",
    "SandboxError",
    "ScrubSettings",
    "Session",
    "SessionError",
    "Usage",
    "__version__",
]
