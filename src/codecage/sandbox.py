"""The library API: `Sandbox(...).run(code) -> ExecutionResult`, its async twin, and
`Sandbox(...).session()` for state across runs (`codecage.session`).

A thin facade over the host runtime (`codecage.host.Host`): the constructor loads the
settings once and builds one `Host` with what is host-wide, keeps what is per run (the
import policy, the tools allowed, the face) as the defaults of its calls, and each method
turns its arguments into a typed `host.Request` (or call) for the Host.
"""

from __future__ import annotations

import dataclasses
import getpass
import inspect
import logging
import os
import threading
from collections.abc import Awaitable, Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from codecage import batch, host
from codecage import kept as kept_files
from codecage.audit import record as audit_record
from codecage.errors import ConfigError, Face
from codecage.models import (
    ApprovalRequest,
    DoctorReport,
    ExecutionResult,
    FileInfo,
    HostInfo,
    Limits,
    ValidationReport,
)
from codecage.options import Options, check_keep_files_mb, limits_over
from codecage.policy import approval as approvals
from codecage.policy.profiles import ImportPolicy
from codecage.session import Session, open_session

if TYPE_CHECKING:
    from codecage.bridge.broker import Broker

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
        profile: capability profile(s) for imports: "standard" (the default unless the
            config names another: the whole standard library and every installed data
            package, nothing refused) or curated ones such as "basic" or
            "data_science,filesystem".
        allowed_imports: modules added to the profile's set (or replacing it:
            `Options(replace_imports=True)`).
        config: a TOML config file; by default the first found (see `codecage.config`:
            $CODECAGE_CONFIG, the user's, the system's; never the current directory).
            Refused unless owned by you or root and not writable by others. (The
            `Settings` that `codecage.config.load()` returned go in `Options(config=)`.)
            Precedence: these arguments > CODECAGE_* variables > the file > built-ins.
        pool: run requests in warm, single-use sandboxes started ahead of time (same
            isolation, ~1 ms instead of ~50 ms to start). True: a pool of this Sandbox's
            own, sized by the config's [pool] table (`Options(pool=a_pool)` shares
            another's); False: cold starts only; None (default): as the config says
            (`[pool] enabled`, or CODECAGE_POOL), and without a pool, where sandboxes are
            forked from a template (bwrap as root), the next sandbox of a run's kind is
            forked ahead after that run (`[pool] prefork`, CODECAGE_PREFORK): a warm run
            of `1` then takes ~2.5 ms instead of ~25 ms. Close the Sandbox (or use it in a
            `with`) to stop its pool and what it forked ahead.
        tools: a `Broker` holding sessions to upstream MCP servers: the code's tool calls
            (`codecage.runtime.call_tool`, `servers.<server>.<tool>.call`) go to it over the
            sandbox's private bridge (docs/tool-bridge.md). None: tool calls fail clearly.
        allowed_tools: "server.tool" patterns the code may call, split at the first dot and
            matched per half (`*` wildcards match only plain names, see
            `codecage.bridge.tooling`); None: all that the servers' own allow-lists permit.
            Raises ConfigError for a pattern without a dot.
        allow_hosts: hosts every run of this Sandbox may reach, as HOST[:PORT] rules
            ("api.example.com", "*.example.com", "api.example.com:8443", "203.0.113.7";
            port 443 and 80 when omitted), on top of the config's `[network] allow` and
            the profile's hosts; a run may ask for these and the config's `[network]
            ceiling` with `run(allow_hosts=...)`. Empty (default): no network unless the
            config allows some. Raises ConfigError for a malformed rule or one the
            config's `[network] deny` covers.
        data_dir: a host directory mounted read-only at /data in every sandbox (absolute,
            an existing directory, not / nor codecage's own state); symlinks in it resolve
            inside the sandbox, never to the host's files.
        approve: how a person approves a run before it starts, when the config's
            `[approval] require` asks for it by what the run is granted (network, tools
            with side effects, a lent workspace, ...; docs/configuration.md): called with
            an `ApprovalRequest` (the code, its sha256, the grants, the static findings as
            advice), returns True to run it; False, an
            exception or no answer within `[approval] timeout` seconds is a denial, and the
            result is `blocked` with an `approval` event. A coroutine function is awaited on
            the caller's loop under `arun`. Required when `[approval] require` is set
            (ConfigError without it).
        options: the rest, as an `Options` (`codecage.options`): allow_degraded,
            replace_imports, import_policy, selftest, fork_server, tool_limits, servers_dir,
            skills_dir, packages_dir, tokenize, scrub, face, keep_files_mb, audit, alerts.
            The keywords above, when given, take precedence over the same fields of
            `options`; `Options` documents each field.

    >>> with Sandbox(pool=True) as sandbox:
    ...     sandbox.warm()                      # optional: wait until the pool is ready
    ...     results = [sandbox.run(f"{i} * 2") for i in range(100)]
    """

    def __init__(
        self,
        *,
        limits: Limits | dict[str, Any] | None = None,
        backend: str | None = None,
        profile: str | None = None,
        allowed_imports: Iterable[str] = (),
        config: str | Path | None = None,
        pool: bool | None = None,
        tools: Broker | None = None,
        allowed_tools: Iterable[str] | None = None,
        allow_hosts: Iterable[str] = (),
        data_dir: str | Path | None = None,
        approve: Callable[[ApprovalRequest], bool | Awaitable[bool]] | None = None,
        options: Options | None = None,
    ) -> None:
        resolved = _options(
            options or Options(),
            limits=limits,
            backend=backend,
            profile=profile,
            allowed_imports=tuple(allowed_imports),
            config=config,
            pool=pool,
            tools=tools,
            allowed_tools=allowed_tools,
            allow_hosts=tuple(allow_hosts),
            data_dir=data_dir,
            approve=approve,
        ).resolve()
        self._hold(host.build(resolved))

    def _hold(self, runtime: host.Host) -> None:
        """Hold `runtime`, with its face's defaults as this Sandbox's."""
        resolved = runtime.options
        self.host = runtime
        self.limits = resolved.limits  # the defaults of its runs (`run_many` reads them)
        self.policy: ImportPolicy | None = resolved.policy
        self.allowed_tools = resolved.allowed_tools
        self.face: Face = resolved.face
        self.keep_files_mb = resolved.keep_files_mb
        # How this Sandbox's runs ask a person (the CLI puts its terminal prompt here).
        self.approver = resolved.approver
        self.caller = audit_record.Caller(
            "cli" if self.face == "cli" else "library", name=_login_name()
        )  # the MCP server names each call's caller itself

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
        keep_mb = check_keep_files_mb(
            self.keep_files_mb if keep_files_mb is None else keep_files_mb
        )
        collected: list[kept_files.KeptFiles] = []

        def read_back(workspace: Path, written: list[FileInfo]) -> None:
            # The one moment the workspace can be read: keep the bytes, then the caller's.
            if keep_mb:
                collected.append(host.keep(workspace, written, keep_mb * 2**20))
            if on_files is not None:
                on_files(workspace, written)

        request = host.Request(
            host.Program(
                code,
                filename,
                files=host.input_files(files),
                workspace=Path(workspace) if workspace is not None else None,
            ),
            limits=self._limits_for(limits),
            policy=policy,
            egress=egress,
            allowed_tools=self.allowed_tools,
            strict=strict,
            asker=host.Asker(face=self.face, caller=self.caller, approve=self.approver),
            hooks=host.Hooks(cancel=cancel, on_output=on_output, on_files=read_back),
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
            self.host,
            policy=self.policy,
            allowed_tools=self.allowed_tools,
            face=self.face,
            approver=self.approver,
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
        and close its alerter and audit trail."""
        self.host.close()

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
        return self.host.info(policy=self.policy, allowed_tools=self.allowed_tools)

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
        return limits_over(self.host.limits, limits)


def over(runtime: host.Host) -> Sandbox:
    """A Sandbox over a Host built elsewhere (`host.build`, e.g. with observers of its
    own); closing the Sandbox closes the Host."""
    sandbox = Sandbox.__new__(Sandbox)
    sandbox._hold(runtime)
    return sandbox


def _options(options: Options, **arguments: Any) -> Options:
    """`options` with the keywords given to `Sandbox` (those not at their defaults) over
    them: the Sandbox's own keywords are the everyday ones of `Options`."""
    given = {name: v for name, v in arguments.items() if v is not None and v != ()}
    return dataclasses.replace(options, **given)


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


def _login_name() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no passwd entry (a container's arbitrary uid)
        return str(os.getuid())
