"""The library API: `Sandbox(...).run(code) -> ExecutionResult`, its async twin, and
`Sandbox(...).session()` for state across runs (`codecage.session`).

A thin facade over the host runtime (`codecage.host.Host`): the constructor loads the
settings once and builds one `Host` with what is host-wide, keeps what is per run (the
import policy, the tools allowed, the face) as the defaults of its calls, and each method
turns its arguments into a typed `host.Request` (or call) for the Host.
"""

from __future__ import annotations

import getpass
import inspect
import logging
import os
import threading
from collections.abc import Awaitable, Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from pydantic import ValidationError

from codecage import batch, config, host
from codecage import kept as kept_files
from codecage.audit import AuditTrail
from codecage.audit import alerts as alerting
from codecage.audit import record as audit_record
from codecage.bridge import channel as bridge
from codecage.bridge import tooling
from codecage.config import Settings
from codecage.engine import workspace as workspaces
from codecage.engine.pool import Pool
from codecage.errors import ConfigError, Face
from codecage.models import (
    AlertSettings,
    DoctorReport,
    ExecutionResult,
    FileInfo,
    HostInfo,
    Limits,
    ScrubSettings,
    ValidationReport,
)
from codecage.policy import approval as approvals
from codecage.policy.profiles import ImportPolicy
from codecage.session import Session, open_session

if TYPE_CHECKING:
    import asyncio

    from codecage.backends.base import Backend
    from codecage.bridge.broker import Broker
    from codecage.policy.scrub import Scrubber

log = logging.getLogger(__name__)

OutputHandler = Callable[[str, str], None]
"""`on_output`: called with the stream ("stdout" or "stderr") and the text that arrived."""


