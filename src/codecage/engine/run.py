"""One execution, end to end, as the ordered list of steps: start (the host's facts and
the resources in `launch`, the pure plan in `plan`, then the Backend), supervise
(`supervise`), judge (`judge`), collect, clean up.

`execute()` reads top to bottom as that list; everything it creates is registered on an
ExitStack, so every exit path (ok, timeout, exception, Ctrl-C) kills the sandbox, removes
its cgroup, unmounts and deletes its workspace and temp dir.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import selectors
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import ValidationError

from codecage import packages
from codecage.backends.base import Backend, SandboxProcess
from codecage.bridge import channel as bridge
from codecage.engine import egress as egress_wiring
from codecage.engine import judge, launch
from codecage.engine import plan as plans
from codecage.engine import stream as streaming
from codecage.engine import workspace as workspaces
from codecage.engine.judge import ControlStream, Observation
from codecage.engine.plan import SandboxSpec
from codecage.engine.supervise import supervise
from codecage.errors import ConfigError, Face, SandboxError
from codecage.guest.contract import MAX_DISPLAYS, MAX_DISPLAYS_BYTES, STOP_LINE
from codecage.isolation import cgroups, rlimits
from codecage.isolation import identity as identities
from codecage.isolation.cgroups import CgroupHandle
from codecage.isolation.identity import Identity, IdentityPlan
from codecage.models import (
    MAX_CODE_BYTES,
    Ceilings,
    Event,
    ExecutionResult,
    FileInfo,
    GuestLimits,
    GuestReady,
    GuestRequest,
    Limits,
    NetworkLimits,
    Usage,
)
from codecage.output import neutralise
from codecage.policy import profiles
from codecage.policy import scrub as scrubbing
from codecage.policy.profiles import ImportPolicy

if TYPE_CHECKING:
    from codecage.egress.proxy import RunEgress
    from codecage.egress.rules import EgressPolicy
    from codecage.egress.setup import EgressSetup
    from codecage.engine.forkserver import Templates

log = logging.getLogger(__name__)

RETURN_VALUE_MAX_BYTES = 1024 * 1024
SESSION_INTERRUPT_GRACE_S = 2.0
"""How long past its timeout a session's interrupted run has to stop before the host kills
the sandbox (and the session with it)."""
# The result (its return value, escaped at worst twice its size) and the display outputs
# (their lines within MAX_DISPLAYS_BYTES, and room for lines the host refuses).
_CONTROL_CAP_BYTES = (
    2 * RETURN_VALUE_MAX_BYTES + 256 * 1024 + MAX_DISPLAYS_BYTES + MAX_DISPLAYS * 4096
)


@dataclass(frozen=True, slots=True)
class RunRequest:
    """One validated request to run code: what this run asked for. What every run of its
    host shares is `context`, built once by the host (not copied into each request)."""

    code: str
    filename: str
    limits: Limits
    workspace_dir: Path | None = None  # a host dir to mount instead of a fresh one
    # Written into the fresh workspace (its tmpfs, within workspace_mb) before the code runs.
    files: Mapping[str, bytes] | None = None
    degraded: tuple[str, ...] = ()  # layers known missing (only with allow_degraded)
    policy: ImportPolicy | None = None  # None: no import policy (the OS layers still hold)
    cancel: threading.Event | None = None  # set it to kill the run (status killed, cancelled)
    # Called with the workspace's host path and its listing before the sandbox is destroyed:
    # the one moment a warm run's files can be read back.
    on_files: Callable[[Path, list[FileInfo]], None] | None = None
    # Answers the code's tool calls (docs/tool-bridge.md); None: no upstream servers.
    tools: bridge.Responder | None = None
    face: Face = "library"  # who asked: an import refusal's hint is worded for it
    # Called with ("stdout" | "stderr", text) as the program writes (engine/stream.py).
    on_output: streaming.OutputCallback | None = None
    # Scrubs streamed text first (text, cut) -> text; None: streamed as written.
    scrub_output: streaming.StreamScrub | None = None
    # The hosts this run may reach through the host proxy (egress/rules.py); None: no
    # network at all. `egress_setup` is how its sandbox reaches the proxy.
    egress: EgressPolicy | None = None
    egress_setup: EgressSetup | None = None
    context: HostContext = field(default_factory=lambda: HostContext())


@dataclass(frozen=True, slots=True)
class HostContext:
    """What every run of one host shares: built once, when the host is."""

    tool_limits: bridge.BridgeLimits = field(default_factory=bridge.BridgeLimits)
    servers_dir: Path | None = None  # see SandboxSpec
    skills_dir: Path | None = None
    packages_dir: Path | None = None
    data_dir: Path | None = None  # see SandboxSpec
    identity: Identity | IdentityPlan | None = None  # see SandboxSpec
    wider_profile: str | None = None  # an enabled profile that refuses nothing, for hints
    network_limits: NetworkLimits = field(default_factory=NetworkLimits)


def ceilings() -> Ceilings:
    """The largest limits this host accepts."""
    return Ceilings(
        memory_mb=cgroups.memory_ceiling_mb(),
        max_processes=32_768,
        timeout=3600.0,
    )


def check_request(
    code: str, filename: str, limits: Limits, files: Mapping[str, bytes] | None = None
) -> None:
    """Refuse, before anything runs, what cannot be run.

    Raises:
        ConfigError: the code, the file name, a limit or an input file is not acceptable.
    """
    if files:
        workspaces.check_files(files, limits.workspace_mb)
    if len(code.encode("utf-8", "surrogatepass")) > MAX_CODE_BYTES:
        raise ConfigError(
            f"the code is larger than {MAX_CODE_BYTES // (1024 * 1024)} MiB",
            hint="put large data in a file and pass it in the workspace instead",
        )
    _check_text(code, "the code")
    _check_text(filename, "the file name")
    if "\x00" in code:
        raise ConfigError(
            "the code contains a NUL byte, so it is not Python source",
            hint="pass text, not a binary file",
        )
    if not filename or "/" in filename or filename.startswith(".") or len(filename) > 128:
        raise ConfigError(
            f"bad file name {filename!r} for the submission",
            hint="use a plain name such as main.py",
        )
    top = ceilings()
    if limits.memory_mb > top.memory_mb:
        raise ConfigError(
            f"memory_mb={limits.memory_mb} is above this host's ceiling of {top.memory_mb}",
            hint=f"pass {{memory_mb={top.memory_mb}}} or less; {{info}} lists the ceilings",
        )


def _check_text(text: str, what: str) -> None:
    """Refuse a lone surrogate (U+D800-U+DFFF, e.g. from undecodable bytes in a command
    line): it is not Unicode text, and neither Python nor UTF-8 can carry it.

    Raises:
        ConfigError: there is one.
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ConfigError(
            f"{what} is not valid text: a lone surrogate (U+{ord(text[exc.start]):04X}) at "
            f"character {exc.start}",
            hint="send UTF-8 text; in a string literal write it as an escape (\\ud800)",
        ) from None


