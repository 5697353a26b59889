"""The library API: `Sandbox(...).run(code) -> ExecutionResult`, and its async twin."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from codecage import config, engine, packages
from codecage.backends.base import Backend, available_backends, load_backend
from codecage.backends.bwrap import BwrapBackend, bwrap_version
from codecage.bridge import channel as bridge
from codecage.bridge import tooling
from codecage.config import Settings
from codecage.engine import selftest
from codecage.engine.pool import Pool
from codecage.errors import ConfigError, Face, HostError
from codecage.isolation import cgroups, rootfs, seccomp, tmpfs
from codecage.models import (
    DoctorReport,
    ErrorInfo,
    Event,
    ExecutionResult,
    FileInfo,
    HostInfo,
    LayerStatus,
    Limits,
    PoolState,
    ScrubSettings,
    ToolsState,
    Usage,
    ValidationReport,
)
from codecage.policy import profiles
from codecage.policy import scrub as scrubbing
from codecage.policy import validate as validation
from codecage.policy.profiles import ImportPolicy
from codecage.policy.scrub import apply as redaction

if TYPE_CHECKING:
    from codecage.bridge.broker import Broker

log = logging.getLogger(__name__)

_selftest_lock = threading.Lock()
_selftest_memo: dict[str, DoctorReport] = {}
_swept = threading.Event()


class Sandbox:
    """Runs code in a fresh, isolated sandbox per call.

    >>> from codecage import Sandbox
    >>> result = Sandbox().run("sum(range(10))")
    >>> result.status, result.return_value
    ('ok', 45)

    Args:
        limits: default limits of this Sandbox's runs (each run may override them).
        backend: "auto" (the strongest available) or a backend name ("bwrap").
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

    >>> with Sandbox(pool=True) as sandbox:
    ...     sandbox.warm()                      # optional: wait until the pool is ready
    ...     results = [sandbox.run(f"{i} * 2") for i in range(100)]
    """

    def __init__(
        self,
        *,
        limits: Limits | None = None,
        backend: str = "auto",
        allow_degraded: bool = False,
        selftest: bool = True,
        profile: str | None = None,
        allowed_imports: tuple[str, ...] | list[str] = (),
        replace_imports: bool = False,
        import_policy: bool = True,
        config: str | Path | Settings | None = None,
        pool: bool | Pool | None = None,
        tools: Broker | None = None,
        allowed_tools: Iterable[str] | None = None,
        tool_limits: bridge.BridgeLimits | None = None,
        servers_dir: str | Path | None = None,
        skills_dir: str | Path | None = None,
        packages_dir: str | Path | None = None,
        tokenize: bool | None = None,
        scrub: bool | ScrubSettings | None = None,
        face: Face = "library",
    ) -> None:
        if isinstance(config, Settings):  # loaded once by the caller (the CLI, the server)
            self.settings = config
        else:
            self.settings = load_settings(Path(config) if config is not None else None)
        self.limits = limits or self.settings.limits
        self.limit_sources = dict(self.settings.sources)
        if limits is not None:
            self.limit_sources.update(dict.fromkeys(Limits.model_fields, "argument"))
        if profile is not None:
            self.limit_sources["profile"] = "argument"
        self.backend: Backend = load_backend(backend)
        self.allow_degraded = allow_degraded
        self._selftest = selftest
        self.tools = tools
        self.tokenize = tokenize
        self.allowed_tools = tuple(allowed_tools) if allowed_tools is not None else None
        tooling.allow_patterns(self.allowed_tools)  # a malformed one fails here, not in a run
        self.tool_limits = tool_limits or tooling.bridge_limits(self.settings.tools)
        self.servers_dir = Path(servers_dir).resolve() if servers_dir is not None else None
        self.skills_dir = Path(skills_dir).resolve() if skills_dir is not None else None
        self.packages_dir = packages.location(packages_dir, self.settings)[0]
        self.policy: ImportPolicy | None = (
            self._policy(profile, allowed_imports, replace_imports) if import_policy else None
        )
        self.face: Face = face
        if not _swept.is_set():  # once per process: leftovers of killed codecage processes
            _swept.set()
            engine.sweep_stale_runs()
        self._preload: tuple[str, ...] | None = None
        self._selftest_report: DoctorReport | None = None
        self.scrub_settings, self._scrub_source = self._scrub_settings(scrub)
        self.scrubber = redaction.build_scrubber(
            self.scrub_settings, extra_secrets=tools.secrets() if tools is not None else ()
        )
        # What the code's own `codecage.runtime.scrub(text)` uses: it asked, so it gets the
        # default detectors even when results are not scrubbed.
        self._asked_scrubber = self.scrubber or scrubbing.Scrubber()
        self.pool, self._owns_pool = self._pool(pool)
        if self.pool is not None:
            spec = self._warm_spec(self.limits)
            engine.prepare(spec)  # here, not in a starter thread that a stop cannot wait for
            self.pool.register(spec, self._profile_name())

    def _scrub_settings(self, scrub: bool | ScrubSettings | None) -> tuple[ScrubSettings, str]:
        if isinstance(scrub, ScrubSettings):
            return scrub, "argument"
        if scrub is None:
            return self.settings.scrub, self.settings.sources.get("scrub", "default")
        return self.settings.scrub.model_copy(update={"enabled": scrub}), "argument"

    def _pool(self, pool: bool | Pool | None) -> tuple[Pool | None, bool]:
        if isinstance(pool, Pool):
            return pool, False
        if pool is False or (pool is None and not self.settings.pool.enabled):
            return None, False
        config = self.settings.pool.model_copy(update={"enabled": True})
        return Pool(self.backend, config, self.limits), True

    def _warm_spec(self, limits: Limits) -> engine.SandboxSpec:
        """What a warm sandbox for a run with `limits` must have been started with."""
        if self._preload is None:
            self._preload = profiles.preload_for(self.policy)
        return engine.SandboxSpec(
            policy=self.policy,
            workspace_mb=limits.workspace_mb,
            tmp_mb=limits.tmp_mb,
            preload=self._preload,
            servers_dir=self.servers_dir,
            skills_dir=self.skills_dir,
            packages_dir=self.packages_dir,
        )

    def _wider_profile(self) -> str | None:
        """The profile an import refusal suggests: the default one, which refuses nothing,
        when the operator lets callers choose it."""
        enabled = self.settings.enabled_profiles
        if enabled is not None and profiles.DEFAULT_PROFILE not in enabled:
            return None
        return profiles.DEFAULT_PROFILE

    def _profile_name(self) -> str:
        return self.policy.profile if self.policy else "none"

    def _policy(
        self, profile: str | None, allowed_imports: Iterable[str], replace: bool
    ) -> ImportPolicy:
        names = [p.strip() for p in (profile or self.settings.profile).split(",") if p.strip()]
        enabled = self.settings.enabled_profiles
        refused = [n for n in names if enabled is not None and n not in enabled]
        if refused:
            raise ConfigError(
                f"profile {', '.join(map(repr, refused))} is not enabled on this host",
                hint=f"pass one of the enabled profiles as {{profile}}: "
                f"{', '.join(enabled or ())} (the operator's config enables them)",
            )
        return profiles.resolve(
            names,
            allowed_imports=[*self.settings.allowed_imports, *allowed_imports],
            replace=replace,
            custom=self.settings.custom_profiles,
        )

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
    ) -> ExecutionResult:
        """Run `code` in a new sandbox and return how it went.

        The code's own failure (exception, timeout, limit) is a result, not an exception.

        Args:
            code: Python source; top-level `await` is allowed; the last expression's value
                becomes `return_value`.
            limits: a full `Limits`, or a dict of fields overriding this Sandbox's defaults.
            filename: the name the code runs under (shows in tracebacks).
            workspace: a host directory to mount at /workspace instead of a fresh empty one;
                its files stay after the run. Refused (ConfigError) when it contains a place
                the configuration is read from (`codecage.config.check_workspace`).
            cancel: set this event (from another thread) to kill the run; its status is then
                `killed`, with a `cancelled` event.
            on_files: called with the workspace's host path and the files the run wrote,
                after the run and before the workspace is removed (read them with
                `codecage.engine.workspace.read_file`, which never follows a link).
            files: input files to put in the fresh /workspace before the code runs:
                relative path (e.g. "input/data.csv") -> content (str is written as UTF-8).
                They live in the workspace's size-limited tmpfs like everything the code
                writes: more than `workspace_mb` in all is refused. Not with `workspace`.

        Raises:
            ConfigError: the request was refused before anything ran.
            HostError: the host cannot provide the isolation (see `doctor()`).
            SandboxError: the sandbox itself failed.
        """
        config.check_workspace(self.settings, workspace)
        packages.check_workspace(self.packages_dir, workspace)
        run_limits = self._limits_for(limits)
        inputs = _input_files(files, workspace)
        if strict:
            blocked = self._blocked_by_validation(code, run_limits)
            if blocked is not None:
                return redaction.scrub_result(blocked, self.scrubber)
        result = self._run(code, run_limits, filename, workspace, cancel, on_files, inputs)
        return redaction.scrub_result(result, self.scrubber)

    def _run(
        self,
        code: str,
        run_limits: Limits,
        filename: str,
        workspace: str | Path | None,
        cancel: threading.Event | None,
        on_files: Callable[[Path, list[FileInfo]], None] | None,
        files: dict[str, bytes] | None = None,
    ) -> ExecutionResult:
        tools = (
            self.tools.for_run(
                allowed_tools=self.allowed_tools,
                scrubber=self._asked_scrubber,
                tokenize=self.tokenize,
            )
            if self.tools
            else None
        )
        request = engine.RunRequest(
            code=code,
            filename=filename,
            limits=run_limits,
            workspace_dir=Path(workspace) if workspace is not None else None,
            files=files,
            degraded=self._missing_layers(),
            policy=self.policy,
            cancel=cancel,
            on_files=on_files,
            tools=tools or bridge.NoServers(self._scrub_asked),
            tool_limits=self.tool_limits,
            servers_dir=self.servers_dir,
            skills_dir=self.skills_dir,
            packages_dir=self.packages_dir,
            face=self.face,
            wider_profile=self._wider_profile(),
        )
        try:
            waited_ms = 0
            if self.pool is not None and request.workspace_dir is None:
                result, waited_ms = self._run_warm(self.pool, request)
                if result is not None:
                    return _with_wait(result, waited_ms)
            return _with_wait(engine.execute(request, self.backend), waited_ms)
        finally:
            if tools is not None:
                tools.close()  # the run's token vault goes with it

    def _scrub_asked(self, text: str) -> str:
        # Detectors only: the configured secrets would make it an oracle on them.
        return self._asked_scrubber.without_secrets().scrub(text).text

    def _run_warm(
        self, pool: Pool, request: engine.RunRequest
    ) -> tuple[ExecutionResult | None, int]:
        """Run in a warm sandbox, and the ms spent waiting for one; no result when there is
        none for this request (its sizes differ from the pool's, none became ready in time,
        or it cannot take the limits): then run cold."""
        engine.check_request(request.code, request.filename, request.limits, request.files)
        asked = time.monotonic()
        sandbox = pool.take(self._warm_spec(request.limits))
        waited_ms = int((time.monotonic() - asked) * 1000)
        if sandbox is None:
            return None, waited_ms
        ran = True
        try:
            return engine.run_in(sandbox, request, backend_name=self.backend.name), waited_ms
        except engine.LimitsNotApplicable as exc:
            log.info("sandbox.warm_refused_limits", extra={"error": str(exc)})
            ran = False
            return None, waited_ms
        finally:
            pool.release(sandbox, ran=ran)

    def warm(self, timeout: float = 60.0) -> bool:
        """Wait until the pool has its warm sandboxes ready; False on timeout or no pool."""
        return self.pool.wait_ready(timeout) if self.pool is not None else False

    def close(self) -> None:
        """Stop this Sandbox's own pool, killing its idle sandboxes (a shared one stays)."""
        if self.pool is not None and self._owns_pool:
            self.pool.close()

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
    ) -> ExecutionResult:
        """`run()` for asyncio callers: the run happens in a worker thread. Cancelling the
        task kills the sandbox.

        Raises:
            ConfigError: the request was refused before anything ran.
            HostError: the host cannot provide the isolation (see `doctor()`).
            SandboxError: the sandbox itself failed.
        """
        cancel = threading.Event()
        try:
            return await asyncio.to_thread(
                self.run,
                code,
                limits=limits,
                filename=filename,
                workspace=workspace,
                strict=strict,
                cancel=cancel,
                files=files,
            )
        except asyncio.CancelledError:
            cancel.set()  # the task was cancelled: the worker thread kills the sandbox
            raise

    def validate(self, code: str, *, strict: bool = False) -> ValidationReport:
        """Check `code` against this Sandbox's profile and tool directories without running it:
        by the rule the sandbox's import hook applies, so `validate` and `run` agree.

        Never raises for bad code: syntax errors and refusals are findings in the report.
        """
        given = {"servers": self.servers_dir, "skills": self.skills_dir}
        return validation.validate(
            code,
            allowed_modules=self.policy.modules if self.policy else None,
            profile_name=self.policy.profile if self.policy else "none",
            strict=strict,
            tool_packages=[name for name, path in given.items() if path is not None],
        )

    def info(self) -> HostInfo:
        """What this host provides: backend, layers really in force, defaults, ceilings."""
        layers: list[LayerStatus] = [
            *self.backend.probe(),
            seccomp.probe(),
            *cgroups.probe(),
            tmpfs.probe(),
        ]
        interpreter = rootfs.find_interpreter()
        return HostInfo(
            version=_version(),
            backend=self.backend.name,
            backends=available_backends(),
            bwrap_version=_bwrap_version(self.backend),
            python=f"{interpreter.executable} ({interpreter.version})",
            layers=layers,
            default_limits=self.limits,
            limit_sources=self.limit_sources,
            profiles=profiles.describe(
                default=self.settings.profile,
                custom=self.settings.custom_profiles,
                enabled=self.settings.enabled_profiles,
            ),
            config_file=str(self.settings.config_file) if self.settings.config_file else None,
            config_origin=self.settings.config_origin,
            import_policy=self.policy.profile if self.policy else None,
            ceilings=engine.ceilings(),
            pool=self.pool.state()
            if self.pool is not None
            else PoolState(
                enabled=self.settings.pool.enabled,
                config=self.settings.pool,
                keys=[],
                host_rss_mb=None,
            ),
            scrub=redaction.state(self.scrub_settings, self.scrubber, self._scrub_source),
            tools=self._tools_state(),
            packages=packages.added_packages(self.packages_dir),
        )

    def _tools_state(self) -> ToolsState:
        limits = self.tool_limits
        return ToolsState(
            servers=sorted(self.tools.servers) if self.tools is not None else [],
            configured_servers=sorted(self.settings.mcp_servers),
            allowed_tools=list(self.allowed_tools) if self.allowed_tools is not None else None,
            tokenize=self.tokenize,
            max_calls=limits.max_calls,
            max_in_flight=limits.max_in_flight,
            max_result_mb=round(limits.max_result_bytes / (1024 * 1024), 2),
            servers_dir=str(self.servers_dir) if self.servers_dir is not None else None,
            skills_dir=str(self.skills_dir) if self.skills_dir is not None else None,
        )

    def doctor(self) -> DoctorReport:
        """Prove each layer by running probes in a real sandbox (never cached).

        Raises:
            HostError: the host cannot start a sandbox at all.
            SandboxError: the sandbox itself failed.
        """
        return selftest.run_probes(self.backend)

    # --- internals -----------------------------------------------------------------------

    def _limits_for(self, limits: Limits | dict[str, Any] | None) -> Limits:
        if isinstance(limits, Limits):
            return limits
        try:
            return self.limits.merged(limits or {})
        except ValidationError as exc:
            raise ConfigError(_describe_validation(exc), hint=_limits_hint(exc)) from exc

    def _blocked_by_validation(self, code: str, limits: Limits) -> ExecutionResult | None:
        report = self.validate(code, strict=True)
        if report.valid:
            return None
        refusing = [f for f in report.findings if f.severity == "high"] or report.findings
        listing = "\n".join(f"line {f.line}:{f.col} {f.rule_id} {f.message}" for f in refusing[:50])
        return ExecutionResult(
            execution_id=uuid.uuid4().hex,
            status="blocked",
            exit_code=None,
            signal=None,
            stdout="",
            stderr="",
            stdout_truncated=False,
            stderr_truncated=False,
            return_value=None,
            error=ErrorInfo(type="ValidationError", message=report.message, traceback=listing),
            files=[],
            usage=Usage(wall_ms=0, cpu_ms=None, peak_memory_mb=None),
            limits=limits,
            events=[
                Event(
                    kind="validation_finding",
                    detail=f"{f.rule_id} {f.severity} line {f.line}: {f.message}"[:2000],
                )
                for f in refusing[:50]
            ],
            backend=self.backend.name,
        )

    def _missing_layers(self) -> tuple[str, ...]:
        if not self._selftest:
            return ()
        report = self._cached_selftest()
        missing = tuple(report.failed_layers())
        if missing and not self.allow_degraded:
            details = "; ".join(f"{p.layer}: {p.detail}" for p in report.probes if not p.passed)
            raise HostError(f"isolation layers missing on this host: {details}")
        if missing:
            log.warning("sandbox.degraded", extra={"missing": list(missing)})
        return missing

    def _cached_selftest(self) -> DoctorReport:
        if self._selftest_report is None:
            self._selftest_report = self._load_selftest()
        return self._selftest_report

    def _load_selftest(self) -> DoctorReport:
        key = selftest.cache_key(self.backend)
        with _selftest_lock:
            if key in _selftest_memo:
                return _selftest_memo[key]
            report = _read_cached(key)
            if report is None:
                log.info("sandbox.selftest", extra={"backend": self.backend.name})
                report = self.doctor()
                if report.passed:  # a failure is checked again next time: hosts get fixed
                    _write_cached(key, report)
            _selftest_memo[key] = report
            return report