class Sandbox:
    """Runs code in a fresh, isolated sandbox per call.

    >>> from codecage import Sandbox
    >>> result = Sandbox().run("sum(range(10))")
    >>> result.status, result.return_value
    ('ok', 45)

    Args:
        limits: default limits of this Sandbox's runs (each run may override them): a full
            `Limits`, or a dict of fields overriding the configuration's.
        backend: "auto" (the strongest available) or a backend name ("bwrap", "gvisor").
        allow_degraded: run even when the self-test finds a promised layer missing; each
            result then carries a `degraded_isolation` event naming the missing layer.
        profile: capability profile(s) for imports: "standard" (the default unless the
            config names another: the whole standard library and every installed data
            package, nothing refused) or curated ones such as "basic" or
            "data_science,filesystem".
        allowed_imports: modules added to the profile's set (or replacing it, see below).
        replace_imports: `allowed_imports` replaces the profile's set instead of extending it.
        import_policy: False turns the import policy off (the OS layers still hold); the
            installed data packages are importable as under "standard".
        config: a TOML config file; by default the first found (see `codecage.config`:
            $CODECAGE_CONFIG, the user's, the system's; never the current directory).
            Refused unless owned by you or root and not writable by others. Or the
            `Settings` that `codecage.config.load()` returned, to use them as they are.
            Precedence: these arguments > CODECAGE_* variables > the file > built-ins.
        selftest: run the self-test before the first run (cached per boot); turning it off
            is for codecage's own tests of the self-test, not for production.
        pool: run requests in warm, single-use sandboxes started ahead of time (same
            isolation, ~1 ms instead of ~50 ms to start). True: a pool of this Sandbox's
            own, sized by the config's [pool] table; a `Pool`: share that one; False: cold
            starts only; None (default): as the config says (`[pool] enabled`, or
            CODECAGE_POOL). Close the Sandbox (or use it in a `with`) to stop its pool.
        fork_server: fork each sandbox from a warm template of its profile instead of
            starting bwrap and an interpreter anew (same isolation per run: namespaces,
            workspace, cgroup, filter; docs/security-model.md#the-fork-server). None
            (default): as the config says (`[pool] fork_server`, on; CODECAGE_FORK_SERVER).
            Where it cannot be used (not bwrap, not root) sandboxes start anew; `info()`
            says which. Its templates live until the Sandbox is closed.
        tools: a `Broker` holding sessions to upstream MCP servers: the code's tool calls
            (`codecage.runtime.call_tool`, `servers.<server>.<tool>.call`) go to it over the
            sandbox's private bridge (docs/tool-bridge.md). None: tool calls fail clearly.
        allowed_tools: "server.tool" patterns the code may call, split at the first dot and
            matched per half (`*` wildcards match only plain names, see
            `codecage.bridge.tooling`); None: all that the servers' own allow-lists permit.
            Raises ConfigError for a pattern without a dot.
        tool_limits: bounds of each run's tool calls (count, in flight, result size);
            by default 200 calls, 16 at once, 4 MiB per result.
        servers_dir: the tree `codecage gen` wrote, mounted read-only at /servers and
            importable as `servers.<server>.<tool>`.
        skills_dir: a directory of reusable functions, read-only at /skills, importable as
            `skills.<module>`.
        packages_dir: the packages the operator added (`codecage packages add`), bound
            read-only at /opt/packages for profiles that allow them; default: the
            CODECAGE_PACKAGES_DIR variable, the config's `[packages] dir`, else
            /var/lib/codecage/packages (root) or $XDG_DATA_HOME/codecage/packages.
        tokenize: replace personal data (emails, phones, ...) in tool results with tokens
            such as [EMAIL_1] before the code sees them, and put the real values back when
            the code passes the tokens to another tool; the values stay in the host, per
            run. None: as each server's `tokenize` setting says (default off).
        scrub: redact personal data and secrets from everything a run returns (stdout,
            stderr, error, return value, events, file names) in the host, counting them in
            `redactions`. None (default): as the config's [scrub] table says (on unless
            turned off); True/False: on (with the config's categories) or off; a
            `ScrubSettings`: exactly that. The upstream servers' credentials (`tools`) are
            always among the secrets redacted.
        face: who makes the calls, for the wording of hints in results (an import
            refusal says how to allow the module): "library" (default: keyword
            arguments), "cli" (flags) or "mcp" (the execute_code tool's arguments).
        keep_files_mb: MiB of the files a run leaves that its result keeps for
            `result.read_file` / `result.save_files` (all files together; default 64; 0
            keeps none). A file past it is listed in `files` but not kept.
        data_dir: a host directory mounted read-only at /data in every sandbox (absolute,
            an existing directory, not / nor codecage's own state); symlinks in it resolve
            inside the sandbox, never to the host's files.
        allow_hosts: hosts every run of this Sandbox may reach, as HOST[:PORT] rules
            ("api.example.com", "*.example.com", "api.example.com:8443", "203.0.113.7";
            port 443 and 80 when omitted), on top of the config's `[network] allow` and
            the profile's hosts; a run may ask for these and the config's `[network]
            ceiling` with `run(allow_hosts=...)`. Empty (default): no network unless the
            config allows some. Raises ConfigError for a malformed rule or one the
            config's `[network] deny` covers.
        audit: keep a record of every run in the audit trail (docs/audit.md). None
            (default): as the config's `[audit] enabled` says, else on for face "mcp"
            (`codecage serve`) and off otherwise; True: on, in the config's `[audit] store`
            (default: audit.db in codecage's state directory); a path or a
            postgresql:// URL: on, there; False (or "off"): off. Raises AuditError when
            the store cannot be opened.
        approve: how a person approves a run before it starts, when the config's
            `[approval] require` asks for it by what the run is granted (network, tools
            with side effects, a lent workspace, ...; docs/configuration.md): called with
            an `ApprovalRequest` (the code, its sha256, the grants, the static findings as
            advice), returns True to run it; False, an
            exception or no answer within `[approval] timeout` seconds is a denial, and the
            result is `blocked` with an `approval` event. A coroutine function is awaited on
            the caller's loop under `arun`. Required when `[approval] require` is set
            (ConfigError without it).
        alerts: tell a webhook or a command when chosen things happen in runs
            (docs/configuration.md, `[alerts]`): False (default): no alerts; True: as the
            config's `[alerts]` says; an `AlertSettings`: those. Alerts are recorded in the
            audit trail when there is one. Raises ConfigError when there is no hook to send
            to, or the command is not an executable program.

    >>> with Sandbox(pool=True) as sandbox:
    ...     sandbox.warm()                      # optional: wait until the pool is ready
    ...     results = [sandbox.run(f"{i} * 2") for i in range(100)]
    """

    def __init__(
        self,
        *,
        limits: Limits | dict[str, Any] | None = None,
        backend: str = "auto",
        allow_degraded: bool = False,
        selftest: bool = True,
        profile: str | None = None,
        allowed_imports: tuple[str, ...] | list[str] = (),
        replace_imports: bool = False,
        import_policy: bool = True,
        config: str | Path | Settings | None = None,
        pool: bool | Pool | None = None,
        fork_server: bool | None = None,
        tools: Broker | None = None,
        allowed_tools: Iterable[str] | None = None,
        tool_limits: bridge.BridgeLimits | None = None,
        servers_dir: str | Path | None = None,
        skills_dir: str | Path | None = None,
        packages_dir: str | Path | None = None,
        tokenize: bool | None = None,
        scrub: bool | ScrubSettings | None = None,
        face: Face = "library",
        keep_files_mb: int = kept_files.DEFAULT_KEEP_FILES_MB,
        data_dir: str | Path | None = None,
        allow_hosts: Iterable[str] = (),
        audit: bool | str | Path | None = None,
        approve: approvals.Callback | None = None,
        alerts: bool | AlertSettings = False,
    ) -> None:
        settings = config if isinstance(config, Settings) else load_settings(config)
        alert_settings = alerting.chosen(alerts, settings.alerts)
        # How this Sandbox's runs ask a person (the CLI puts its terminal prompt here).
        self.approver = _approver(settings, approve, face)
        self.allowed_tools = tuple(allowed_tools) if allowed_tools is not None else None
        tooling.allow_patterns(self.allowed_tools)  # a malformed one fails here, not in a run
        # Refused before the Host starts a pool that a refusal would leave running.
        self.policy: ImportPolicy | None = (
            host.resolve_policy(settings, profile, allowed_imports, replace_imports)
            if import_policy
            else None
        )
        self.host = runtime = host.Host(
            settings,
            limits=_limits_over(settings.limits, limits) if limits is not None else None,
            backend=backend,
            allow_degraded=allow_degraded,
            selftest=selftest,
            pool=pool,
            fork_server=fork_server,
            tools=tools,
            tool_limits=tool_limits,
            tokenize=tokenize,
            servers_dir=Path(servers_dir).resolve() if servers_dir is not None else None,
            skills_dir=Path(skills_dir).resolve() if skills_dir is not None else None,
            packages_dir=packages_dir,
            scrub=scrub,
            data_dir=data_dir,
            allow_hosts=allow_hosts,
        )
        if isinstance(limits, dict):  # only the fields given are the argument's
            runtime.limit_sources = {
                **settings.sources,
                **{name: "argument" for name, value in limits.items() if value is not None},
            }
        self.settings = settings
        self.caller = audit_record.Caller(
            "cli" if face == "cli" else "library", name=_login_name()
        )  # the MCP server names each call's caller itself
        try:
            runtime.audit = _audit_trail(settings, audit, face, runtime.audit_scrub)
        except BaseException:
            runtime.close()  # its pool is running already
            raise
        self.alerter = alerting.attach(runtime, alert_settings) if alert_settings else None
        self.limit_sources = dict(runtime.limit_sources)
        if profile is not None:
            self.limit_sources["profile"] = "argument"
        self.face: Face = face
        self.keep_files_mb = _check_keep_files_mb(keep_files_mb)
        # Runs with egress import the network modules too and need sandboxes made for
        # egress: keep that kind warm.
        egress, warm_policy = runtime.network_for(self.policy, None, face)
        runtime.keep_warm(warm_policy, egress=egress is not None)

    # What callers read of the host runtime (info, tests, the MCP server's notes): its own
    # values, not copies that could drift from them.

    @property
    def limits(self) -> Limits:
        return self.host.limits

    @property
    def backend(self) -> Backend:
        return self.host.backend

    @property
    def pool(self) -> Pool | None:
        return self.host.pool

    @property
    def tools(self) -> Broker | None:
        return self.host.tools

    @property
    def tool_limits(self) -> bridge.BridgeLimits:
        return self.host.tool_limits

    @property
    def scrub_settings(self) -> ScrubSettings:
        return self.host.scrub_settings

    @property
    def scrubber(self) -> Scrubber | None:
        return self.host.scrubber

    @property
    def servers_dir(self) -> Path | None:
        return self.host.servers_dir

    @property
    def skills_dir(self) -> Path | None:
        return self.host.skills_dir

    @property
    def packages_dir(self) -> Path | None:
        return self.host.packages_dir

    @property
    def tokenize(self) -> bool | None:
        return self.host.tokenize

    def run(
        self,
        code: str,
        *,
        limits: Limits | dict[str, Any] | None = None,
        filename: str = "main.py",
        workspace: str | Path | None = None,
        strict: bool = False,
        cancel: threading.Event | None = None,
        on_files: Callable[[Path, list[FileInfo]], None] | None = None,
        files: Mapping[str, bytes | str] | None = None,
        keep_files_mb: int | None = None,
        on_output: OutputHandler | None = None,
        allow_hosts: Iterable[str] | None = None,
    ) -> ExecutionResult:
        """Run `code` in a new sandbox and return how it went.

        The code's own failure (exception, timeout, limit) is a result, not an exception.

        Args:
            code: Python source; top-level `await` is allowed; the last expression's value
                becomes `return_value`.
            limits: a full `Limits`, or a dict of fields overriding this Sandbox's defaults.
            filename: the name the code runs under (shows in tracebacks).
            workspace: a host directory to mount at /workspace instead of a fresh empty one;
                its files stay after the run. Refused (ConfigError) when it is, holds or lies
                in one of codecage's own places (interpreter, virtualenv, package, state,
                config or packages directory) or a Python installation, and on Landlock.
                What the host would run from it (.git, .bashrc, .venv, *.pth, .vscode, ...)
                stays read-only for the run (`codecage.isolation.lending`).
            cancel: set this event (from another thread) to kill the run; its status is then
                `killed`, with a `cancelled` event.
            on_files: called with the workspace's host path and the files the run wrote,
                after the run and before the workspace is removed (read them with
                `codecage.engine.workspace.read_file`, which never follows a link).
            files: input files to put in the fresh /workspace before the code runs:
                relative path (e.g. "input/data.csv") -> content (str is written as UTF-8).
                They live in the workspace's size-limited tmpfs like everything the code
                writes: more than `workspace_mb` in all is refused. Not with `workspace`.
            keep_files_mb: this run's bound of the files its result keeps for
                `result.read_file` / `save_files` (None: the Sandbox's `keep_files_mb`).
            on_output: called as the program writes, with the stream ("stdout" or
                "stderr") and the text (UTF-8; a character split across two writes arrives
                whole; an invalid byte as a ``\\x80`` escape; control characters as
                written: neutralise them before showing them on a terminal). It is called
                on a thread of codecage's own (one per run, named ``codecage-output``), in
                order, never two calls at once, and every call has returned when `run`
                returns. Scrubbed as the result is, by complete lines (an unfinished line
                goes out after 0.5 s or 4 KiB). Of each stream, the head the result
                keeps (half of `max_output_bytes`) is streamed; one line then says the rest
                is not. If it raises, it is not
                called again (logged once); one still busy 5 s after the run ended is left
                behind and gets no more. The result holds the output as without it.
            allow_hosts: hosts this run may reach besides the Sandbox's (HOST[:PORT]
                rules, as for `Sandbox(allow_hosts=)`), within the ceiling: the config's
                `[network] ceiling` and `allow`, the profile's hosts and the Sandbox's
                `allow_hosts`. A run with any host allowed may import the network modules
                (urllib.request, http.client, socket, ssl, httpx, requests) whatever its
                profile.

        Raises:
            ConfigError: the request was refused before anything ran (e.g. `allow_hosts`
                outside the ceiling: the message lists what is permitted).
            HostError: the host cannot provide the isolation (see `doctor()`).
            SandboxError: the sandbox itself failed.
        """
        egress, policy = self.host.network_for(self.policy, allow_hosts, self.face)
        keep_mb = _check_keep_files_mb(
            self.keep_files_mb if keep_files_mb is None else keep_files_mb
        )
        collected: list[kept_files.KeptFiles] = []

        def read_back(workspace: Path, written: list[FileInfo]) -> None:
            # The one moment the workspace can be read: keep the bytes, then the caller's.
            if keep_mb:
                collected.append(workspaces.keep(workspace, written, keep_mb * 2**20))
            if on_files is not None:
                on_files(workspace, written)

        request = host.Request(
            code=code,
            limits=self._limits_for(limits),
            policy=policy,
            filename=filename,
            files=_input_files(files),
            workspace=Path(workspace) if workspace is not None else None,
            allowed_tools=self.allowed_tools,
            cancel=cancel,
            on_files=read_back,
            strict=strict,
            face=self.face,
            on_output=on_output,
            egress=egress,
            caller=self.caller,
            approve=self.approver,
        )
        result = self.host.run(request)
        return result.with_kept_files(collected[0]) if collected else result

    def session(
        self,
        *,
        ttl: float | None = None,
        lifetime: float | None = None,
        limits: Limits | dict[str, Any] | None = None,
        allow_hosts: Iterable[str] | None = None,
    ) -> Session:
        """Open a session: one sandbox whose runs share an interpreter, so that globals,
        imports and /workspace persist between them (`with sandbox.session() as s:`).

        Args:
            ttl: seconds the session may sit unused before it is closed (each run starts
                the count again); default: the config's `[sessions] idle_ttl` (600).
            lifetime: seconds it lives at most; default `[sessions] lifetime` (3600).
            limits: the session's limits (memory, processes, disk for the whole session;
                timeout, CPU seconds, output as its runs' defaults), as for `run`.
            allow_hosts: hosts every run of the session may reach, as for `run` (fixed
                for the session).

        Raises:
            SessionError: as many sessions are open as `[sessions] max_total` allows.
            ConfigError: a limit is out of bounds.
            HostError: the host cannot provide the isolation (see `doctor()`).
            SandboxError: the sandbox failed to start.
        """
        for name, value in (("ttl", ttl), ("lifetime", lifetime)):
            if value is not None and not 0 < value <= 7 * 86_400:
                raise ConfigError(
                    f"{name}={value!r} is not a number of seconds in (0, 604800]",
                    hint=f"pass {name}=600 for ten minutes",
                )
        return open_session(
            self,
            ttl=ttl,
            lifetime=lifetime,
            limits=self._limits_for(limits),
            allow_hosts=allow_hosts,
        )

    def warm(self, timeout: float = 60.0) -> bool:
        """Wait until the pool has its warm sandboxes ready; False on timeout or no pool."""
        return self.host.warm(timeout)

    def close(self) -> None:
        """Stop this Sandbox's own pool, killing its idle sandboxes (a shared one stays),
        and close its audit trail."""
        self.host.close()
        if self.alerter is not None:  # before the audit trail it records in
            self.alerter.close()
        if self.host.audit is not None:
            self.host.audit.close()

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def arun(
        self,
        code: str,
        *,
        limits: Limits | dict[str, Any] | None = None,
        filename: str = "main.py",
        workspace: str | Path | None = None,
        strict: bool = False,
        files: Mapping[str, bytes | str] | None = None,
        on_files: Callable[[Path, list[FileInfo]], None] | None = None,
        keep_files_mb: int | None = None,
        on_output: OutputHandler | Callable[[str, str], Awaitable[None]] | None = None,
        allow_hosts: Iterable[str] | None = None,
    ) -> ExecutionResult:
        """`run()` for asyncio callers: the run happens in a worker thread. Cancelling the
        task kills the sandbox.

        `on_output` and `allow_hosts` as for `run()`; a coroutine `on_output` is awaited on
        the caller's event loop instead, one call after the other in order, and `arun`
        returns once the last has finished (waiting at most 5 s for it; one that raises is
        not called again).

        Raises:
            ConfigError: the request was refused before anything ran.
            HostError: the host cannot provide the isolation (see `doctor()`).
            SandboxError: the sandbox itself failed.
        """
        import asyncio  # here: a plain `run` (the CLI's) need not pay its import (~15 ms)

        cancel = threading.Event()
        relay, handler = None, cast(OutputHandler | None, on_output)
        if inspect.iscoroutinefunction(on_output):
            relay = _LoopRelay(on_output)
            handler = relay.put
        try:
            result = await asyncio.to_thread(
                approvals.on_loop(asyncio.get_running_loop(), self.run),
                code,
                limits=limits,
                filename=filename,
                workspace=workspace,
                strict=strict,
                cancel=cancel,
                files=files,
                on_files=on_files,
                keep_files_mb=keep_files_mb,
                on_output=handler,
                allow_hosts=allow_hosts,
            )
        except asyncio.CancelledError:
            cancel.set()  # the task was cancelled: the worker thread kills the sandbox
            if relay is not None:
                relay.cancel()
            raise
        except BaseException:
            if relay is not None:
                relay.cancel()
            raise
        if relay is not None:
            await relay.finish()
        return result

    def run_many(
        self,
        programs: Iterable[batch.ProgramLike],
        *,
        concurrency: int | None = None,
        max_queued: int = batch.DEFAULT_MAX_QUEUED,
        on_progress: batch.ProgressHandler | None = None,
    ) -> list[batch.BatchResult]:
        """Run many programs, each once in its own sandbox, `concurrency` at a time, and
        return one `BatchResult` per program in input order (`codecage.batch`).

        >>> results = sandbox.run_many(["1 + 1", {"code": "2 * 3", "limits": {"timeout": 2}}])
        >>> [r.result.return_value for r in results]
        [2, 6]

        Args:
            programs: code strings, `batch.Program`s or dicts with their keys (code, id,
                limits, files, filename).
            concurrency: runs at once, 1 to 256; None: the pool's size, else the CPUs.
            max_queued: the most programs one batch may hold (default 100,000).
            on_progress: called with (done, total, the BatchResult just finished), one
                call at a time, on a worker thread.

        A program whose sandbox failed is reported as its item's `error`, never retried.

        Raises:
            ConfigError: refused before anything ran (too many programs, an item
                malformed or with limits out of bounds: the message names it).
        """
        return batch.run_many(
            self,
            programs,
            concurrency=concurrency,
            max_queued=max_queued,
            on_progress=on_progress,
        )

    async def arun_many(
        self,
        programs: Iterable[batch.ProgramLike],
        *,
        concurrency: int | None = None,
        max_queued: int = batch.DEFAULT_MAX_QUEUED,
        on_progress: batch.ProgressHandler | None = None,
    ) -> list[batch.BatchResult]:
        """`run_many()` for asyncio callers; cancelling the task kills the runs in flight.

        Raises:
            ConfigError: refused before anything ran, as for `run_many`.
        """
        import asyncio  # as in `arun`

        cancel = threading.Event()
        try:
            return await asyncio.to_thread(
                approvals.on_loop(asyncio.get_running_loop(), batch.run_many),
                self,
                programs,
                concurrency=concurrency,
                max_queued=max_queued,
                on_progress=on_progress,
                cancel=cancel,
            )
        except asyncio.CancelledError:
            cancel.set()  # the worker threads kill their sandboxes and take no more
            raise

    def validate(self, code: str, *, strict: bool = False) -> ValidationReport:
        """Check `code` against this Sandbox's profile without running it.

        Never raises for bad code: syntax errors and refusals are findings in the report.
        """
        return self.host.validate(code, self.policy, strict=strict)

    def info(self) -> HostInfo:
        """What this host provides: backend, layers really in force, defaults, ceilings."""
        return self.host.info(
            policy=self.policy, allowed_tools=self.allowed_tools, limit_sources=self.limit_sources
        )

    def doctor(self) -> DoctorReport:
        """Prove each layer by running probes in a real sandbox (never cached).

        Raises:
            HostError: the host cannot start a sandbox at all.
            SandboxError: the sandbox itself failed.
        """
        return self.host.doctor()

    def _limits_for(self, limits: Limits | dict[str, Any] | None) -> Limits:
        """A run's limits: these, or the defaults with the dict's non-None fields applied
        (validated once here; no override at all is the defaults as they are).

        Raises:
            ConfigError: an override is out of its bounds.
        """
        return _limits_over(self.limits, limits)


