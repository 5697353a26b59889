"""The server's tools: `execute_code`, `validate_code`, `get_sandbox_info` (and the session
tools of mcp/sessions.py), their
descriptions (true of this server: its profile, limits, upstream tools) and their replies.

Every failure that is the *caller's* (bad arguments, limits above the server's maximums, a
full queue) is a `ToolError`, whose message reaches the model; the *code's* failures
(exceptions, timeouts, refused imports) are normal results with a status, because the model
must read them to fix its code.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from typing import Annotated, Any, cast

from mcp.server.mcpserver import Context
from mcp.server.mcpserver.exceptions import ToolError
from mcp.server.mcpserver.tools import Tool
from mcp_types import CallToolResult, InputRequiredResult, ToolAnnotations
from pydantic import BaseModel, ConfigDict, Field

from codecage import host
from codecage.host import Host
from codecage.isolation import datadir
from codecage.mcp import approval, callers, progress, reply, sessions
from codecage.mcp.arguments import registrar
from codecage.mcp.files import (
    MAX_BINARY_FILE_BYTES,
    MAX_INLINE_FILE_BYTES,
    MAX_RETURN_FILES,
    decode_uploads,
)
from codecage.mcp.runner import Runner
from codecage.models import DEFAULT_REPLY_MAX_TOKENS, HostInfo, ValidationReport
from codecage.output import neutralise_line


def tools(runner: Runner) -> list[Tool]:
    """The tools, bound to `runner` (for `MCPServer(tools=...)`)."""
    limits = runner.limits
    budget = limits.reply_max_tokens or DEFAULT_REPLY_MAX_TOKENS
    default = runner.host.limits
    made: list[Tool] = []
    tool = registrar(made)
    clients = sessions.Clients()
    questions = approval.Questions()
    backends = runner.host.call_backends
    backend_help = (
        f"Isolation backend: {backends[0]} (the default)"
        + (f", or {', '.join(backends[1:])}" if len(backends) > 1 else ", the only one enabled")
        + ". gvisor (a user-space kernel) isolates more and starts slower."
    )
    hosts_help = _allow_hosts_help(runner.host)

    @tool(
        description=(
            "Run Python 3.11 code in a fresh sandbox. The text holds stdout, stderr, the last "
            "expression's value and the traceback; the structured content the status, exit "
            "code, files in /workspace and usage. "
            + _network_note(runner.host)
            + _imports_note(runner.host)
            + " A POSIX shell and common tools work through subprocess; top-level await works. "
            f"Defaults: timeout {default.timeout:g} s (at most {limits.max_timeout:g}), "
            f"memory {default.memory_mb} MiB (at most {limits.max_memory_mb}). "
            "PNG, JPEG, GIF and WebP files the code saves come back as images (an SVG as "
            f"text, with return_files). The reply stays within about {budget:,} tokens: long "
            "output keeps its head and tail, so print summaries."
            + _data_note(runner.host)
            + _tools_note(runner.host)
        ),
        annotations=_annotations(
            "Run Python in a sandbox", read_only=False, open_world=_reaches_world(runner.host)
        ),
    )
    async def execute_code(
        ctx: Context[Any, Any],
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
                description=f"Files in /workspace to return, at most {MAX_RETURN_FILES}: "
                f"text inline ({MAX_INLINE_FILE_BYTES // 1024} KiB each, head and tail "
                "kept), binary (xlsx, zip, ...) as base64 resources "
                f"({MAX_BINARY_FILE_BYTES // 1024} KiB each). Within the reply's budget: the "
                "largest binaries are left out first, and the reply says so.",
                max_length=MAX_RETURN_FILES,
            ),
        ] = None,
        # A default, not an annotation: annotations are evaluated later, without this scope.
        backend: str | None = Field(None, description=backend_help, max_length=32),
        session_id: str | None = Field(
            None,
            description="Run in this session (from open_session): what earlier runs in it "
            "defined is there; its memory, profile, imports and hosts are the session's.",
            max_length=64,
        ),
        # A Field default for the same reason as backend's; never mutated (pydantic copies).
        allow_hosts: list[str] | None = Field(  # noqa: B008
            None, description=hosts_help, max_length=64
        ),
    ) -> Annotated[CallToolResult, reply.ExecutionReply]:
        uploads = decode_uploads(files or {})
        cancel = threading.Event()
        client = clients.key(ctx)
        caller = callers.caller_of(ctx)
        named = runner.named_client(caller)  # an HTTP client of [serve.clients]: its bounds
        bounded_timeout, bounded_memory = runner.within_client(named, timeout, memory_limit_mb)
        if session_id is not None:
            _refuse_session_arguments(
                profile=profile,
                allowed_imports=allowed_imports,
                memory_limit_mb=memory_limit_mb,
                backend=backend,
                allow_hosts=allow_hosts,
            )
            run_limits = runner.session_limits(session_id, client, bounded_timeout)
            policy, egress = None, None
        else:
            run_limits = runner.call_limits(bounded_timeout, bounded_memory)
            egress, policy = runner.network_for(
                runner.policy_for(profile, allowed_imports), allow_hosts
            )

        # [approval]: the client's user decides before the call takes a run slot.
        asked = host.Request(
            host.Program(code, files=uploads or None),
            limits=run_limits,
            policy=policy,
            egress=egress,
            allowed_tools=runner.host.options.allowed_tools,
            backend=backend,
            session_id=session_id,
            # face "mcp": hints name execute_code's arguments
            asker=host.Asker(face="mcp", caller=caller, client=client),
            hooks=host.Hooks(cancel=cancel),
        )
        decided = await approval.verdict(ctx, runner.host, asked, questions)
        if isinstance(decided, InputRequiredResult):
            # The question (2026-07-28+): the SDK passes it through; the client retries.
            return cast(CallToolResult, decided)

        async def run(on_output: progress.OutputHandler | None) -> Any:
            return await runner.queued(
                lambda: runner.execute(
                    dataclasses.replace(
                        asked,
                        hooks=dataclasses.replace(asked.hooks, on_output=on_output),
                        # the verdict the tool obtained ([approval])
                        asker=dataclasses.replace(asked.asker, approve=approval.given(decided)),
                    ),
                    return_files=return_files or [],
                ),
                cancel,
            )

        runner.admit(named)  # its rate and concurrent runs count from here (queued too)
        try:
            # With a progressToken: progress and log notifications while it runs.
            result, extra = await progress.reporting(ctx, run)
        finally:
            runner.release(named)
        built = reply.build(result, extra, budget)
        runner.note_trimmed(result.execution_id, built)
        return built

    sessions.register(tool, runner, clients, budget)

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
        report = runner.host.validate(code, runner.policy_for(profile, None))
        return reply.for_data(_validation_text(report), report.model_dump(mode="json"), budget)

    @tool(
        description=(
            "What this sandbox offers: backend, isolation in force, default limits and the "
            "most a call may ask for, profiles, network, tools. detail=true adds each "
            "profile's modules, every isolation layer, the pool, scrubbing and tool bounds."
        ),
        annotations=_annotations("Describe the sandbox", read_only=True, open_world=False),
    )
    def get_sandbox_info(
        detail: Annotated[
            bool, Field(description="Add the modules per profile, layers, pool, scrub, tools.")
        ] = False,
    ) -> Annotated[CallToolResult, SandboxInfoReply]:
        info = runner.host.info()
        data = _short_info(runner, info, [t.name for t in made], budget)
        if not detail:
            return reply.for_data(_info_text(data), data, budget)
        data["detail"] = _info_detail(info)
        text = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
        return reply.for_data(text, data, budget)

    return made


def _refuse_session_arguments(**given: Any) -> None:
    """What a session fixes when it is opened cannot be asked again for one of its runs.

    Raises:
        ToolError: one was given, naming where it belongs.
    """
    named = [name for name, value in given.items() if value is not None]
    if named:
        raise ToolError(
            f"{', '.join(named)} cannot be given with session_id: a session's memory, "
            "profile, imports, backend and network are set by open_session. Leave them out, "
            "or open another session with the values you need"
        )


def _server_profile(runtime: Host) -> str:
    """The import profile of a call that names none: the operator's policy, else the file's."""
    policy = runtime.options.policy
    return policy.profile if policy is not None else runtime.settings.profile


def _reaches_world(runtime: Host) -> bool:
    """Whether a run may reach beyond the sandbox: through upstream tools, or through a host
    this server lets a call (or a profile) allow. MCP's openWorldHint says exactly that."""
    grants = runtime.grants
    by_profile = any(rules for rules in (grants.profiles or {}).values())
    return (
        runtime.tools is not None or bool(grants.ceiling_of(_server_profile(runtime))) or by_profile
    )