def spec_for(request: RunRequest) -> SandboxSpec:
    """The sandbox a cold run of `request` is made as."""
    return SandboxSpec(
        egress=request.egress_setup if request.egress is not None else None,
        policy=request.policy,
        workspace_mb=request.limits.workspace_mb,
        tmp_mb=request.limits.tmp_mb,
        servers_dir=request.context.servers_dir,
        skills_dir=request.context.skills_dir,
        packages_dir=request.context.packages_dir,
        data_dir=request.context.data_dir,
        identity=request.context.identity,
    )


@dataclass(slots=True)
class StartedSandbox:
    """One sandbox, started: namespaces made, moved into its cgroup, the guest coming up
    (or, once `ready_pid` is set, waiting for its one request). Used once, then destroyed."""

    execution_id: str
    spec: SandboxSpec
    proc: SandboxProcess  # what its backend handed back
    channel: launch.Channels
    cgroup: CgroupHandle | None
    workspace: workspaces.Workspace
    cgroup_limits: Limits  # what its cgroup is set to now
    started_at: float
    cleanup: contextlib.ExitStack
    lost: tuple[str, ...] = ()  # what its backend lacks by design (Backend.lost_layers)
    ready_pid: int | None = None
    baseline: _Baseline | None = None  # what it used before its request (see wait_ready)
    used: bool = False
    guest_rlimits: bool = False  # backends.base.HostOverhead.guest_rlimits
    egress: RunEgress | None = None  # its socket on the proxy (spec.egress), else None
    identity: Identity | None = None  # its host ids, its own for its life (lent by start)
    plan: plans.LaunchPlan | None = None  # what it was started with (None: forked)
    # Its processes' host uid is shared with others' in its user namespace, where
    # RLIMIT_NPROC would count them all together: its pids cgroup alone bounds its
    # processes (where it has one). Only when sandboxes do not have ids of their own (not
    # root, or [sandbox] uid set): forked from a template (engine/forkserver.py), or
    # Landlock's guest in the host's user namespace.
    shares_user_namespace: bool = False

    def alive(self) -> bool:
        return self.proc.alive()

    def kill(self) -> None:
        """Kill every process of it: the backend's way, then whatever is left in its cgroup.
        It is reaped and its cgroup removed by `destroy`."""
        self.proc.kill()
        if self.cgroup is not None:
            cgroups.kill_all(self.cgroup)

    def destroy(self) -> None:
        """Kill it and remove everything it had; idempotent."""
        self.cleanup.close()

    def cpu_since_baseline_ms(self) -> int | None:
        """CPU its processes used since its baseline (ready, or a session's last run's end),
        by its cgroup; None without a cgroup (nothing counts what its processes use)."""
        if self.cgroup is None or self.baseline is None:
            return None
        used = cgroups.cpu_usage_ms(self.cgroup)
        return None if used is None else max(0, used - self.baseline.cpu_ms)