def _limits_over(defaults: Limits, limits: Limits | dict[str, Any] | None) -> Limits:
    """`limits` whole, or `defaults` with the dict's non-None fields applied.

    Raises:
        ConfigError: an override is unknown or out of its bounds, or `limits` is neither.
    """
    if isinstance(limits, Limits):
        return limits
    if limits is not None and not isinstance(limits, dict):
        raise ConfigError(
            f"limits must be a Limits or a dict of its fields, not {type(limits).__name__}",
            hint="e.g. limits={'timeout': 5, 'memory_mb': 512}",
        )
    overrides = {name: value for name, value in (limits or {}).items() if value is not None}
    if not overrides:
        return defaults
    try:
        return defaults.merged(overrides)
    except ValidationError as exc:
        raise ConfigError(_describe_validation(exc), hint=_limits_hint(exc)) from exc


def _check_keep_files_mb(value: int) -> int:
    """Refuse a `keep_files_mb` that is not a whole number of MiB from 0 to 4096.

    Raises:
        ConfigError: it is not.
    """
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 4096:
        raise ConfigError(
            f"keep_files_mb={value!r} is not a whole number from 0 to 4096",
            hint="pass {keep_files_mb=64} (MiB of a run's files its result keeps; 0: none)",
        )
    return value


class _LoopRelay:
    """`arun`'s coroutine `on_output`, run on the caller's loop: the run's output thread
    queues each piece (`put`), one task awaits the handler for each in order."""

    def __init__(self, handler: Callable[[str, str], Awaitable[None]]) -> None:
        import asyncio  # as in `arun`

        self._handler = handler
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[tuple[str, str] | None] = asyncio.Queue()
        self._task = self._loop.create_task(self._consume())

    def put(self, stream: str, text: str) -> None:
        """From the run's output thread: hand `text` over to the loop."""
        self._loop.call_soon_threadsafe(self._queue.put_nowait, (stream, text))

    async def _consume(self) -> None:
        failed = False
        while (item := await self._queue.get()) is not None:
            if failed:
                continue
            try:
                await self._handler(*item)
            except Exception as exc:  # the caller's code: it stops getting output, that is all
                failed = True
                log.warning("sandbox.on_output_failed", extra={"error": type(exc).__name__})

    async def finish(self) -> None:
        """After the run: the pieces queued so far are handled (at most 5 s more)."""
        import asyncio  # as in `arun`

        self._queue.put_nowait(None)  # after every put: the run's thread queued them first
        _, pending = await asyncio.wait({self._task}, timeout=5.0)
        if pending:
            log.warning("sandbox.on_output_slow", extra={"waited_s": 5.0})
            self.cancel()

    def cancel(self) -> None:
        self._task.cancel()