def _network_note(runtime: Host) -> str:
    """Whether the code has network, and what a call may ask for: the model must know
    before it writes code that fetches something."""
    grants = runtime.grants
    profile = _server_profile(runtime)
    defaults = ", ".join(r.text for r in grants.defaults(profile))
    ceiling = ", ".join(r.text for r in grants.ceiling_of(profile))
    if not ceiling:
        return "No network: this server allows no host. "
    given = f"Every run may reach {defaults}; " if defaults else "No network by default; "
    return (
        f"{given}a call may ask for hosts within {ceiling} with allow_hosts (urllib, "
        "requests and httpx work as usual; others are refused). "
    )


def _allow_hosts_help(runtime: Host) -> str:
    """execute_code's `allow_hosts`: the rule's form, and what this server permits."""
    grants = runtime.grants
    profile = _server_profile(runtime)
    ceiling = ", ".join(r.text for r in grants.ceiling_of(profile)) or "none: no host"
    extra = sorted(n for n, rules in (grants.profiles or {}).items() if rules)
    by_profile = f" (the profiles {', '.join(extra)} add their own hosts)" if extra else ""
    return (
        "Hosts this run may reach, as HOST[:PORT]: api.example.com, *.example.com (its "
        "subdomains), api.example.com:8443 (443 and 80 if omitted), within what this "
        f"server permits: {ceiling}{by_profile}. Asking for more is an error."
    )