def execute(
    request: RunRequest, backend: Backend, templates: Templates | None = None
) -> ExecutionResult:
    """Run `request` in a fresh sandbox of `backend` and destroy the sandbox afterwards
    (a cold start; `codecage.engine.pool` runs requests in sandboxes started ahead of time).

    Raises:
        ConfigError: the request was refused before anything ran.
        HostError: this host cannot provide the isolation.
        SandboxError: the sandbox failed to start or broke down.
    """
    check_request(request.code, request.filename, request.limits, request.files)
    if request.files and request.workspace_dir is not None:
        raise ConfigError(
            "input files and a workspace directory were both given",
            hint="put the files in the workspace directory, or pass no workspace",
        )
    sandbox = start(
        spec_for(request),
        request.limits,
        backend,
        workspace_dir=request.workspace_dir,
        templates=templates,
    )
    try:
        return run_in(sandbox, request, backend_name=backend.name)
    finally:
        # A forked one is destroyed by its templates' keeper, after the answer (and the
        # next one forked ahead, with prefork); one started anew here.
        if templates is None or not templates.release(sandbox):
            sandbox.destroy()


def start(
    spec: SandboxSpec,
    limits: Limits,
    backend: Backend,
    *,
    workspace_dir: Path | None = None,
    pooled: bool = False,
    templates: Templates | None = None,
    as_template: bool = False,
) -> StartedSandbox:
    """Start one sandbox made as `spec` says, its cgroup set to `limits`; do not wait for
    the guest. Everything it creates is undone by `StartedSandbox.destroy()`. A `pooled`
    one will wait for its request a while: its guest warms up more before it is ready.

    With `templates` (a fork server), a sandbox of a spec they serve is forked from its
    template instead of started anew (engine/forkserver.py); `as_template` starts such a
    template (it never runs a request: it forks sandboxes).

    Raises:
        HostError: this host cannot provide the isolation.
        SandboxError: the sandbox failed to start.
    """
    if workspace_dir is not None and not backend.lends_directories:
        raise ConfigError(
            f"the {backend.name} backend cannot lend a directory: it cannot keep the "
            "entries the host would run (.git/hooks, .bashrc, *.pth, ...) read-only inside "
            "it (docs/security-model.md)",
            hint="omit {workspace} (pass input files instead), or choose a backend that "
            "lends directories (`codecage info` lists this host's backends)",
        )
    if templates is not None and workspace_dir is None:
        forked = templates.fork(spec, limits)
        if forked is not None:
            return forked
    execution_id = uuid.uuid4().hex
    found = launch.facts(spec)  # before anything is made: see `launch.facts`
    started_at = time.monotonic()
    cleanup = contextlib.ExitStack()
    try:
        held = launch.acquire(
            spec,
            found,
            backend,
            cleanup,
            execution_id=execution_id,
            workspace_dir=workspace_dir,
            as_template=as_template,
        )
        planned = plans.plan(
            spec, limits, backend, found, held.resources, pooled=pooled, as_template=as_template
        )
        proc, cgroup = _launch(planned, backend, cleanup)
        held.channel.close_guest_ends()
    except BaseException:
        cleanup.close()
        raise
    return StartedSandbox(
        execution_id=execution_id,
        spec=spec,
        proc=proc,
        channel=held.channel,
        cgroup=cgroup,
        workspace=held.workspace,
        cgroup_limits=limits,
        started_at=started_at,
        cleanup=cleanup,
        lost=backend.lost_layers,
        guest_rlimits=backend.host_overhead.guest_rlimits,
        egress=held.egress,
        identity=planned.identity,
        plan=planned,
        # In the host's user namespace (Landlock), RLIMIT_NPROC counts every process of
        # the host uid: the run's own alone when the id is its own.
        shares_user_namespace=backend.shares_host_user_namespace and not held.own_id,
    )


