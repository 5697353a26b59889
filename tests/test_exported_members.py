"""The public API is codecage.__all__, sorted; the rest is internal."""

from __future__ import annotations

import codecage


def test_all_is_sorted_and_every_name_exists() -> None:
    assert codecage.__all__ == sorted(codecage.__all__)
    for name in codecage.__all__:
        assert hasattr(codecage, name), name


def test_public_api_is_pinned() -> None:
    assert set(codecage.__all__) == {
        "BridgeError", "CodecageError", "ConfigError", "DoctorReport",
        "ErrorInfo", "Event", "ExecutionResult", "FileInfo", "HostError", "HostInfo",
        "LayerStatus", "Limits", "Sandbox", "SandboxError", "ScrubSettings", "Usage", "__version__",
        "DisplayOutput", "Session", "SessionError", "AuditError", "ApprovalRequest",
        "Broker", "Options",
    }  # fmt: skip
