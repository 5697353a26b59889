"""One exception hierarchy for codecage.

```
CodecageError            anything codecage could not do; `.hint` says what to do
├── ConfigError          refused before anything ran (bad limits, bad arguments)
├── HostError            this host cannot give the isolation asked for
├── SandboxError         the sandbox itself failed, not the user's code
├── BridgeError          the tool bridge failed
│   ├── ToolNotAllowed
│   └── UpstreamError
└── AuditError           the audit store failed
```

The agent's code failing is *not* an exception: it is an `ExecutionResult` whose
status is not "ok". An exception means codecage could not do what it was asked.
"""

from __future__ import annotations


class CodecageError(Exception):
    """Base of every codecage error: `str(err)` says what happened, `err.hint` what to do."""

    default_hint = "run `codecage doctor` to see what this host provides"

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint if hint is not None else self.default_hint

    def __str__(self) -> str:
        return self.message


class ConfigError(CodecageError):
    """A request or setting was refused before anything ran."""

    default_hint = "`codecage info` lists the defaults and the ceilings of this host"


class HostError(CodecageError):
    """This host cannot provide the isolation that was asked for."""

    default_hint = (
        "run `codecage doctor` to see which layer is missing; "
        "pass --allow-degraded to run without it (the result will say so)"
    )


class SandboxError(CodecageError):
    """The sandbox failed to start or to report, through no fault of the user's code."""


class BridgeError(CodecageError):
    """The tool bridge between the sandbox and the host failed."""


class ToolNotAllowed(BridgeError):
    """The code called a tool that the policy does not allow."""


class UpstreamError(BridgeError):
    """An upstream MCP server failed or could not be reached."""


class AuditError(CodecageError):
    """The audit store could not be written or read."""