def _input_files(
    files: Mapping[str, bytes | str] | None, workspace: str | Path | None
) -> dict[str, bytes] | None:
    """`run`'s `files`, as bytes.

    Raises:
        ConfigError: files and a workspace directory were both given.
    """
    if not files:
        return None
    if workspace is not None:
        raise ConfigError(
            "input files and a workspace directory were both given",
            hint="put the files in the workspace directory, or pass no workspace",
        )
    return {
        name: data.encode("utf-8", "surrogatepass") if isinstance(data, str) else bytes(data)
        for name, data in files.items()
    }


def load_settings(path: Path | None) -> Settings:
    """The effective defaults (config file, then environment) for a new Sandbox.

    Raises:
        ConfigError: the config file or an environment variable is invalid.
    """
    return config.load(path)


def _cache_file(key: str) -> Path:
    return rootfs.cache_dir() / f"selftest-{key}.json"


def _read_cached(key: str) -> DoctorReport | None:
    try:
        return DoctorReport.model_validate_json(_cache_file(key).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _write_cached(key: str, report: DoctorReport) -> None:
    path = _cache_file(key)
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        path.write_text(json.dumps(report.model_dump(mode="json")), encoding="utf-8")


def _bwrap_version(backend: Backend) -> str | None:
    return bwrap_version(backend.executable) if isinstance(backend, BwrapBackend) else None


def _version() -> str:
    from codecage import __version__

    return __version__


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


def _with_wait(result: ExecutionResult, waited_ms: int) -> ExecutionResult:
    """`result` with the time its call waited for a warm sandbox (`Usage.waited_ms`)."""
    if not waited_ms:
        return result
    return result.model_copy(
        update={"usage": result.usage.model_copy(update={"waited_ms": waited_ms})}
    )