def _imports_note(runtime: Host) -> str:
    """What the code may import by default, as the model must know it before it writes."""
    policy = runtime.options.policy
    if policy is None or policy.allows_every_module:
        return (
            "The whole standard library and the installed data packages (numpy, pandas, "
            "matplotlib, ...) can be imported."
        )
    return (
        f"Imports outside the profile {policy.profile!r} are refused (allowed_imports or "
        "another profile widens it; get_sandbox_info lists the profiles)."
    )


def _tools_note(runtime: Host) -> str:
    """What the model must know to call upstream MCP tools from its code (--mcp-config)."""
    if runtime.tools is None:
        return ""
    servers = ", ".join(sorted(runtime.tools.servers)) or "none"
    return (
        f" Code can call the tools of MCP servers {servers}: `from servers.<server> "
        "import <tool>`, then `await <tool>.call(arg=...)` (see its docstring); "
        "`from codecage.runtime import search_tools; search_tools('what you "
        "need')` finds them. Call many in one program, return only what matters; a "
        "failed call raises codecage.runtime.ToolCallError."
    )


# The tools' hints for clients (MCP ToolAnnotations), true of this server: a run touches
# nothing outside its throwaway sandbox, so nothing of the caller's is destroyed, but each
# run is new (not idempotent: the code may be random or time-dependent) and, with upstream
# tools or allowed hosts configured, the code may reach the world through them.
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
    data: str | None = Field(
        None,
        description="Where the operator's data directory is, read-only, in every sandbox "
        "(/data); absent when there is none.",
    )
    network: dict[str, Any] = Field(
        description="Hosts every run may reach (allow), what allow_hosts may ask for "
        "(ceiling: a profile adds its own hosts, per profile), and what no run may (deny)."
    )
    detail: dict[str, Any] | None = Field(
        None, description="With detail=true: modules per profile, layers, pool, scrub, tools."
    )


def _data_note(runtime: Host) -> str:
    """Where the operator's data is, when the server was given a data directory."""
    if runtime.data_dir is None:
        return ""
    return (
        f" The operator's data files are in {datadir.DATA_DIR} (read-only): read them "
        "there instead of passing them in `files`."
    )


def _short_info(runner: Runner, info: HostInfo, tools: list[str], budget: int) -> dict[str, Any]:
    limits = runner.limits
    active = [layer.name for layer in info.layers if layer.active]
    missing = [layer.name for layer in info.layers if not layer.active]
    isolation = "in force: " + ", ".join(active)
    if "network" in active:
        reachable = runner.host.grants.ceiling_of(runner.host.settings.profile)
        isolation += " (only allowed hosts, through the proxy)" if reachable else " (no network)"
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
        default_profile=runner.host.settings.profile,
        tools=tools,
        tool_servers=info.tools.servers if info.tools is not None else [],
        reply_max_tokens=budget,
        data=datadir.DATA_DIR if info.data_dir is not None else None,
        network=_network_info(runner.host),
    ).model_dump(mode="json", exclude_none=True)


def _network_info(runtime: Host) -> dict[str, Any]:
    grants = runtime.grants
    profile = _server_profile(runtime)
    return {
        "allow": [r.text for r in grants.defaults(profile)],
        "ceiling": [r.text for r in grants.ceiling_of(profile)],
        "deny": [r.text for r in grants.deny],
        "per_profile": {n: [r.text for r in rules] for n, rules in (grants.profiles or {}).items()},
    }


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
            _network_text(data["network"]),
            f"replies: at most about {data['reply_max_tokens']:,} tokens",
            *(
                [f"data: the operator's files are in {data['data']} (read-only)"]
                if data.get("data")
                else []
            ),
            "get_sandbox_info with detail=true lists each profile's modules and every layer.",
        ]
    )


def _network_text(network: dict[str, Any]) -> str:
    if not network["ceiling"]:
        return "network: none (this server allows no host)"
    line = "network: every run may reach " + (", ".join(network["allow"]) or "no host")
    line += "; execute_code's allow_hosts may ask for " + ", ".join(network["ceiling"])
    if network["deny"]:
        line += "; never " + ", ".join(network["deny"])
    return line


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
    cleaned = cast(dict[str, Any], reply.without_host_paths(data))
    if info.data_dir is not None:
        cleaned["data_dir"] = datadir.DATA_DIR  # where the code sees it, not the host's path
    return cleaned


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
