"""One execution, end to end: prepare, launch, supervise, judge, collect, clean up.

`execute()` reads top to bottom as the ordered list of steps; everything it creates is
registered on an ExitStack, so every exit path (ok, timeout, exception, Ctrl-C) kills the
sandbox, removes its cgroup, unmounts and deletes its workspace and temp dir.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import selectors
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from codecage import packages
from codecage.backends.base import Backend, LaunchSpec
from codecage.bridge import channel as bridge
from codecage.bridge.tooling import SERVERS_DIR_PREFIX
from codecage.engine import workspace as workspaces
from codecage.engine.supervise import Observation, supervise
from codecage.errors import ConfigError, Face, SandboxError
from codecage.guest.contract import STOP_LINE
from codecage.isolation import limits as cgroups
from codecage.isolation import rootfs, seccomp, shell
from codecage.isolation.limits import CgroupHandle
from codecage.models import (
    MAX_CODE_BYTES,
    Ceilings,
    ErrorInfo,
    Event,
    ExecutionResult,
    FileInfo,
    GuestEnd,
    GuestReady,
    GuestRequest,
    GuestResult,
    Limits,
    Status,
    Usage,
)
from codecage.output import neutralise, neutralise_text
from codecage.policy import profiles
from codecage.policy import scrub as scrubbing
from codecage.policy.profiles import ImportPolicy

log = logging.getLogger(__name__)

RETURN_VALUE_MAX_BYTES = 1024 * 1024
RUN_DIR_PREFIX = "codecage-run-"
_CONTROL_CAP_BYTES = 2 * RETURN_VALUE_MAX_BYTES + 256 * 1024
_SIGNAL_EXIT_BASE = 128  # bwrap reports a child killed by signal N as exit code 128 + N
_SIGXCPU_EXIT = _SIGNAL_EXIT_BASE + signal.SIGXCPU


@dataclass(frozen=True, slots=True)
class RunRequest:
    """One validated request to run code."""

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
    tool_limits: bridge.BridgeLimits = field(default_factory=bridge.BridgeLimits)
    servers_dir: Path | None = None  # see SandboxSpec
    skills_dir: Path | None = None
    packages_dir: Path | None = None
    face: Face = "library"  # who asked: an import refusal's hint is worded for it
    wider_profile: str | None = None  # an enabled profile that refuses nothing, for hints


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


@dataclass(frozen=True, slots=True)
class SandboxSpec:
    """What a sandbox is made with and cannot change once it started: the warm pool keys
    its sandboxes by this. Per-run limits are not part of it (see `run_in`)."""

    policy: ImportPolicy | None = None
    workspace_mb: int = Limits.model_fields["workspace_mb"].default
    tmp_mb: int = Limits.model_fields["tmp_mb"].default
    preload: tuple[str, ...] = ()  # modules the guest imports before it says it is ready
    servers_dir: Path | None = None  # `codecage gen`'s tree, read-only at /servers
    skills_dir: Path | None = None  # reusable functions, read-only at /skills
    packages_dir: Path | None = None  # the operator's added packages, at /opt/packages

    @classmethod
    def for_request(cls, request: RunRequest) -> SandboxSpec:
        return cls(
            policy=request.policy,
            workspace_mb=request.limits.workspace_mb,
            tmp_mb=request.limits.tmp_mb,
            servers_dir=request.servers_dir,
            skills_dir=request.skills_dir,
            packages_dir=request.packages_dir,
        )


@dataclass(slots=True)
class StartedSandbox:
    """One sandbox, started: namespaces made, moved into its cgroup, the guest coming up
    (or, once `ready_pid` is set, waiting for its one request). Used once, then destroyed."""

    execution_id: str
    spec: SandboxSpec
    proc: subprocess.Popen[bytes]
    channel: _Channels
    cgroup: CgroupHandle | None
    workspace: workspaces.Workspace
    cgroup_limits: Limits  # what its cgroup is set to now
    started_at: float
    cleanup: contextlib.ExitStack
    ready_pid: int | None = None
    baseline: _Baseline | None = None  # what it used before its request (see wait_ready)
    used: bool = False

    def alive(self) -> bool:
        return self.proc.poll() is None

    def destroy(self) -> None:
        """Kill it and remove everything it had; idempotent."""
        self.cleanup.close()


def execute(request: RunRequest, backend: Backend) -> ExecutionResult:
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
        SandboxSpec.for_request(request),
        request.limits,
        backend,
        workspace_dir=request.workspace_dir,
    )
    try:
        return run_in(sandbox, request, backend_name=backend.name)
    finally:
        sandbox.destroy()


def start(
    spec: SandboxSpec,
    limits: Limits,
    backend: Backend,
    *,
    workspace_dir: Path | None = None,
    pooled: bool = False,
) -> StartedSandbox:
    """Start one sandbox made as `spec` says, its cgroup set to `limits`; do not wait for
    the guest. Everything it creates is undone by `StartedSandbox.destroy()`. A `pooled`
    one will wait for its request a while: its guest warms up more before it is ready.

    Raises:
        HostError: this host cannot provide the isolation.
        SandboxError: the sandbox failed to start.
    """
    execution_id = uuid.uuid4().hex
    interpreter = rootfs.find_interpreter()
    bpf = _sandbox_filter()
    started_at = time.monotonic()
    # Worked out before anything is created: a process killed meanwhile (the first time,
    # with an empty cache, it takes seconds) must leave no run directory, mount or cgroup.
    binds = _binds(spec, interpreter)
    cleanup = contextlib.ExitStack()
    try:
        run_dir = _make_run_dir(cleanup)
        ws = _prepare_workspace(workspace_dir, spec.workspace_mb, run_dir, cleanup)
        rootfs.write_etc(run_dir / "etc")
        (run_dir / "empty").mkdir(mode=0o555)
        rootfs.write_empty_file(run_dir)
        cgroup = cgroups.create(f"{os.getpid()}-{execution_id}", limits)
        if cgroup is not None:
            cleanup.callback(_destroy_cgroup, cgroup)
        mounts = (
            rootfs.plan(
                interpreter,
                workspace=ws.path,
                etc_dir=run_dir / "etc",
                empty_dir=run_dir / "empty",
                tmp_bytes=spec.tmp_mb * cgroups.MiB,
            )
            + binds
        )
        channel = _Channels.open(cleanup, bpf)
        env = _sandbox_env(interpreter)
        plan = backend.launch_plan(
            LaunchSpec(
                mounts=mounts,
                env=env,
                guest_argv=_guest_argv(channel, spec.preload, pooled=pooled),
                seccomp_fd=channel.seccomp_fd,
                info_fd=channel.info_write,
                block_fd=channel.block_read,
                control_fd=channel.guest_control_fd,
                bridge_fd=channel.guest_bridge.fileno(),
            )
        )
        log.debug("engine.launch", extra={"execution_id": execution_id, "argv": plan.argv})
        proc = _spawn(plan.argv, plan.pass_fds, env, run_dir)
        cleanup.callback(_reap, proc)
        channel.close_guest_ends()
        _place_in_cgroup(proc, channel, cgroup)
    except BaseException:
        cleanup.close()
        raise
    return StartedSandbox(
        execution_id=execution_id,
        spec=spec,
        proc=proc,
        channel=channel,
        cgroup=cgroup,
        workspace=ws,
        cgroup_limits=limits,
        started_at=started_at,
        cleanup=cleanup,
    )


def prepare(spec: SandboxSpec) -> None:
    """Work out now what a sandbox of `spec` binds (the interpreter's and the tools'
    libraries, the packages' files, the guest's bytecode), which `start` would otherwise
    do on its first call: the first time, with an empty cache, that reads every package's
    RECORD and runs ldd, seconds on a busy host. A warm pool's sandboxes are then started
    (and, when the process stops early, destroyed) without waiting for it.

    Raises:
        HostError: the host facts cannot be found (ldd fails, the cache is not writable).
    """
    interpreter = rootfs.find_interpreter()
    rootfs.bootstrap_bytecode()
    _binds(spec, interpreter)


def _binds(spec: SandboxSpec, interpreter: rootfs.Interpreter) -> tuple[rootfs.Mount, ...]:
    """What a sandbox binds besides its root: tools, packages, the tool trees."""
    return (
        _shell_mounts(interpreter)
        + _package_mounts(spec.policy, interpreter)
        + _added_package_mounts(spec, interpreter)
        + _tool_tree_mounts(spec)
    )


def _shell_mounts(interpreter: rootfs.Interpreter) -> tuple[rootfs.Mount, ...]:
    """The shell and command-line tools (isolation/shell.py), minus libraries already bound."""
    return shell.mounts(shell.find(), already_bound=frozenset(map(str, interpreter.libraries)))


@functools.cache
def _sandbox_filter() -> bytes:
    """The seccomp filter every sandbox gets: the same program each time, so compiled once
    (~3 ms of every cold start otherwise)."""
    return seccomp.compile_bpf(seccomp.plan(network=False))


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


def _startup_failure(sandbox: StartedSandbox) -> str:
    """What the sandbox's stderr said before it died (it is small: nothing ran yet)."""
    with contextlib.suppress(subprocess.TimeoutExpired):
        sandbox.proc.wait(timeout=2)
    stderr = sandbox.proc.stderr
    text = b""
    if stderr is not None and sandbox.proc.poll() is not None:
        text = stderr.read(4096)
    return neutralise(text).strip()[:2000] or f"exit {sandbox.proc.returncode}"