def _launch(
    planned: plans.LaunchPlan, backend: Backend, cleanup: contextlib.ExitStack
) -> tuple[SandboxProcess, CgroupHandle | None]:
    """Carry out `planned`: make its cgroup, hand it to `backend`, and admit its first
    process to the cgroup before anything of the guest runs; both undone by `cleanup`.

    Raises:
        HostError: the cgroup cannot be made.
        SandboxError: the sandbox failed to start, or its first process is not the
            identity planned.
    """
    wanted = planned.cgroup
    cgroup = cgroups.create(
        wanted.name,
        wanted.limits,
        extra_pids=wanted.extra_pids,
        pids_per_process=wanted.pids_per_process,
        extra_memory_mb=wanted.extra_memory_mb,
    )
    if cgroup is not None:
        cleanup.callback(cgroups.destroy, cgroup)
    proc = backend.start(
        planned.launch_spec(launch.sandbox_filter(planned.seccomp)),
        # Between "namespaces made" and "guest starts": never host root (checked on the
        # process itself), and what the guest starts, and every process it makes, is in
        # the run's cgroup from its first instruction.
        on_created=functools.partial(_on_created, cgroup, expected=planned.expected),
    )
    cleanup.callback(proc.close)
    return proc, cgroup


def _on_created(cgroup: CgroupHandle | None, pid: int, *, expected: Identity | None) -> None:
    """Check the sandbox's first process is `expected` on the host (its own id, never
    root; None: a backend whose launcher is root's, checked its own way), then give it
    its cgroup.

    Raises:
        SandboxError: it is host root, or another id than the one it was lent.
    """
    if expected is not None:
        ids = identities.ensure_not_root(pid)
        if (ids.uid, ids.gid) != (expected.uid, expected.gid):
            raise SandboxError(
                f"refused: the sandbox runs as host uid {ids.uid}, gid {ids.gid}, not the "
                f"uid {expected.uid}, gid {expected.gid} it was given",
                hint="report this: the backend did not drop to the run's own id",
            )
    if cgroup is not None:
        cgroups.attach(cgroup, pid)


def prepare(spec: SandboxSpec) -> None:
    """Find now what a sandbox of `spec` binds (the interpreter's and the tools'
    libraries, the packages' files, the guest's bytecode), which `start` would otherwise
    do on its first call: the first time, with an empty cache, that reads every package's
    RECORD and runs ldd, seconds on a busy host. A warm pool's sandboxes are then started
    (and, when the process stops early, destroyed) without waiting for it.

    Raises:
        HostError: the host facts cannot be found (ldd fails, the cache is not writable).
    """
    launch.facts(spec)


