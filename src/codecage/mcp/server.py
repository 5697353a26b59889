"""codecage as an MCP server: `execute_code`, `validate_code`, `get_sandbox_info`.

Built on the official SDK's `MCPServer`. Every failure that is the *caller's* (bad
arguments, limits above the server's maximums, a full queue) is a `ToolError`, whose message
reaches the model; the *code's* failures (exceptions, timeouts, refused imports) are normal
results with a status, because the model must read them to fix its code.

Executions run in worker threads, at most `max_concurrent` at once; up to `max_queued` more
wait, and past that a call is refused with a clear "busy" error. Uploaded files are written
into the run's own size-limited workspace (warm or cold) before the code runs; images and
asked-for files are read back before the workspace goes.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import dataclasses
import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, TypeVar, cast

import anyio
import anyio.to_thread
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError, UnexpectedToolError
from mcp.server.mcpserver.tools import Tool
from mcp.server.mcpserver.utilities.func_metadata import ArgModelBase
from mcp_types import CallToolResult, ContentBlock, ImageContent, TextContent, ToolAnnotations
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from codecage import __version__
from codecage.engine import workspace as workspaces
from codecage.engine.pool import Pool
from codecage.errors import CodecageError, ConfigError
from codecage.mcp import http as http_serving
from codecage.mcp import reply
from codecage.models import (
    DEFAULT_REPLY_MAX_TOKENS,
    ExecutionResult,
    FileInfo,
    HostInfo,
    Limits,
    ServeSettings,
    ValidationReport,
)
from codecage.output import neutralise_line, neutralise_text
from codecage.policy.scrub import Scrubber, merge_counts
from codecage.sandbox import Sandbox

log = logging.getLogger(__name__)

MAX_UPLOAD_FILES = 100
MAX_UPLOAD_BYTES = 20 * 1024 * 1024
MAX_IMAGES = 5
MAX_IMAGE_BYTES = 640 * 1024  # as base64, one fits in a reply (reply.MAX_REPLY_BYTES)
MAX_INLINE_FILE_BYTES = 256 * 1024
MAX_RETURN_FILES = 20
# HTTP request bodies (the SDK's default is 4 MiB): room for the largest uploads as base64,
# and for oversized code to reach the tool and get its readable error, not an HTTP 413.
MAX_HTTP_BODY_BYTES = 32 * 1024 * 1024
# Files listed as one of these are read as image candidates; only raster content whose
# magic bytes say so (`_raster_type`) goes back as an image. SVG never does: it is XML
# that can carry scripts and text the scrubber never read (return_files gives it as
# scrubbed text).
_IMAGE_TYPES = frozenset({"image/png", "image/jpeg", "image/gif", "image/webp"})
_RASTER_MAGIC = (
    (b"\x89PNG\r\n\x1a\n", "image/png"),
    (b"\xff\xd8\xff", "image/jpeg"),
    (b"GIF87a", "image/gif"),
    (b"GIF89a", "image/gif"),
)
_MAX_CACHED_PROFILES = 16

INSTRUCTIONS = """\
codecage runs Python in a throwaway, isolated Linux sandbox: no network, no host files, \
bounded time, memory and processes. Use execute_code to compute, analyse data and transform \
files; print what you need to see, or end the code with an expression to get its value. \
The working directory /workspace starts empty: upload inputs with `files`, and files the code \
writes there are listed in the result (images come back as images). Use validate_code to \
check code without running it, and get_sandbox_info for the profiles and limits."""


@dataclass(frozen=True, slots=True)
class ServerLimits:
    """What a call may ask for at most (the server's configured maximums)."""

    max_timeout: float = 120.0
    max_memory_mb: int = 2048
    max_concurrent: int = 4
    max_queued: int = 32
    reply_max_tokens: int | None = None
    """Estimated tokens a reply may take (None: the config's [serve] reply_max_tokens)."""


@dataclass(slots=True)
class _Runner:
    """The sandboxes of the server (one per profile, sharing one warm pool) and the queue."""

    base: Sandbox
    limits: ServerLimits
    pool: Pool | None
    slots: anyio.Semaphore
    waiting: int = 0
    by_profile: dict[str, Sandbox] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    # Upstream MCP servers and tool trees (--mcp-config ...): the same for every Sandbox.
    sandbox_options: dict[str, Any] = field(default_factory=dict)

    def sandbox_for(self, profile: str | None, allowed_imports: list[str] | None) -> Sandbox:
        """The Sandbox of a profile; one with extra imports is made per call and runs cold
        (callers must not be able to make the pool keep a key per import list)."""
        name = profile or self.base.settings.profile
        if allowed_imports:
            return Sandbox(
                profile=name, allowed_imports=allowed_imports, pool=False, **self.sandbox_options
            )
        with self.lock:
            if name in self.by_profile:
                return self.by_profile[name]
        # Only single profiles get warm sandboxes: combinations ("basic,filesystem", in any
        # order) would let callers make the pool keep a key, and memory, per spelling.
        pooled = self.pool if "," not in name else None
        sandbox = Sandbox(profile=name, pool=pooled or False, **self.sandbox_options)
        with self.lock:
            if len(self.by_profile) < _MAX_CACHED_PROFILES:
                self.by_profile.setdefault(name, sandbox)
        return sandbox


def build_server(
    *,
    limits: ServerLimits | None = None,
    pool: bool = True,
    sandbox_options: dict[str, Any] | None = None,
) -> MCPServer:
    """The MCP server, ready for `run()` (stdio) or `streamable_http_app()`.

    Raises:
        ConfigError: the config file or environment is invalid, or reply_max_tokens is out
            of its bounds.
        HostError: this host cannot run sandboxes.
    """
    server_limits = limits or ServerLimits()
    # e.g. ToolSetup.sandbox_options(); hints in results name the tool's arguments
    options = {"face": "mcp", **(sandbox_options or {})}
    base = Sandbox(pool=pool, **options)
    budget = server_limits.reply_max_tokens
    if budget is None:
        budget = base.settings.serve.reply_max_tokens
    try:
        ServeSettings(reply_max_tokens=budget)
    except ValidationError as exc:
        raise ConfigError(
            f"reply_max_tokens={budget}: {exc.errors()[0]['msg']}",
            hint="set {reply_max_tokens} from 2000 to 240000 (the default is 20000)",
        ) from exc
    server_limits = dataclasses.replace(server_limits, reply_max_tokens=budget)
    runner = _Runner(
        base=base,
        limits=server_limits,
        pool=base.pool,
        slots=anyio.Semaphore(server_limits.max_concurrent),
        sandbox_options=options,
    )
    if base.policy is not None:
        runner.by_profile[base.policy.profile] = base
    server = MCPServer(
        name="codecage",
        version=__version__,
        instructions=INSTRUCTIONS,
        log_level="WARNING",  # the SDK's rich INFO handler would cost ~1 ms per run's log line
        tools=_tools(runner),
    )
    log.info(
        "server.start",
        extra={
            "backend": base.backend.name,
            "profile": base.settings.profile,
            "pool": base.pool is not None,
            "default_limits": base.limits.model_dump(mode="json"),
            "max_timeout": server_limits.max_timeout,
            "max_memory_mb": server_limits.max_memory_mb,
            "max_concurrent": server_limits.max_concurrent,
            "max_queued": server_limits.max_queued,
            "reply_max_tokens": server_limits.reply_max_tokens,
            "tool_servers": sorted(base.tools.servers) if base.tools is not None else [],
            "config_file": str(base.settings.config_file) if base.settings.config_file else None,
            "config_origin": base.settings.config_origin,
            "scrub": base.scrub_settings.enabled,
        },
    )
    return server


def _imports_note(sandbox: Sandbox) -> str:
    """What the code may import by default, as the model must know it before it writes."""
    policy = sandbox.policy
    if policy is None or policy.allows_every_module:
        return (
            "The whole standard library and the installed data packages (numpy, pandas, "
            "matplotlib, ...) can be imported."
        )
    return (
        f"Imports outside the profile {policy.profile!r} are refused (allowed_imports or "
        "another profile widens it; get_sandbox_info lists the profiles)."
    )


def _tools_note(sandbox: Sandbox) -> str:
    """What the model must know to call upstream MCP tools from its code (--mcp-config)."""
    if sandbox.tools is None:
        return ""
    servers = ", ".join(sorted(sandbox.tools.servers)) or "none"
    return (
        f" The code can call the tools of these MCP servers: {servers}. Each tool is a typed "
        "module: `from servers.<server> import <tool>` then `await <tool>.call(arg=...)` "
        "(its docstring lists the arguments); find tools with `from codecage.runtime import "
        "search_tools; search_tools('what you need')`. Call many tools in one program and "
        "return only what matters; a failed call raises codecage.runtime.ToolCallError."
    )


# The tools' hints for clients (MCP ToolAnnotations), true of this server: a run touches
# nothing outside its throwaway sandbox, so nothing of the caller's is destroyed, but each
# run is new (not idempotent: the code may be random or time-dependent) and, with upstream
# tools configured, the code may reach the world through them.
def _annotations(title: str, *, read_only: bool, open_world: bool) -> ToolAnnotations:
    return ToolAnnotations(
        title=title,
        read_only_hint=read_only,
        destructive_hint=False,
        idempotent_hint=read_only,
        open_world_hint=open_world,
    )


class SandboxInfoReply(BaseModel):
    """The structured content of get_sandbox_info (no host paths in it)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    backend: str = Field(description="The isolation backend runs use.")
    isolation: str = Field(description="The isolation layers in force, in one line.")
    default_limits: dict[str, Any] = Field(description="Limits of a run that asks for none.")
    call_maximums: dict[str, Any] = Field(description="The most a call may ask for.")
    profiles: list[str] = Field(description="Import profiles a call may pick.")
    default_profile: str = Field(description="The profile of a call that names none.")
    tools: list[str] = Field(description="This server's tools.")
    tool_servers: list[str] = Field(description="Upstream MCP servers the code may call.")
    reply_max_tokens: int = Field(description="Estimated tokens a reply takes at most.")
    detail: dict[str, Any] | None = Field(
        None, description="With detail=true: modules per profile, layers, pool, scrub, tools."
    )


def _tools(runner: _Runner) -> list[Tool]:
    limits = runner.limits
    budget = limits.reply_max_tokens or DEFAULT_REPLY_MAX_TOKENS
    default = runner.base.limits
    tools: list[Tool] = []
    tool = _registrar(tools)
    upstream = runner.base.tools is not None

    @tool(
        description=(
            "Run Python 3.11 code in a fresh isolated sandbox and return what happened: "
            "stdout, stderr, the value of the last expression and the traceback in the text; "
            "status (ok, error, timeout, memory_limit, cpu_limit, killed), exit code, files "
            "written to /workspace and resource usage in the structured content. No network. "
            + _imports_note(runner.base)
            + " A POSIX shell and common tools are there for subprocess. Top-level await works. "
            f"Defaults: timeout {default.timeout:g} s (at most {limits.max_timeout:g}), "
            f"memory {default.memory_mb} MiB (at most {limits.max_memory_mb}). "
            "Images the code saves in /workspace (png, jpeg, gif, webp) are returned as "
            "images; ask for an SVG with return_files, as text. "
            f"The reply is kept within about {budget:,} tokens: long output keeps its head "
            "and tail; print summaries, not bulk data." + _tools_note(runner.base)
        ),
        annotations=_annotations("Run Python in a sandbox", read_only=False, open_world=upstream),
    )
    async def execute_code(
        code: Annotated[str, Field(description="Python source to run.")],
        timeout: Annotated[
            float | None, Field(description="Wall-clock limit in seconds.", gt=0)
        ] = None,
        profile: Annotated[
            str | None,
            Field(
                description="Import profile(s): standard (the default: nothing refused), "
                "or a curated one such as basic, data_science, filesystem."
            ),
        ] = None,
        allowed_imports: Annotated[
            list[str] | None, Field(description="Modules to allow on top of the profile.")
        ] = None,
        memory_limit_mb: Annotated[
            int | None, Field(description="Memory limit in MiB.", ge=32)
        ] = None,
        files: Annotated[
            dict[str, str] | None,
            Field(
                description="Input files to put in /workspace: name -> text, or "
                "'base64:' + base64 data for binary files."
            ),
        ] = None,
        return_files: Annotated[
            list[str] | None,
            Field(
                description="Text files (paths in /workspace) to return inline, up to "
                f"{MAX_RETURN_FILES} files of {MAX_INLINE_FILE_BYTES // 1024} KiB each; "
                "they count towards the reply's size (a long one keeps head and tail).",
                max_length=MAX_RETURN_FILES,
            ),
        ] = None,
    ) -> Annotated[CallToolResult, reply.ExecutionReply]:
        run_limits = _call_limits(runner, timeout, memory_limit_mb)
        uploads = _decode_uploads(files or {})
        sandbox = _sandbox(runner, profile, allowed_imports)
        cancel = threading.Event()
        result, extra = await _queued(
            runner,
            lambda: _execute(sandbox, code, run_limits, uploads, return_files or [], cancel),
            cancel,
        )
        return reply.build(result, extra, budget)

    @tool(
        description=(
            "Check Python code without running it: syntax, imports outside the profile, "
            "and risky constructs. Returns valid, the findings (line, rule, severity, "
            "message) and a one-line verdict."
        ),
        annotations=_annotations("Check Python code", read_only=True, open_world=False),
    )
    def validate_code(
        code: Annotated[str, Field(description="Python source to check.")],
        profile: Annotated[str | None, Field(description="Import profile(s).")] = None,
    ) -> Annotated[CallToolResult, ValidationReport]:
        sandbox = _sandbox(runner, profile, None)
        report = sandbox.validate(code)
        return reply.for_data(_validation_text(report), report.model_dump(mode="json"), budget)

    @tool(
        description=(
            "What this sandbox offers, in short: backend, isolation in force, default "
            "limits and the most a call may ask for, profiles, tools. detail=true adds the "
            "modules of each profile, every isolation layer, the warm pool, scrubbing and "
            "the bounds of upstream tool calls."
        ),
        annotations=_annotations("Describe the sandbox", read_only=True, open_world=False),
    )
    def get_sandbox_info(
        detail: Annotated[
            bool, Field(description="Add the modules per profile, layers, pool, scrub, tools.")
        ] = False,
    ) -> Annotated[CallToolResult, SandboxInfoReply]:
        info = runner.base.info()
        data = _short_info(runner, info, [t.name for t in tools], budget)
        if not detail:
            return reply.for_data(_info_text(data), data, budget)
        data["detail"] = _info_detail(info)
        text = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
        return reply.for_data(text, data, budget)

    return tools


def _short_info(runner: _Runner, info: HostInfo, tools: list[str], budget: int) -> dict[str, Any]:
    limits = runner.limits
    active = [layer.name for layer in info.layers if layer.active]
    missing = [layer.name for layer in info.layers if not layer.active]
    isolation = "in force: " + ", ".join(active)
    if "network" in active:
        isolation += " (no network)"
    if missing:
        isolation += "; missing: " + ", ".join(missing)
    defaults = info.default_limits
    return SandboxInfoReply(
        backend=info.backend,
        isolation=isolation,
        default_limits={
            "timeout": defaults.timeout,
            "memory_limit_mb": defaults.memory_mb,
            "cpu_seconds": defaults.cpu_seconds,
            "max_processes": defaults.max_processes,
            "workspace_mb": defaults.workspace_mb,
            "max_output_bytes": defaults.max_output_bytes,
        },
        call_maximums={"timeout": limits.max_timeout, "memory_limit_mb": limits.max_memory_mb},
        profiles=[p.name for p in info.profiles],
        default_profile=runner.base.settings.profile,
        tools=tools,
        tool_servers=info.tools.servers if info.tools is not None else [],
        reply_max_tokens=budget,
    ).model_dump(mode="json", exclude_none=True)


def _info_text(data: dict[str, Any]) -> str:
    limits = data["default_limits"]
    maximums = data["call_maximums"]
    profiles = [
        p + (" (default)" if p == data["default_profile"] else "") for p in data["profiles"]
    ]
    return "\n".join(
        [
            f"backend: {data['backend']}",
            f"isolation: {data['isolation']}",
            f"default limits: timeout {limits['timeout']:g} s (at most {maximums['timeout']:g}), "
            f"memory_limit_mb {limits['memory_limit_mb']} (at most {maximums['memory_limit_mb']}), "
            f"cpu {limits['cpu_seconds']} s, {limits['max_processes']} processes, "
            f"workspace {limits['workspace_mb']} MiB, output {limits['max_output_bytes']:,} "
            "bytes per stream (head and tail kept)",
            "profiles: " + ", ".join(profiles),
            "tools: " + ", ".join(data["tools"]),
            "upstream MCP servers the code may call: "
            + (", ".join(data["tool_servers"]) or "none"),
            f"replies: at most about {data['reply_max_tokens']:,} tokens",
            "get_sandbox_info with detail=true lists each profile's modules and every layer.",
        ]
    )


def _info_detail(info: HostInfo) -> dict[str, Any]:
    """Everything `codecage info` says that a model may use, without the host's paths
    (the interpreter, the config file, the tool trees, where settings came from)."""
    data = info.model_dump(
        mode="json", exclude={"python", "config_file", "backends", "default_limits"}
    )
    data["limit_sources"] = {
        name: "config file" if source.startswith("file ") else source
        for name, source in info.limit_sources.items()
    }
    if data.get("tools"):
        for key in ("servers_dir", "skills_dir"):
            data["tools"][key] = "/" + key.removesuffix("_dir") if data["tools"][key] else None
    return cast(dict[str, Any], reply.without_host_paths(data))


def _validation_text(report: ValidationReport) -> str:
    lines = [report.message]
    lines += [
        f"line {f.line}: {f.rule_id} ({f.severity}) {neutralise_line(f.message)}"
        for f in report.findings[:50]
    ]
    more = len(report.findings) - 50 + report.omitted_findings
    if more > 0:
        lines.append(f"… and {more} more findings")
    return "\n".join(lines)


# --- the tools' wrapper: argument errors, unknown arguments, one log line per call ----------

_F = TypeVar("_F", bound=Callable[..., Any])
_MAX_ARGUMENT_ERRORS = 10
_SHOWN_VALUE_CHARS = 60


@dataclass(slots=True)
class _CallLog:
    """What the per-call log line reports that only the tool's body knows."""

    queue_ms: float = 0.0


_current_call: ContextVar[_CallLog | None] = ContextVar("codecage_server_call", default=None)


class _CheckedTool(Tool):
    """A tool whose argument errors read well, and whose every call is logged.

    The SDK reports a pydantic ValidationError as "Error executing tool X: 1 validation error
    for XArguments ..." (pydantic's multi-line dump); here it becomes one line per bad field.
    """

    async def run(
        self, arguments: dict[str, Any], context: Context[Any, Any], convert_result: bool = False
    ) -> Any:
        call = _CallLog()
        token = _current_call.set(call)
        started = time.monotonic()
        status, execution_id = "failed", None
        try:
            result = await super().run(arguments, context, convert_result=convert_result)
        except UnexpectedToolError:
            raise  # a crash: the SDK logs it with its traceback, and tells the caller nothing
        except ToolError as exc:
            status = "refused"
            if isinstance(exc.__cause__, ValidationError):
                # From the cause, so that the SDK still logs the field names (not the values).
                accepted = list(self.parameters.get("properties", {}))
                message = _argument_errors(self.name, accepted, exc.__cause__)
                raise ToolError(message) from exc.__cause__
            raise
        except BaseException as exc:
            status = "cancelled" if isinstance(exc, anyio.get_cancelled_exc_class()) else "failed"
            raise
        else:
            status, execution_id = _outcome(result)
            return result
        finally:
            _current_call.reset(token)
            log.info(
                "server.call",
                extra={
                    "tool": self.name,
                    "status": status,
                    "wall_ms": round((time.monotonic() - started) * 1000, 2),
                    "queue_ms": round(call.queue_ms, 2),
                    "execution_id": execution_id,
                },
            )


def _registrar(tools: list[Tool]) -> Callable[..., Callable[[_F], _F]]:
    """A decorator like `MCPServer.tool(description=...)` that adds a `_CheckedTool` to
    `tools` (for `MCPServer(tools=...)`)."""

    def register(*, description: str, annotations: ToolAnnotations) -> Callable[[_F], _F]:
        def add(fn: _F) -> _F:
            checked = _CheckedTool.from_function(
                fn, title=annotations.title, description=description, annotations=annotations
            )
            tools.append(_refusing_unknown_arguments(checked))
            return fn

        return add

    return register


def _refusing_unknown_arguments(tool: Tool) -> Tool:
    """Make `tool` refuse arguments it does not take (a typo such as `timout` must not run
    with the default silently), and say so in its input schema (additionalProperties: false).

    The SDK's argument model ignores unknown keys (pydantic's default) and has no option for
    it; FuncMetadata reads its public `arg_model` at each call (its docstring says reassigning
    it takes effect), so a subclass that forbids extras replaces it, and the published schema
    is regenerated from that subclass.
    """
    loose = tool.fn_metadata.arg_model
    strict = cast(
        type[ArgModelBase],
        type(
            loose.__name__,
            (loose,),
            {"model_config": ConfigDict(extra="forbid"), "__module__": loose.__module__},
        ),
    )
    tool.fn_metadata.arg_model = strict
    tool.parameters = strict.model_json_schema(by_alias=True)
    return tool


def _outcome(result: Any) -> tuple[str, str | None]:
    """The status and execution id a tool's result reports, for the log line."""
    if not isinstance(result, CallToolResult):
        return "ok", None
    if result.is_error:
        return "error", None
    content = result.structured_content or {}
    status, execution_id = content.get("status"), content.get("execution_id")
    return (
        status if isinstance(status, str) else "ok",
        execution_id if isinstance(execution_id, str) else None,
    )


def _argument_errors(tool: str, accepted: list[str], exc: ValidationError) -> str:
    """One line per bad argument, for a model to read and fix: `timeout: must be greater
    than 0 (got -1)`; an unknown argument lists the ones the tool takes."""
    lines = [f"Invalid arguments for {tool} (nothing ran):"]
    errors = exc.errors(include_url=False)
    for error in errors[:_MAX_ARGUMENT_ERRORS]:
        where = _argument_path(error["loc"])
        kind = error["type"]
        if kind == "extra_forbidden":
            takes = ", ".join(accepted) if accepted else "no arguments"
            lines.append(f"{where}: not an argument of {tool}; it takes {takes}")
        elif kind == "missing":
            lines.append(f"{where}: required, but not given")
        else:
            lines.append(f"{where}: {_plain(error['msg'])} (got {_shown(error['input'])})")
    if len(errors) > _MAX_ARGUMENT_ERRORS:
        lines.append(f"… and {len(errors) - _MAX_ARGUMENT_ERRORS} more")
    return "\n".join(lines)


def _argument_path(loc: tuple[int | str, ...]) -> str:
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        else:
            path += f".{part}" if path else str(part)
    return neutralise_text(path) or "arguments"


def _plain(message: str) -> str:
    """pydantic's "Input should be greater than 0" as "must be greater than 0"."""
    for prefix, replacement in (("Input should be ", "must be "), ("Value error, ", "")):
        if message.startswith(prefix):
            return replacement + message[len(prefix) :]
    return message[:1].lower() + message[1:]


def _shown(value: Any) -> str:
    """The rejected value as JSON, bounded (it may be megabytes of code)."""
    long = isinstance(value, str) and len(value) > _SHOWN_VALUE_CHARS
    text = json.dumps(value[:_SHOWN_VALUE_CHARS] if long else value, default=repr)
    return text[:_SHOWN_VALUE_CHARS] + "…" if long or len(text) > _SHOWN_VALUE_CHARS else text


# --- argument checks ----------------------------------------------------------------------


def _call_limits(runner: _Runner, timeout: float | None, memory_mb: int | None) -> Limits:
    limits = runner.limits
    if timeout is not None and timeout > limits.max_timeout:
        raise ToolError(
            f"timeout={timeout:g} is above this server's maximum of {limits.max_timeout:g} s; "
            "ask for less, or split the work"
        )
    if memory_mb is not None and memory_mb > limits.max_memory_mb:
        raise ToolError(
            f"memory_limit_mb={memory_mb} is above this server's maximum of "
            f"{limits.max_memory_mb} MiB"
        )
    overrides: dict[str, Any] = {}
    if timeout is not None:
        overrides["timeout"] = timeout
    if memory_mb is not None:
        overrides["memory_mb"] = memory_mb
    try:
        return runner.base.limits.merged(overrides)
    except ValueError as exc:
        raise ToolError(f"invalid limits: {exc}") from exc


def _refusal(exc: CodecageError) -> str:
    """A refusal as the model reads it: what happened, and what to do in this tool's terms
    (its argument names; "ask the operator" for settings no argument reaches)."""
    hint = exc.hint_for("mcp")
    return f"{exc} ({hint})" if hint else str(exc)


def _sandbox(runner: _Runner, profile: str | None, allowed_imports: list[str] | None) -> Sandbox:
    try:
        return runner.sandbox_for(profile, allowed_imports)
    except ConfigError as exc:
        raise ToolError(_refusal(exc)) from exc


def _decode_uploads(files: Mapping[str, str]) -> dict[str, bytes]:
    if len(files) > MAX_UPLOAD_FILES:
        raise ToolError(f"too many files: {len(files)} (at most {MAX_UPLOAD_FILES})")
    decoded: dict[str, bytes] = {}
    for name, value in files.items():
        _check_upload_name(name)
        if value.startswith("base64:"):
            try:
                decoded[name] = base64.b64decode(value[len("base64:") :], validate=True)
            except (binascii.Error, ValueError) as exc:
                raise ToolError(f"file {name!r}: not valid base64 after 'base64:'") from exc
        else:
            decoded[name] = value.encode("utf-8", "surrogatepass")
    total = sum(len(data) for data in decoded.values())
    if total > MAX_UPLOAD_BYTES:
        raise ToolError(
            f"the files are {total} bytes together; at most {MAX_UPLOAD_BYTES} are accepted"
        )
    return decoded


def _check_upload_name(name: str) -> None:
    parts = name.split("/")
    if (
        not name
        or name.startswith("/")
        or any(p in ("", ".", "..") for p in parts)
        or "\x00" in name
        or len(name) > 255
    ):
        raise ToolError(
            f"bad file name {neutralise_text(name)!r}: use a relative path inside /workspace, "
            "such as data.csv or input/data.csv"
        )


# --- running ------------------------------------------------------------------------------


async def _queued(runner: _Runner, job: Any, cancel: threading.Event) -> Any:
    """Run `job` in a worker thread once a slot is free; refuse when too many wait. When the
    call is cancelled (its client went away), `cancel` is set: the job kills its sandbox.
    (The counter is only touched on the event loop's thread.)"""
    if runner.waiting >= runner.limits.max_queued:
        raise ToolError(
            f"the server is busy: {runner.waiting} executions are waiting already; "
            "try again shortly"
        )
    runner.waiting += 1
    waiting_since = time.monotonic()
    try:
        await runner.slots.acquire()
    finally:
        runner.waiting -= 1
        if (call := _current_call.get()) is not None:
            call.queue_ms = (time.monotonic() - waiting_since) * 1000
    try:
        return await anyio.to_thread.run_sync(job, abandon_on_cancel=True)
    except anyio.get_cancelled_exc_class():
        cancel.set()
        raise
    finally:
        runner.slots.release()


def _execute(
    sandbox: Sandbox,
    code: str,
    limits: Limits,
    uploads: dict[str, bytes],
    return_files: list[str],
    cancel: threading.Event,
) -> tuple[ExecutionResult, list[ContentBlock]]:
    """One run. Uploads go into the run's fresh workspace (its tmpfs, bounded by
    workspace_mb, removed with it) before the code runs. Images and the asked-for files are
    read from the workspace after the run, before it is removed (a warm sandbox's
    workspace too). Raises ToolError for what the caller must fix."""
    blocks: list[ContentBlock] = []
    redacted: list[dict[str, int]] = []

    def read_back(workspace: Path, written: list[FileInfo]) -> None:
        found, counts = _files_back(workspace, written, return_files, sandbox.scrubber)
        blocks.extend(found)
        redacted.append(counts)

    def counted(result: ExecutionResult) -> ExecutionResult:
        if not any(redacted):
            return result
        # model_copy keeps the private raw output (the CLI's --raw reads it)
        return result.model_copy(update={"redactions": merge_counts(result.redactions, *redacted)})

    try:
        result = sandbox.run(
            code, limits=limits, cancel=cancel, on_files=read_back, files=uploads or None
        )
        return counted(result), blocks
    except CodecageError as exc:
        raise ToolError(_refusal(exc)) from exc


def _files_back(
    workdir: Path, written: list[FileInfo], return_files: list[str], scrubber: Scrubber | None
) -> tuple[list[ContentBlock], dict[str, int]]:
    """Raster images the code wrote, and the text files asked for, scrubbed like the rest of
    the result (images cannot be: a picture of a card number leaves as it is).

    Files are read by their names as on disk (`FileInfo.raw_path`): a name with an escape
    sequence, a line break or an undecodable byte is listed neutralised, and a path asked
    for as the listing shows it is read under its real name. When two files show as the
    same name (their names differ only in characters shown as escapes, e.g. ESC and a
    literal backslash-x1b), asking for it is refused with a message, never guessed."""
    blocks: list[ContentBlock] = []
    counts: list[dict[str, int]] = []
    images = [f for f in written if f.mime in _IMAGE_TYPES and f.size <= MAX_IMAGE_BYTES]
    for info in images[:MAX_IMAGES]:
        with contextlib.suppress(CodecageError):
            data = workspaces.read_file(workdir, info.raw_path(), max_bytes=MAX_IMAGE_BYTES)
            mime = _raster_type(data)
            if mime is not None:
                encoded = base64.b64encode(data).decode("ascii")
                blocks.append(ImageContent(type="image", data=encoded, mime_type=mime))
    on_disk: dict[str, list[str]] = {}
    for info in written:
        on_disk.setdefault(info.path, []).append(info.raw_path())
    for asked in return_files:
        shown = neutralise_line(asked)
        names = on_disk.get(asked, [asked])
        if len(names) > 1:
            blocks.append(
                TextContent(
                    type="text",
                    text=f"{shown}: {len(names)} files are listed under this name (their "
                    "names differ only in characters shown as escapes); rename them in the "
                    "code to read them",
                )
            )
            continue
        try:
            data = workspaces.read_file(workdir, names[0], max_bytes=MAX_INLINE_FILE_BYTES)
        except CodecageError as exc:
            blocks.append(TextContent(type="text", text=f"{shown}: {exc}"))
            continue
        text = data.decode("utf-8", "replace")
        if scrubber is not None:
            scrubbed = scrubber.scrub(text)  # whole: a larger file is refused, not cut
            text = scrubbed.text
            counts.append(scrubbed.counts)
        blocks.append(TextContent(type="text", text=f"--- {shown} ---\n{neutralise_text(text)}"))
    return blocks, merge_counts(*counts)


def _raster_type(data: bytes) -> str | None:
    """The MIME type of a PNG, JPEG, GIF or WebP image by its first bytes; None otherwise
    (whatever the file's name says)."""
    for magic, mime in _RASTER_MAGIC:
        if data.startswith(magic):
            return mime
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    return None


# --- HTTP -----------------------------------------------------------------------------------

LOOPBACK_HOSTS = frozenset({"127.0.0.1", "::1", "localhost"})


def http_app(
    server: MCPServer, *, host: str, token: str | None, insecure_no_token: bool = False
) -> Any:
    """The streamable HTTP app at /mcp (DNS-rebinding protection from the SDK), behind
    `http_serving.RequestGate`: the bearer token checked before any body is read, and
    bounded bodies. Sessions are capped (the idle longest is closed for a new one).

    A token is required: on loopback too, any local user could otherwise run code, and call
    the upstream tools with the operator's credentials. `insecure_no_token` (the CLI's
    `--insecure-no-token`) waives it on loopback only.

    Raises:
        ConfigError: no token, and not waived (or not on loopback).
    """
    if not token:
        if host not in LOOPBACK_HOSTS:
            raise ConfigError(
                f"refusing to serve on {host} without a token: anyone who reaches it could "
                "run code here",
                hint="pass --token (or set CODECAGE_TOKEN), or bind 127.0.0.1",
            )
        if not insecure_no_token:
            raise ConfigError(
                "refusing to serve HTTP without a token: every local user of this machine "
                "could run code and call the upstream tools with your credentials",
                hint='pass --token "$(openssl rand -hex 16)" (or set CODECAGE_TOKEN) and send '
                "'Authorization: Bearer <token>'; or --insecure-no-token to accept the risk",
            )
        log.warning("server.http_without_token", extra={"host": host})
    app = server.streamable_http_app(
        host=host,
        max_request_body_size=MAX_HTTP_BODY_BYTES,
        max_sessions=http_serving.MAX_SESSIONS,
        session_idle_timeout=http_serving.SESSION_IDLE_TIMEOUT,
    )
    http_serving.evict_idle_sessions_at_cap(server.session_manager)
    return http_serving.RequestGate(app, token=token, max_body_bytes=MAX_HTTP_BODY_BYTES)