class LimitsNotApplicable(SandboxError):
    """A started sandbox cannot take the request's limits (e.g. its preloaded modules
    already use more memory than asked for): run the request in a fresh one instead."""


def run_in(sandbox: StartedSandbox, request: RunRequest, *, backend_name: str) -> ExecutionResult:
    """Run `request` in `sandbox` (started by `start`), which is used up by it; the caller
    destroys it.

    Raises:
        LimitsNotApplicable: the sandbox cannot take this request's limits; it is unused.
        SandboxError: the sandbox failed to start or broke down.
    """
    if sandbox.used:
        raise SandboxError("a sandbox runs one request only")
    limits = request.limits
    baseline = _apply_late_limits(sandbox, limits)
    sandbox.used = True
    if request.files:
        if sandbox.workspace.owned is False:
            raise ConfigError(
                "input files go into a fresh workspace only, not into a workspace directory",
                hint="put the files in the workspace directory, or pass no workspace",
            )
        # Nothing of the request has run yet: the guest waits for it (warm) or is starting.
        workspaces.write_files(sandbox.workspace, request.files, sandbox.spec.workspace_mb)
    cgroup = sandbox.cgroup
    warm = sandbox.ready_pid is not None
    guest_request = GuestRequest(
        code=request.code,
        filename=request.filename,
        limits=cgroups.guest_limits(limits, by_cgroup=cgroup is not None),
        return_value_max_bytes=RETURN_VALUE_MAX_BYTES,
        profile=request.policy.profile if request.policy else "",
        allowed_modules=sorted(request.policy.modules) if request.policy else None,
        face=request.face,
        installed_packages=_hint_packages(request.policy, request.packages_dir),
        wider_profile=request.wider_profile,
    )
    tool_bridge = bridge.Channel(
        sandbox.channel.host_bridge,
        request.tools or _no_servers(),
        request.tool_limits,
        cpu_seconds=limits.cpu_seconds,
    )
    tool_bridge.start()
    try:
        seen = _supervise(sandbox, request, guest_request, baseline)
    finally:
        bridge_events = tool_bridge.stop()
    if seen.reported:
        _tell_guest_to_stop(sandbox.channel.host_control)
    said, report_events = _parse_control(seen, ready_pid=sandbox.ready_pid)
    if seen.reported and said.exit_code is not None:
        seen.returncode = said.exit_code  # it stops instead of exiting (the bootstrap's _end_run)
    if not said.ready and not (seen.timed_out or seen.cpu_exceeded or seen.cancelled):
        raise SandboxError(
            "the sandbox failed to start: "
            + (neutralise(seen.stderr.data).strip()[:2000] or f"exit {seen.returncode}"),
            hint="run {doctor} to check this host's isolation layers",
        )
    usage = _usage(seen, cgroup, baseline)
    oom = cgroup is not None and cgroups.oom_kills(cgroup) > baseline.oom_kills
    files, files_truncated = workspaces.list_files(sandbox.workspace.path)
    if request.on_files is not None:
        request.on_files(sandbox.workspace.path, files)
    result = _build_result(
        execution_id=sandbox.execution_id,
        request=request,
        backend=backend_name,
        seen=seen,
        report=said.report,
        events=report_events + bridge_events,
        usage=usage,
        oom=oom,
        files=files,
        files_truncated=files_truncated,
        by_cgroup=cgroup is not None,
        workspace_full=_workspace_full(sandbox.workspace),
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


def _supervise(
    sandbox: StartedSandbox, request: RunRequest, guest_request: GuestRequest, baseline: _Baseline
) -> Observation:
    limits = request.limits
    warm = sandbox.ready_pid is not None
    cgroup = sandbox.cgroup
    return supervise(
        sandbox.proc,
        sandbox.channel.host_control,
        (guest_request.model_dump_json() + "\n").encode("utf-8"),
        # A cold run's clock starts before the sandbox does; a warm one's at the request.
        started=time.monotonic() if warm else sandbox.started_at,
        wall_timeout_s=limits.timeout,
        cpu_limit_ms=limits.cpu_seconds * 1000,
        cpu_baseline_ms=baseline.cpu_ms,
        output_cap_bytes=limits.max_output_bytes,
        control_cap_bytes=_CONTROL_CAP_BYTES,
        cgroup=cgroup,
        reported=functools.partial(_has_ended, ready_pid=sandbox.ready_pid),
        cancel=request.cancel,
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


def _has_ended(data: bytes, *, ready_pid: int | None) -> bool:
    """Whether the control data holds the main process's "end" (see supervise)."""
    if not data.endswith(b"\n") or b'"end"' not in data:
        return False
    said = _parse_control_lines(data, ready_pid=ready_pid)
    return said.ready and said.exit_code is not None


@dataclass(frozen=True, slots=True)
class _Baseline:
    """What a warm sandbox had used before its request (interpreter start, preloading):
    subtracted, so that the request's limits and usage count the user's code only."""

    cpu_ms: int = 0
    oom_kills: int = 0


def _apply_late_limits(sandbox: StartedSandbox, limits: Limits) -> _Baseline:
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


# --- preparation -----------------------------------------------------------------------


def sweep_stale_runs() -> int:
    """Remove what runs of dead codecage processes left behind (a host process killed with
    SIGKILL cannot clean up): their run dirs, workspace mounts, generated tool trees and
    cgroups. Returns how many were removed. Runs of live processes are never touched.

    Run dirs and tool trees live in `workspaces.private_parent()` (0700, ours), and are
    swept through descriptors (`workspaces.sweep_stale`): no other user can put a name
    there, and a name swapped for a symlink is never followed."""
    removed = workspaces.sweep_stale((RUN_DIR_PREFIX, SERVERS_DIR_PREFIX), _owned_by_dead_process)
    removed += cgroups.sweep_stale(_owned_by_dead_process)
    if removed:
        log.warning("engine.stale_runs_removed", extra={"count": removed})
    return removed


def _owned_by_dead_process(name: str) -> bool:
    """Run dirs and cgroups are named "<host pid>-...": is that process gone?"""
    head, _, _ = name.partition("-")
    return head.isdigit() and not _alive(int(head))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _hint_packages(policy: ImportPolicy | None, packages_dir: Path | None) -> list[str]:
    """What a refusal may suggest allowing (the host's data packages and those the operator
    added); nothing to send where nothing is refused."""
    if policy is None or policy.allows_every_module:
        return []
    added = packages.installed(packages_dir).top_level() if packages_dir else frozenset()
    return sorted(set(profiles.installed_packages()) | added)


def _package_mounts(
    policy: ImportPolicy | None, interpreter: rootfs.Interpreter
) -> tuple[rootfs.Mount, ...]:
    """Third-party packages the policy allows, bound read-only: those a curated profile
    names, or every installed data package under the default profile or no policy."""
    packages = rootfs.packages_for(profiles.packages_to_bind(policy))
    known = {str(lib) for lib in interpreter.libraries}
    return tuple(
        m for m in rootfs.package_mounts(packages) if m.kind != "ro-bind" or m.dest not in known
    )


def _added_package_mounts(
    spec: SandboxSpec, interpreter: rootfs.Interpreter
) -> tuple[rootfs.Mount, ...]:
    """The packages the operator added (`codecage packages`), read-only at /opt/packages
    when the policy allows any of them (codecage.packages.mounts)."""
    if spec.packages_dir is None:
        return ()
    known = frozenset(map(str, interpreter.libraries))
    return packages.mounts(spec.packages_dir, spec.policy, known=known)


def _tool_tree_mounts(spec: SandboxSpec) -> tuple[rootfs.Mount, ...]:
    """The generated tool modules and the skills, read-only: at /servers and /skills to
    read (search_tools), and under the guest package root to import (`servers.x.y`)."""
    mounts: list[rootfs.Mount] = []
    for name, source in (("servers", spec.servers_dir), ("skills", spec.skills_dir)):
        if source is None:
            continue
        if not source.is_dir():
            raise ConfigError(
                f"the {name} directory {source} does not exist",
                hint="run `codecage gen --mcp-config FILE` first"
                if name == "servers"
                else "check the path given with --skills-dir",
            )
        mounts.append(rootfs.Mount("ro-bind", f"/{name}", str(source.resolve())))
        mounts.append(
            rootfs.Mount("ro-bind", f"{rootfs.GUEST_PACKAGE_ROOT}/{name}", str(source.resolve()))
        )
    return tuple(mounts)


def _make_run_dir(cleanup: contextlib.ExitStack) -> Path:
    # The host pid in the name lets a later process clean up after one that was killed; the
    # private parent (not /tmp itself) keeps other users from planting names to be swept.
    run_dir = Path(
        tempfile.mkdtemp(prefix=f"{RUN_DIR_PREFIX}{os.getpid()}-", dir=workspaces.private_parent())
    )  # mode 0700
    cleanup.callback(shutil.rmtree, run_dir, ignore_errors=True)
    return run_dir


def _prepare_workspace(
    workspace_dir: Path | None, size_mb: int, run_dir: Path, cleanup: contextlib.ExitStack
) -> workspaces.Workspace:
    if workspace_dir is not None:
        ws = workspaces.use_existing(workspace_dir)
    else:
        ws = workspaces.create_ephemeral(run_dir, size_mb)
    cleanup.callback(workspaces.destroy, ws)
    if not ws.owned:
        # A user's directory outlives the run. ExitStack is LIFO, so this runs after the
        # sandbox is reaped, on every exit path.
        cleanup.callback(_hand_back, ws.path, workspaces.save_root(ws))
    return ws


def _hand_back(path: Path, root: workspaces.RootState) -> None:
    """Give a user's --workspace DIR back as it was lent: no setuid/setgid file planted in
    it (seccomp refuses setting the bits; this is the second layer), and DIR itself with
    its own mode and owner again (the code may chmod /workspace, e.g. to 01777). The bits
    the operator had set on DIR are the operator's: neither step takes them away."""
    try:
        workspaces.strip_privilege_bits(path, keep_on_root=root.mode)
    finally:
        workspaces.restore_root(root)


@dataclass(slots=True)
class _Channels:
    """The fds shared with one sandbox; the host closes the guest's ends once it started.

    Each fd is closed exactly once: a second close of a number that another thread has
    reused in the meantime would close *its* fd (runs happen concurrently).
    """

    seccomp_fd: int
    info_read: int
    info_write: int
    block_read: int
    block_write: int
    host_control: socket.socket
    guest_control: socket.socket
    host_bridge: socket.socket  # the tool bridge (docs/tool-bridge.md)
    guest_bridge: socket.socket
    _open: set[int]

    @property
    def guest_control_fd(self) -> int:
        return self.guest_control.fileno()

    @classmethod
    def open(cls, cleanup: contextlib.ExitStack, bpf: bytes) -> _Channels:
        seccomp_fd = os.memfd_create("codecage-seccomp", os.MFD_CLOEXEC)
        fds = {seccomp_fd}
        sockets: list[socket.socket] = []
        channel: _Channels | None = None
        try:
            os.write(seccomp_fd, bpf)
            os.lseek(seccomp_fd, 0, os.SEEK_SET)
            info_read, info_write = os.pipe()
            fds |= {info_read, info_write}
            block_read, block_write = os.pipe()
            fds |= {block_read, block_write}
            host, guest = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            sockets = [host, guest]
            host_bridge, guest_bridge = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            sockets += [host_bridge, guest_bridge]
            channel = cls(
                seccomp_fd,
                info_read,
                info_write,
                block_read,
                block_write,
                host,
                guest,
                host_bridge,
                guest_bridge,
                fds,
            )
        finally:
            if channel is None:
                for fd in fds:
                    _close_quietly(fd)
                for sock in sockets:
                    sock.close()
        cleanup.callback(channel.close_all)
        return channel

    def close(self, fd: int) -> None:
        if fd in self._open:
            self._open.discard(fd)
            _close_quietly(fd)

    def close_guest_ends(self) -> None:
        for fd in (self.info_write, self.block_read, self.seccomp_fd):
            self.close(fd)
        self.guest_control.close()
        self.guest_bridge.close()

    def close_all(self) -> None:
        for fd in list(self._open):
            self.close(fd)
        for sock in (self.guest_control, self.host_control, self.guest_bridge, self.host_bridge):
            sock.close()


def _close_quietly(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)


def _sandbox_env(interpreter: rootfs.Interpreter) -> dict[str, str]:
    """The sandbox's whole environment: a fixed allow-list, nothing from the host."""
    env = {
        "PATH": f"{rootfs.GUEST_PREFIX}/bin:{shell.GUEST_BIN}:/bin",
        "HOME": rootfs.WORKSPACE,
        "LANG": "C.UTF-8",
        "TMPDIR": "/tmp",  # noqa: S108 - the sandbox's own private tmpfs
        # matplotlib: draw to files (no display), and keep its cache in the private /tmp.
        "MPLBACKEND": "Agg",
        "MPLCONFIGDIR": "/tmp/matplotlib",  # noqa: S108
    }
    library_path = rootfs.library_path(interpreter)
    if library_path is not None:
        env["LD_LIBRARY_PATH"] = library_path
    return env


def _guest_argv(channel: _Channels, preload: tuple[str, ...], *, pooled: bool) -> tuple[str, ...]:
    # -I: isolated (no env vars, no user site, no cwd on sys.path); -S: no site module, so
    # no .pth files run; -B: no bytecode writes; utf8 mode: text I/O is UTF-8 whatever LANG.
    argv: tuple[str, ...] = (
        rootfs.GUEST_PYTHON,
        "-I",
        "-S",
        "-B",
        "-X",
        "utf8",
        rootfs.GUEST_BOOTSTRAP_PYC,
        "--control-fd",
        str(channel.guest_control_fd),
        "--bridge-fd",
        str(channel.guest_bridge.fileno()),
    )
    if pooled:
        argv = (*argv, "--pooled")
    return (*argv, "--preload", ",".join(preload)) if preload else argv


def _spawn(
    argv: list[str], pass_fds: tuple[int, ...], env: dict[str, str], cwd: Path
) -> subprocess.Popen[bytes]:
    try:
        return subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            pass_fds=pass_fds,
            env=env,
            cwd=cwd,
            process_group=0,
        )
    except OSError as exc:
        raise SandboxError(f"cannot start the sandbox: {exc}") from exc


def _place_in_cgroup(
    proc: subprocess.Popen[bytes], channel: _Channels, cgroup: CgroupHandle | None
) -> None:
    """Wait until bwrap made the namespaces, move its PID 1 into the run's cgroup, then let
    it start the guest, which inherits the cgroup. Nothing of the user's runs before this."""
    info = _read_info(channel.info_read)
    if cgroup is not None and info is not None:
        cgroups.attach(cgroup, info)
    with contextlib.suppress(OSError):
        os.write(channel.block_write, b"1")


def _read_info(fd: int) -> int | None:
    data = b""
    while not data.endswith(b"}\n") and len(data) < 65536:
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        data += chunk
    if not data:
        return None  # bwrap failed before making the namespaces; its stderr says why
    try:
        pid = json.loads(data)["child-pid"]
    except (ValueError, KeyError) as exc:
        raise SandboxError(f"unexpected bwrap info: {data[:200]!r}") from exc
    return int(pid)


def _reap(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
    proc.wait()
    for stream in (proc.stdout, proc.stderr):
        if stream is not None:
            stream.close()


def _destroy_cgroup(cgroup: CgroupHandle) -> None:
    cgroups.kill_all(cgroup)
    cgroups.remove(cgroup)


# --- judging ---------------------------------------------------------------------------


@dataclass(slots=True)
class _GuestMessages:
    """What the guest said on the control socket, validated."""

    ready: bool = False
    report: GuestResult | None = None
    exit_code: int | None = None  # from the main process's "end": the run is over
    problems: list[str] = field(default_factory=list)  # what was malformed


def _parse_control(
    seen: Observation, *, ready_pid: int | None
) -> tuple[_GuestMessages, list[Event]]:
    """The guest's messages, validated. Anything malformed is noted once, never trusted."""
    said = _parse_control_lines(seen.control.data, ready_pid=ready_pid)
    problems = said.problems
    if seen.control.truncated:
        problems.insert(0, "the guest's messages were over the size bound")
    events = []
    if problems:
        detail = f"ignored {len(problems)} malformed guest message(s); first: {problems[0]}"
        events.append(Event(kind="guest_report_invalid", detail=detail[:300]))
    return said, events


def _parse_control_lines(data: bytes, *, ready_pid: int | None) -> _GuestMessages:
    """Whether the guest got ready, its final report and exit code, and what was malformed.

    The bootstrap sends its result after the user's code has finished, then "end", so the
    *last* valid messages of the main process (the pid it announced as ready, before any
    user code ran) win: what the code wrote to the control socket earlier, and the reports
    of processes it forked (they return through the bootstrap too), are overridden or
    ignored. A warm sandbox said it was ready (`ready_pid`) before the request was sent.
    """
    said = _GuestMessages(ready=ready_pid is not None)
    main_pid = ready_pid
    for line in data.split(b"\n"):
        if not line:
            continue
        try:
            message: dict[str, Any] = json.loads(line)
            kind = message.get("kind")
            if kind == "ready" and not said.ready:
                main_pid = GuestReady.model_validate(message).pid
                said.ready = True
            elif kind == "result":
                report = GuestResult.model_validate(message)
                if report.pid == main_pid:
                    said.report = report
            elif kind == "end":
                end = GuestEnd.model_validate(message)
                if end.pid == main_pid:
                    said.exit_code = end.exit_code
            else:
                raise ValueError("unexpected message")
        except (ValueError, ValidationError) as exc:
            said.problems.append(str(exc))
    return said


def _usage(seen: Observation, cgroup: CgroupHandle | None, baseline: _Baseline) -> Usage:
    cpu_ms = cgroups.cpu_usage_ms(cgroup) if cgroup is not None else None
    return Usage(
        wall_ms=int(seen.wall_s * 1000),
        cpu_ms=None if cpu_ms is None else max(0, cpu_ms - baseline.cpu_ms),
        peak_memory_mb=cgroups.peak_memory_mb(cgroup) if cgroup is not None else None,
    )


def judge_status(
    seen: Observation, report: GuestResult | None, *, oom: bool, limits: Limits, usage: Usage
) -> tuple[Status, int | None, str | None]:
    """Status, exit code and signal name, from what the host observed.

    The guest's report only tells a voluntary exit (it reported, then exited) from a death
    by signal with the same exit code; it can never turn a limit into "ok".
    """
    code = seen.returncode
    signal_name: str | None = None
    if code is not None and code > _SIGNAL_EXIT_BASE and report is None:
        with contextlib.suppress(ValueError):
            signal_name = signal.Signals(code - _SIGNAL_EXIT_BASE).name
    elif code is not None and code < 0:  # bwrap itself was killed (e.g. its parent died)
        with contextlib.suppress(ValueError):
            signal_name = signal.Signals(-code).name
    exit_code = None if signal_name is not None or seen.killed_by_host else code
    if seen.timed_out:
        return "timeout", None, "SIGKILL"
    if seen.cancelled:
        return "killed", None, "SIGKILL"
    cpu_used = usage.cpu_ms is not None and usage.cpu_ms >= limits.cpu_seconds * 1000
    if seen.cpu_exceeded or code == _SIGXCPU_EXIT or (cpu_used and code != 0):
        return "cpu_limit", None, signal_name or "SIGKILL"
    crashed = code != 0 or signal_name is not None
    if oom and crashed:
        return "memory_limit", exit_code, signal_name
    if signal_name is not None:
        return "killed", None, signal_name
    if code == 0:
        return "ok", 0, None
    return "error", exit_code, None


def _build_result(
    *,
    execution_id: str,
    request: RunRequest,
    backend: str,
    seen: Observation,
    report: GuestResult | None,
    events: list[Event],
    usage: Usage,
    oom: bool,
    files: list[FileInfo],
    files_truncated: bool,
    by_cgroup: bool,
    workspace_full: Event | None,
) -> ExecutionResult:
    limits = request.limits
    status, exit_code, signal_name = judge_status(seen, report, oom=oom, limits=limits, usage=usage)
    error = _error_of(report)
    if status == "memory_limit" and error is None:
        error = ErrorInfo(
            type="MemoryError",
            message=f"the sandbox was killed for using more than {limits.memory_mb} MiB",
            traceback="",
        )
    all_events = [*events, *_policy_events(request.policy), *_guest_events(report)]
    all_events += _limit_events(seen, files_truncated, limits)
    if seen.cancelled:
        all_events.append(Event(kind="cancelled", detail="the caller cancelled the run"))
    if workspace_full is not None:
        all_events.append(workspace_full)
    all_events += [
        Event(kind="degraded_isolation", detail=f"layer not in force: {layer}")
        for layer in request.degraded
    ]
    if not by_cgroup and status == "error" and error is not None and error.type == "MemoryError":
        # Without a memory cgroup the limit is RLIMIT_AS, which the host cannot observe:
        # hitting it surfaces as MemoryError. (With a cgroup, only an OOM kill counts.)
        status = "memory_limit"
    return ExecutionResult(
        execution_id=execution_id,
        status=status,
        exit_code=exit_code,
        signal=signal_name,
        stdout=neutralise(seen.stdout.data),
        stderr=neutralise(seen.stderr.data),
        stdout_truncated=seen.stdout.truncated,
        stderr_truncated=seen.stderr.truncated,
        return_value=_return_value_of(report, status),
        error=error,
        files=files,
        usage=usage,
        limits=limits,
        events=all_events,
        backend=backend,
    ).with_raw_output(seen.stdout.data, seen.stderr.data)


def _error_of(report: GuestResult | None) -> ErrorInfo | None:
    if report is None or report.error is None:
        return None
    e = report.error
    return ErrorInfo(
        type=neutralise_text(e.type)[:200],
        message=neutralise_text(e.message)[:10_000],
        traceback=neutralise_text(e.traceback)[:50_000],
    )


def _return_value_of(report: GuestResult | None, status: Status) -> Any:
    if report is None or status != "ok":
        return None
    # Data, kept as the code returned it: JSON escapes control characters, and the CLI's
    # human mode neutralises what it prints.
    return report.return_value


def _policy_events(policy: ImportPolicy | None) -> list[Event]:
    if policy is None or "network" not in policy.profile.split(","):
        return []
    return [
        Event(
            kind="network_denied",
            detail="the network profile allows network modules, but this sandbox has no "
            "network (no egress policy exists yet): connections will be refused",
        )
    ]


def _guest_events(report: GuestResult | None) -> list[Event]:
    if report is None:
        return []
    return [Event(kind=e.kind, detail=neutralise_text(e.detail)) for e in report.events]


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


def _limit_events(seen: Observation, files_truncated: bool, limits: Limits) -> list[Event]:
    events: list[Event] = []
    for name, buf in (("stdout", seen.stdout), ("stderr", seen.stderr)):
        if buf.truncated:
            events.append(
                Event(
                    kind="output_truncated",
                    detail=f"{name}: kept {limits.max_output_bytes} of {buf.total_bytes} bytes "
                    "(head and tail, the middle cut)",
                )
            )
    if files_truncated:
        events.append(
            Event(kind="files_truncated", detail="too many or too large files to list them all")
        )
    return events