def wait_ready(sandbox: StartedSandbox, timeout_s: float) -> None:
    """Wait for the guest's "ready" message (it has started and preloaded its modules).

    Raises:
        SandboxError: the guest died, said something else, or did not get ready in time.
    """
    sock = sandbox.channel.host_control
    deadline = time.monotonic() + timeout_s
    data = b""
    with selectors.DefaultSelector() as sel:
        sel.register(sock, selectors.EVENT_READ)
        while not data.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0 or not sel.select(left):
                raise SandboxError(f"the sandbox did not get ready within {timeout_s:g} s")
            chunk = sock.recv(4096)
            if not chunk or len(data) > 4096:
                raise SandboxError("the sandbox failed to start: " + _startup_failure(sandbox))
            data += chunk
    try:
        sandbox.ready_pid = GuestReady.model_validate_json(data).pid
    except ValidationError as exc:
        raise SandboxError(f"unexpected first message from the guest: {data[:200]!r}") from exc
    if sandbox.cgroup is not None:
        # The run's peak counts from here, not from the start-up's (v1; see the function);
        # its CPU time too (an idle guest waiting in recv() uses none).
        cgroups.reset_peak_memory(sandbox.cgroup)
        sandbox.baseline = _Baseline(
            cpu_ms=cgroups.cpu_usage_ms(sandbox.cgroup) or 0,
            oom_kills=cgroups.oom_kills(sandbox.cgroup),
        )


def _guest_limits(sandbox: StartedSandbox, limits: GuestLimits) -> GuestLimits:
    """No RLIMIT_NPROC in a sandbox that shares its user namespace (see StartedSandbox)."""
    if sandbox.shares_user_namespace and sandbox.cgroup is not None:
        return limits.model_copy(update={"max_processes": None})
    return limits


def _startup_failure(sandbox: StartedSandbox) -> str:
    """What the sandbox's stderr said before it died (it is small: nothing ran yet)."""
    with contextlib.suppress(subprocess.TimeoutExpired):
        sandbox.proc.wait(timeout=2)
    ended = sandbox.proc.poll()
    text = sandbox.proc.stderr.read(4096) if ended is not None else b""
    return neutralise(text).strip()[:2000] or (ended.describe() if ended else "still running")


class LimitsNotApplicable(SandboxError):
    """A started sandbox cannot take the request's limits (e.g. its preloaded modules
    already use more memory than asked for): run the request in a fresh one instead."""


@dataclass(frozen=True, slots=True)
class SessionRun:
    """A run in a session's sandbox (`engine.session`): the guest keeps its interpreter for
    the next run, the cgroup keeps the session's limits, and the CPU the run may use is
    its own seconds within what is left of the session's budget."""

    cpu_limit_ms: int  # this run's CPU: its own seconds, within the session's budget left
    session_cpu_seconds: int  # the whole session's (the guest's hard RLIMIT_CPU)