def _input_files(files: Mapping[str, bytes | str] | None) -> dict[str, bytes] | None:
    """`run`'s `files`, as bytes (str as UTF-8)."""
    if not files:
        return None
    return {
        name: data.encode("utf-8", "surrogatepass") if isinstance(data, str) else bytes(data)
        for name, data in files.items()
    }


def load_settings(path: str | Path | None) -> Settings:
    """The effective defaults (config file, then environment) for a new Sandbox.

    Raises:
        ConfigError: the config file or an environment variable is invalid.
    """
    return config.load(Path(path) if path is not None else None)


def _limits_hint(exc: ValidationError) -> str:
    """Name the first bad limit the way the reader's face spells it (errors.render_hint)."""
    fields = [str(err["loc"][0]) for err in exc.errors() if err["loc"]]
    named = next((f for f in fields if f in Limits.model_fields), None)
    if named is None:
        return "{info} lists the limits, their defaults and bounds"
    return f"pass {{{named}}} within its bounds; {{info}} lists the defaults and bounds"


def _describe_validation(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        field = ".".join(str(p) for p in err["loc"])
        parts.append(f"{field}={err.get('input')!r}: {err['msg']}")
    return "invalid limits: " + "; ".join(parts)


def _audit_trail(
    settings: Settings, audit: bool | str | Path | None, face: Face, scrub: Callable[[str], str]
) -> AuditTrail | None:
    """The trail `audit` asks for (see `Sandbox`), opened; None when off."""
    if isinstance(audit, str) and audit.lower() in ("on", "off"):  # as the CLI spells it
        audit = audit.lower() == "on"
    wanted = settings.audit.enabled if audit is None else audit is not False
    if wanted is None:
        wanted = face == "mcp"
    if not wanted:
        return None
    audit_settings = settings.audit
    if isinstance(audit, str | Path):
        audit_settings = audit_settings.model_copy(update={"store": str(audit)})
    return AuditTrail.open(audit_settings, scrub)


def _approver(
    settings: Settings, approve: approvals.Callback | None, face: Face
) -> approvals.Approver | None:
    """The library's approver from `approve`; refused when the config requires approval and
    a library caller gave no callback (the CLI and the MCP server ask in their own way).

    Raises:
        ConfigError: approval is required and there is no callback.
    """
    if approve is not None:
        return approvals.from_callback(approve)
    if settings.approval.require is not None and face == "library":
        raise ConfigError(
            f"the config's [approval] require = '{settings.approval.require}': a run granted "
            "what it lists waits for a person, and no one can be asked",
            hint="pass Sandbox(approve=callback), a function that shows an ApprovalRequest "
            "to a person and returns True to run the code",
        )
    return None


def _login_name() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no passwd entry (a container's arbitrary uid)
        return str(os.getuid())