def run_in(
    sandbox: StartedSandbox,
    request: RunRequest,
    *,
    backend_name: str,
    session: SessionRun | None = None,
) -> ExecutionResult:
    """Run `request` in `sandbox` (started by `start`), which is used up by it (unless it
    is a `session`'s, which is ready again afterwards if it lives); the caller destroys it.

    Raises:
        LimitsNotApplicable: the sandbox cannot take this request's limits; it is unused.
        SandboxError: the sandbox failed to start or broke down.
    """
    if sandbox.used and session is None:
        raise SandboxError("a sandbox runs one request only")
    limits = request.limits
    baseline = (sandbox.baseline or _Baseline()) if session else apply_limits(sandbox, limits)
    sandbox.used = True
    if request.files:
        if sandbox.workspace.owned is False:
            raise ConfigError(
                "input files go into a fresh workspace only, not into a workspace directory",
                hint="put the files in the workspace directory, or pass no workspace",
            )
        # Nothing of the request has run yet: the guest waits for it (warm) or is starting.
        workspaces.write_files(
            sandbox.workspace,
            request.files,
            sandbox.spec.workspace_mb,
            replace=session is not None,  # a session's next version of its input
        )
    cgroup = sandbox.cgroup
    warm = sandbox.ready_pid is not None
    guest_request = GuestRequest(
        code=request.code,
        filename=request.filename,
        limits=_guest_limits(
            sandbox,
            rlimits.guest_limits(
                limits,
                by_cgroup=cgroup is not None and not sandbox.guest_rlimits,
                session_cpu_seconds=session.session_cpu_seconds if session else None,
                # On a kernel of its own (gVisor's Sentry) the guest is PID 1: no init of the
                # backend's shares its RLIMIT_NPROC count, so the code gets exactly its limit.
                init_processes=0 if sandbox.guest_rlimits else rlimits.SANDBOX_INIT_PROCESSES,
            ),
        ),
        return_value_max_bytes=RETURN_VALUE_MAX_BYTES,
        profile=request.policy.profile if request.policy else "",
        allowed_modules=sorted(request.policy.modules) if request.policy else None,
        face=request.face,
        installed_packages=_hint_packages(request.policy, request.context.packages_dir),
        wider_profile=request.context.wider_profile,
        session=session is not None,
        interrupt_after_s=limits.timeout if session is not None else None,
    )
    tool_bridge = bridge.Channel(
        sandbox.channel.host_bridge,
        request.tools or _no_servers(),
        request.context.tool_limits,
        cpu_seconds=limits.cpu_seconds,
    )
    tool_bridge.start()
    _grant_egress(sandbox, request)
    try:
        seen = _supervise(sandbox, request, guest_request, baseline, session)
    finally:
        bridge_events = tool_bridge.stop()
        bridge_events += egress_wiring.finish(sandbox.egress)
    if seen.reported and session is None:
        _tell_guest_to_stop(sandbox.channel.host_control)
    # A session's run that outlasted its timeout and came back: the guest's interrupt
    # stopped it (the host saw both the time and the interpreter answer again).
    seen.interrupted = session is not None and seen.reported and seen.wall_s >= limits.timeout
    said, report_events = judge.guest_messages(seen)
    judge.check_started(seen, said)
    usage = _usage(seen, cgroup, baseline)
    oom_kills = cgroups.oom_kills(cgroup) if cgroup is not None else 0
    oom = cgroup is not None and oom_kills > baseline.oom_kills
    if session is not None:
        _measure_next_run_apart(sandbox, baseline, usage, oom_kills)
    files, files_truncated = workspaces.list_files(sandbox.workspace.path)
    if request.on_files is not None:
        request.on_files(sandbox.workspace.path, files)
    result = judge.build_result(
        execution_id=sandbox.execution_id,
        backend=backend_name,
        limits=limits,
        policy=request.policy,
        degraded=(*request.degraded, *sandbox.lost),
        seen=seen,
        said=said,
        events=report_events + bridge_events,
        measured=judge.Measured(
            usage=usage,
            oom=oom,
            by_cgroup=cgroup is not None,
            files=files,
            files_truncated=files_truncated,
            workspace_full=_workspace_full(sandbox.workspace),
        ),
        egress=request.egress is not None,
    )
    log.info(
        "engine.run",
        extra={
            "execution_id": sandbox.execution_id,
            "backend": backend_name,
            "warm": warm,
            "status": result.status,
            "wall_ms": result.usage.wall_ms,
        },
    )
    return result


def _grant_egress(sandbox: StartedSandbox, request: RunRequest) -> None:
    """The run's hosts on its sandbox's socket, before the code can use it. A sandbox made
    without egress cannot get it (its spec is part of the pool's key)."""
    if request.egress is None:
        return
    if sandbox.egress is None:
        raise SandboxError("this sandbox was made without network; the run asked for hosts")
    sandbox.egress.grant(request.egress, request.context.network_limits)


def _supervise(
    sandbox: StartedSandbox,
    request: RunRequest,
    guest_request: GuestRequest,
    baseline: _Baseline,
    session: SessionRun | None,
) -> Observation:
    limits = request.limits
    warm = sandbox.ready_pid is not None
    tap = _output_stream(sandbox, request)
    try:
        return supervise(
            sandbox.proc,
            sandbox.channel.host_control,
            (guest_request.model_dump_json() + "\n").encode("utf-8"),
            kill=sandbox.kill,
            messages=ControlStream(_CONTROL_CAP_BYTES, ready_pid=sandbox.ready_pid),
            # A cold run's clock starts before the sandbox does; a warm one's at the request.
            started=time.monotonic() if warm else sandbox.started_at,
            # A session's run is interrupted by its guest at the timeout (then the session
            # lives on); the host kills the sandbox only if the code did not stop by then.
            wall_timeout_s=limits.timeout + (SESSION_INTERRUPT_GRACE_S if session else 0.0),
            cpu_limit_ms=session.cpu_limit_ms if session else limits.cpu_seconds * 1000,
            cpu_baseline_ms=baseline.cpu_ms,
            output_cap_bytes=limits.max_output_bytes,
            cgroup=sandbox.cgroup,
            cancel=request.cancel,
            on_output=tap.feed if tap is not None else None,
            keep_open=session is not None,
        )
    finally:
        if tap is not None:
            tap.close()  # the rest handed out before the result is made


def _output_stream(sandbox: StartedSandbox, request: RunRequest) -> streaming.OutputStream | None:
    if request.on_output is None:
        return None
    cap = request.limits.max_output_bytes
    return streaming.OutputStream(
        request.on_output,
        # The result keeps the head and tail of each stream, half each (supervise): what is
        # streamed is that head, so that a caller printing the tail after the run (the CLI)
        # shows the result's output, no line twice.
        cap_bytes=cap - cap // 2,
        scrub=request.scrub_output,
        execution_id=sandbox.execution_id,
    )


def _tell_guest_to_stop(control: socket.socket) -> None:
    """Answer the guest's "end": it stops itself rather than exit, and the sandbox is torn
    down when it is destroyed, not while the host answers its caller. Unanswered, it exits."""
    with contextlib.suppress(OSError):
        control.send(STOP_LINE)  # 22 bytes into an empty socket buffer: never blocks


@functools.cache
def _no_servers() -> bridge.NoServers:
    """The tool bridge's answerer when no upstream servers are configured: scrub() works
    (with the default detectors), tool calls fail with a clear error."""
    scrubber = scrubbing.Scrubber()
    return bridge.NoServers(lambda text: scrubber.scrub(text).text)


@dataclass(frozen=True, slots=True)
class _Baseline:
    """What a warm sandbox had used before its request (interpreter start, preloading):
    subtracted, so that the request's limits and usage count the user's code only."""

    cpu_ms: int = 0
    oom_kills: int = 0


def _measure_next_run_apart(
    sandbox: StartedSandbox, baseline: _Baseline, usage: Usage, oom_kills: int
) -> None:
    """A session's next run counts from where this one ended (its CPU, its OOM kills, its
    peak memory on v1): measured now, with what this run read anyway, rather than by three
    more reads of the cgroup before the next. CPU its threads use between runs counts
    towards the next run."""
    cgroup = sandbox.cgroup
    if cgroup is None:
        return
    sandbox.baseline = _Baseline(cpu_ms=baseline.cpu_ms + (usage.cpu_ms or 0), oom_kills=oom_kills)
    cgroups.reset_peak_memory(cgroup)


def apply_limits(sandbox: StartedSandbox, limits: Limits) -> _Baseline:
    cgroup = sandbox.cgroup
    if cgroup is None or sandbox.baseline is None:  # cold: made for this request
        return _Baseline()
    if limits != sandbox.cgroup_limits:
        try:
            cgroups.set_limits(cgroup, limits, previous=sandbox.cgroup_limits)
        except OSError as exc:
            raise LimitsNotApplicable(f"cannot set the warm sandbox's limits: {exc}") from exc
        sandbox.cgroup_limits = limits
    return sandbox.baseline


def _hint_packages(policy: ImportPolicy | None, packages_dir: Path | None) -> list[str]:
    """What a refusal may suggest allowing (the host's data packages and those the operator
    added); nothing to send where nothing is refused."""
    if policy is None or policy.allows_every_module:
        return []
    added = packages.installed(packages_dir).top_level() if packages_dir else frozenset()
    return sorted(set(profiles.installed_packages()) | added)


def _usage(seen: Observation, cgroup: CgroupHandle | None, baseline: _Baseline) -> Usage:
    cpu_ms = cgroups.cpu_usage_ms(cgroup) if cgroup is not None else None
    return Usage(
        wall_ms=int(seen.wall_s * 1000),
        cpu_ms=None if cpu_ms is None else max(0, cpu_ms - baseline.cpu_ms),
        peak_memory_mb=cgroups.peak_memory_mb(cgroup) if cgroup is not None else None,
    )


def _workspace_full(ws: workspaces.Workspace) -> Event | None:
    """The size-limited workspace tmpfs ran out of space or inodes during the run."""
    if not ws.tmpfs:
        return None
    try:
        st = os.statvfs(ws.path)
    except OSError:
        return None
    if st.f_bavail > 0 and st.f_favail > 0:
        return None
    what = "space" if st.f_bavail == 0 else "inodes"
    return Event(
        kind="workspace_full",
        detail=f"/workspace ran out of {what}; raise --workspace-mb or write less",
    )
