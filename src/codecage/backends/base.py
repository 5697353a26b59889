"""What every backend provides, the handle of a started sandbox, and the name -> backend table.

The engine describes a sandbox (`LaunchSpec`) and asks a backend to start it; the backend
hands back a `SandboxProcess`: the process the host holds, its output pipes, how to kill it
and its exit in backend-neutral terms (`ExitStatus`). How the backend does it (a command
line, a handshake, an exit-code convention) stays in its own module.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import select
import shutil
import signal
import subprocess
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Protocol, Self

from codecage.errors import ConfigError, HostError, SandboxError
from codecage.guest import contract
from codecage.isolation import userns
from codecage.isolation.identity import Identity
from codecage.isolation.rootfs import Mount
from codecage.models import BackendState, LayerStatus


@dataclass(frozen=True, slots=True)
class LaunchSpec:
    """Everything a backend needs to start one sandbox; fds are the host's, still open."""

    mounts: tuple[Mount, ...]
    env: dict[str, str]
    guest_argv: tuple[str, ...]
    seccomp: bytes  # the compiled filter (BPF) every process of the sandbox runs under
    cwd: Path  # the host directory the launcher runs in (the run's own directory)
    # The guest's end of the control socket and of the tool bridge (docs/tool-bridge.md),
    # passed under the same numbers; None: a sandbox without a guest bootstrap (a stdio
    # upstream server, `stdio`).
    control_fd: int | None = None
    bridge_fd: int | None = None
    identity: Identity | None = None  # None: the ids of the process that runs codecage
    network: bool = False
    # A fork server's template (engine/forkserver.py): it keeps CAP_SYS_ADMIN and
    # CAP_SETPCAP inside, to make each run's namespaces and mounts; its
    # `extra_fds` (the runs' filter) are passed under the same numbers. Only a backend
    # that `forks_templates`.
    template: bool = False
    extra_fds: tuple[int, ...] = ()
    chdir: str = contract.WORKSPACE_DIR  # where the first process starts, inside
    # The launcher's stdin is a pipe the host writes (`SandboxProcess.stdin`), its stdout
    # what the host reads: a stdio MCP server's transport (bridge/sandboxed.py). Only a
    # backend that `serves_stdio`.
    stdio: bool = False

    # (first host id, count): the sandbox's user namespace maps inside ids 1000 + k to
    # host ids first + k (and `identity` must be `first`): a template whose forked runs
    # each drop to their own host id (`isolation.identity`). bwrap only, root only.
    id_map: tuple[int, int] | None = None

    def channel_fds(self) -> tuple[int, ...]:
        """The guest's channel fds that are set."""
        return tuple(fd for fd in (self.control_fd, self.bridge_fd) if fd is not None)


@dataclass(frozen=True, slots=True)
class ExitStatus:
    """How a sandbox's process ended, in terms every backend can give.

    `code` is the exit code, None when the process was killed by `signal`. Both set: the
    backend cannot tell an exit with `code` from a death by `signal` (bubblewrap reports a
    child killed by signal N as exit code 128 + N); the guest's own report tells them apart.
    """

    code: int | None
    signal: int | None = None

    def describe(self) -> str:
        """ "exit 1", or "signal SIGKILL": for messages."""
        if self.code is not None:
            return f"exit {self.code}"
        with contextlib.suppress(ValueError):
            return f"signal {signal.Signals(self.signal or 0).name}"
        return f"signal {self.signal}"


@dataclass(frozen=True, slots=True)
class HostOverhead:
    """What a backend's own host processes take in the run's cgroup beside the guest's, so
    that the guest still gets its limits: bwrap's init is one pid; gVisor's runsc, gofer,
    Sentry and stub processes are host threads per guest process and tens of MiB.

    pids.max = max_processes * pids_per_process + pids; memory = memory_mb + this memory_mb.
    `guest_rlimits`: the guest runs on a kernel of its own (gVisor's Sentry), where
    RLIMIT_NPROC counts this sandbox's tasks only and RLIMIT_AS is the Sentry's to enforce:
    the guest sets both (max_processes; memory_mb per process) even under a cgroup, which
    then bounds the sandbox as a whole, its kernel included.
    """

    pids: int = 1
    pids_per_process: int = 1
    memory_mb: int = 0
    guest_rlimits: bool = False


OnCreated = Callable[[int], None]
"""Called with the host pid of the sandbox's first process once its namespaces exist and
before anything of the guest runs (the engine moves it into the run's cgroup then)."""


class SandboxProcess:
    """A started sandbox as the host holds it: one process in a process group of its own,
    its stdout and stderr pipes, and the backend's reading of its exit status.

    `kill` is the one way a sandbox's processes are killed (the engine sweeps its cgroup
    too, `engine.run.StartedSandbox.kill`); `close` kills, reaps and closes, once.
    A backend whose sandbox outlives its launcher's process group overrides `kill`.
    A backend that knows the host pid of the sandbox's init (the PID 1 of its pid
    namespace) passes it to `track_init`: `kill` then returns only once that init has
    exited, which the kernel lets happen only after every other process of the namespace
    is gone. Without a cgroup (an ordinary user's codecage) nothing else waits for them.
    """

    _INIT_EXIT_WAIT_S = 5.0

    def __init__(
        self, popen: subprocess.Popen[bytes], exit_status: Callable[[int], ExitStatus]
    ) -> None:
        if popen.stdout is None or popen.stderr is None:
            raise ValueError("a sandbox process needs stdout and stderr pipes")
        self._popen = popen
        self._exit_status = exit_status
        self.stdin: IO[bytes] | None = popen.stdin  # a pipe only for `LaunchSpec.stdio`
        self.stdout: IO[bytes] = popen.stdout
        self.stderr: IO[bytes] = popen.stderr
        self._init_pidfd: int | None = None
        self._init_lock = threading.Lock()  # kill may run in one thread while close runs

    def track_init(self, pid: int) -> None:
        """Hold a pidfd of the sandbox's init, host pid `pid`: call it while the launcher
        (its parent) has not reaped it, so the pid cannot have been reused. Best effort: a
        kernel without pidfd_open leaves `kill` as it was."""
        with self._init_lock, contextlib.suppress(OSError):
            if self._init_pidfd is None:
                self._init_pidfd = os.pidfd_open(pid)

    @property
    def pid(self) -> int:
        """The launcher's host pid (its process group's id too)."""
        return self._popen.pid

    def poll(self) -> ExitStatus | None:
        """The exit status, or None while it runs."""
        code = self._popen.poll()
        return None if code is None else self._exit_status(code)

    def alive(self) -> bool:
        return self._popen.poll() is None

    def wait(self, timeout: float | None = None) -> ExitStatus:
        """Wait for the exit.

        Raises:
            subprocess.TimeoutExpired: it did not exit within `timeout` seconds.
        """
        return self._exit_status(self._popen.wait(timeout))

    def kill(self) -> None:
        """SIGKILL the launcher's process group; the sandbox's PID 1 dies with its parent,
        and the kernel then kills every process of its pid namespace (waited for when
        `track_init` was called)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self._popen.pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            self._popen.kill()
        self._wait_for_init()

    def _wait_for_init(self) -> None:
        """Until the tracked init has exited (its pidfd turns readable), at most a few
        seconds: it dies of its parent's death (bwrap's --die-with-parent), asynchronously."""
        with self._init_lock:
            if self._init_pidfd is None:
                return
            poller = select.poll()
            poller.register(self._init_pidfd, select.POLLIN)
            with contextlib.suppress(OSError):
                poller.poll(self._INIT_EXIT_WAIT_S * 1000)

    def close(self) -> None:
        """Kill it if it still runs, reap it, close its pipes; idempotent."""
        if self.alive():
            self.kill()
        self._popen.wait()
        if self.stdin is not None:
            with contextlib.suppress(OSError):  # a broken pipe's unflushed nothing
                self.stdin.close()
        self.stdout.close()
        self.stderr.close()
        with self._init_lock:
            if self._init_pidfd is not None:
                os.close(self._init_pidfd)
                self._init_pidfd = None


class LauncherFds:
    """The fds a backend's launcher is started with besides the guest's (a filter or config
    memfd, handshake pipes). Each is closed once: a second close of a number another thread
    reused meanwhile would close *its* fd. A subclass names its fds as attributes and, in
    `sandbox_ends`, those the launcher keeps (closed here once it started)."""

    sandbox_ends: tuple[str, ...] = ()

    def __init__(self) -> None:
        self._open: set[int] = set()

    def open(self, bpf: bytes) -> None:
        """Make the fds, the seccomp filter `bpf` (a memfd) among them."""
        raise NotImplementedError

    @classmethod
    @contextlib.contextmanager
    def opened(cls, bpf: bytes) -> Iterator[Self]:
        """Its fds, made (`open`), and all closed when the block ends, however it ends."""
        fds = cls()
        try:
            fds.open(bpf)
            yield fds
        finally:
            fds.close_all()

    def add(self, fd: int) -> int:
        self._open.add(fd)
        return fd

    def memfd(self, name: str, data: bytes) -> int:
        """A memfd holding `data`, read from its start."""
        fd = self.add(os.memfd_create(name, os.MFD_CLOEXEC))
        os.write(fd, data)
        os.lseek(fd, 0, os.SEEK_SET)
        return fd

    def pipe(self) -> tuple[int, int]:
        read, write = os.pipe()
        return self.add(read), self.add(write)

    def close(self, fd: int) -> None:
        if fd in self._open:
            self._open.discard(fd)
            with contextlib.suppress(OSError):
                os.close(fd)

    def close_sandbox_ends(self) -> None:
        for name in self.sandbox_ends:
            self.close(getattr(self, name))

    def close_all(self) -> None:
        for fd in list(self._open):
            self.close(fd)


def version_line(executable: str) -> str | None:
    """The first line `executable --version` prints, None when it cannot be run."""
    try:
        out = subprocess.run(
            [executable, "--version"],
            capture_output=True,
            text=True,
            check=True,
            timeout=10,
            env={"PATH": os.defpath},
            cwd="/",
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return out.splitlines()[0] if out.strip() else None


def spawn(
    argv: list[str],
    *,
    pass_fds: tuple[int, ...],
    env: dict[str, str],
    cwd: Path,
    exit_status: Callable[[int], ExitStatus],
    identity: Identity | None = None,
    new_session: bool = False,
    stdin_pipe: bool = False,
) -> SandboxProcess:
    """Start a backend's launcher in a process group of its own, nothing inherited but
    `pass_fds` and `env`, stdin empty, stdout and stderr piped to the host; as `identity`
    (no supplementary groups) when that is not who runs codecage, which only root can do.
    `new_session`: a session of its own instead (a session leader's group is its own).
    `stdin_pipe`: stdin is a pipe the host writes (`SandboxProcess.stdin`), not empty.

    Raises:
        SandboxError: it could not be started.
    """
    if identity is not None and (identity.uid, identity.gid) != (os.getuid(), os.getgid()):
        if os.geteuid() != 0:
            raise SandboxError(
                f"cannot start the sandbox as uid {identity.uid}: only root can",
                hint="leave [sandbox] uid/gid unset when codecage is not run as root",
            )
        argv = [*become(identity), *argv]
    try:
        popen = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE if stdin_pipe else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            pass_fds=pass_fds,
            env=env,
            cwd=cwd,
            process_group=None if new_session else 0,
            start_new_session=new_session,
        )
    except OSError as exc:
        raise SandboxError(f"cannot start the sandbox: {exc}") from exc
    return SandboxProcess(popen, exit_status)


def become(identity: Identity) -> list[str]:
    """The command that makes the launcher `identity` (no supplementary groups) and execs
    it. Not Popen(user=...): CPython cannot use vfork when it changes ids, and forking the
    whole host process for every sandbox costs the warm pool's runs ~0.35 ms each."""
    setpriv = _setpriv()
    return [
        setpriv,
        f"--reuid={identity.uid}",
        f"--regid={identity.gid}",
        "--clear-groups",
        "--",
    ]


@functools.cache
def _setpriv() -> str:
    """util-linux's setpriv (Debian: essential, always there).

    Raises:
        HostError: it is not installed.
    """
    path = shutil.which("setpriv") or "/usr/bin/setpriv"
    if not os.access(path, os.X_OK):
        raise HostError(
            "setpriv is not installed: codecage needs it to start sandboxes as their own "
            "unprivileged host id",
            hint="install util-linux (Debian: apt-get install util-linux)",
        )
    return path


class Backend(Protocol):
    """What every backend provides: a name, its version and layers (`info`), `start`, and
    what it can do. Each backend states every trait below as its own attribute (no
    default is assumed for a missing one): the engine, the host and the bridge read them
    here, never a backend's name."""

    name: str
    forks_templates: bool
    """It can start a fork server's template (`LaunchSpec.template`; engine/forkserver.py)."""
    lends_directories: bool
    """A lent directory's protected entries can be kept read-only inside it
    (isolation.lending); without it the engine refuses to lend one."""
    serves_stdio: bool
    """It can start a sandbox whose transport is the launcher's stdin and stdout
    (`LaunchSpec.stdio`): a sandboxed stdio MCP server (bridge/sandboxed.py)."""
    runs_bubblewrap: bool
    """Its launcher is bubblewrap: `info` reports `version()` as `bwrap_version`."""
    root_launcher: bool
    """Its launcher and helpers stay the host's root (a rootful runsc): the run's egress
    socket is opened for root too, and the sandbox's first process is not checked for the
    sandbox's id. None does today (gVisor runs rootless, as the sandbox's id)."""
    guest_is_sentry_root: bool
    """The code runs as uid 0 of a kernel of the backend's own, with no capability (gVisor
    rootless): the self-test accepts that uid there, never a capability."""
    shares_host_user_namespace: bool
    """The guest runs in the host's user namespace, where RLIMIT_NPROC counts every
    process of its uid: a run's pids cgroup alone bounds its processes."""
    filters_unix_addressing: bool
    """It cannot refuse a host's pathname unix socket itself: the run's seccomp filter
    refuses connect and addressed sends instead (`seccomp.SeccompPlan.unix_addressing`)."""
    host_overhead: HostOverhead
    """What its own host processes take in the run's cgroup beside the guest's."""
    lost_layers: tuple[str, ...]
    """What it lacks by design (each result says so): none for a full backend."""
    selftest_gaps: frozenset[str]
    """The self-test's layers it fails by design, explained by `lost_layers`."""

    def version(self) -> str | None:
        """The version of the isolation tool, None when it cannot be told (for the
        self-test's cache key and `info`)."""
        ...

    def probe(self) -> list[LayerStatus]:
        """The layers this backend really provides on this host."""
        ...

    def start(self, spec: LaunchSpec, on_created: OnCreated | None = None) -> SandboxProcess:
        """Start one sandbox as `spec` says; call `on_created` before the guest starts.
        On an error, nothing it started is left running. The sandbox dies with the host
        process at the latest; it may die with the host thread that started it (bwrap's
        does), so the warm pool starts sandboxes from threads that live as long as it.

        Raises:
            SandboxError: the sandbox could not be started.
        """
        ...


BACKENDS: dict[str, str] = {
    "bwrap": "codecage.backends.bwrap:BwrapBackend",
    "gvisor": "codecage.backends.gvisor:GvisorBackend",
    "landlock": "codecage.backends.landlock:LandlockBackend",
}
"""Name -> "module:Class". `auto` picks the first available, strongest first."""

AUTO_ORDER = ("bwrap", "gvisor")
"""bwrap first: gVisor isolates more (a user-space kernel) but enforces memory per process,
not for the sandbox as a whole, and its cold start is ~6x bwrap's (docs/security-model.md)."""
DEGRADED_ORDER = ("landlock",)
"""Backends without namespaces: `auto` picks one only when degraded isolation is allowed."""


def load_backend(
    name: str, *, allow_degraded: bool = False, order: tuple[str, ...] | None = None
) -> Backend:
    """Instantiate the backend called `name` ("auto": the first of `auto_candidates`).

    Raises:
        ConfigError: no backend has that name.
        HostError: no backend can run on this host.
    """
    if name == "auto":
        return auto_candidates(order, allow_degraded=allow_degraded)[0]
    if name not in BACKENDS:
        raise ConfigError(
            f"unknown backend {name!r}",
            hint=f"choose one of: auto, {', '.join(BACKENDS)}",
        )
    return _backend_class(name)()


def stdio_backend() -> Backend:
    """The backend a stdio MCP server's sandbox starts through (`LaunchSpec.stdio`,
    bridge/sandboxed.py): the first of `BACKENDS` that serves stdio and can run here.

    Raises:
        HostError: none can run here (the first one's reason, and what to do).
    """
    refusals: list[HostError] = []
    for name in BACKENDS:
        if not _backend_class(name).serves_stdio:
            continue
        try:
            return load_backend(name)
        except HostError as exc:
            refusals.append(exc)
    if refusals:
        raise refusals[0]
    raise HostError(
        "no backend here can start a stdio server's sandbox",
        hint="install bubblewrap (Debian: apt-get install bubblewrap)",
    )


def _backend_class(name: str) -> type[Backend]:
    """The class `BACKENDS` names, not instantiated (its traits are class attributes)."""
    module_name, class_name = BACKENDS[name].split(":")
    found: type[Backend] = getattr(importlib.import_module(module_name), class_name)
    return found


def auto_candidates(
    order: tuple[str, ...] | None = None, *, allow_degraded: bool = False
) -> list[Backend]:
    """The backends `auto` may use here, loaded, strongest first: those of `order` (default
    `AUTO_ORDER`) where user namespaces can be made, then those of `DEGRADED_ORDER` when
    `allow_degraded`. The caller picks the first whose self-test passes.

    Raises:
        ConfigError: `order` names an unknown backend.
        HostError: none can run here (the message says why each could not, and what to do).
    """
    strong = AUTO_ORDER if order is None else order
    for name in strong:
        if name not in BACKENDS:
            raise ConfigError(
                f"unknown backend {name!r} in the sandbox table's backends",
                hint=f"choose among: {', '.join(BACKENDS)}",
            )
    errors: list[str] = []
    usable, why = userns.available()
    if not usable:
        errors.append(f"user namespaces are unavailable ({why})")
    names = [n for n in strong if n not in DEGRADED_ORDER] if usable else []
    names += [n for n in DEGRADED_ORDER if allow_degraded]
    found: list[Backend] = []
    for candidate in names:
        try:
            found.append(load_backend(candidate))
        except HostError as exc:
            errors.append(f"{candidate}: {exc}")
    if not found:
        raise HostError(
            "no isolation backend is available here: " + "; ".join(errors),
            hint=userns.remedy()
            if not usable
            else "install bubblewrap (Debian: apt-get install bubblewrap) or gVisor "
            "(apt-get install runsc)",
        )
    return found


def backend_states(in_force: str) -> list[BackendState]:
    """Every known backend: can it run here (and if not, why and what to do), is it the
    one `in_force`, is it a degraded fallback."""
    states: list[BackendState] = []
    for name in BACKENDS:
        why: str | None = None
        try:
            load_backend(name)
        except HostError as exc:
            why = f"{exc} ({exc.hint})" if exc.hint else str(exc)
        states.append(
            BackendState(
                name=name,
                available=why is None,
                in_force=name == in_force,
                degraded=name in DEGRADED_ORDER,
                why_not=why,
            )
        )
    return states


def available_backends() -> dict[str, bool]:
    """Each known backend, and whether it can be loaded on this host."""
    found: dict[str, bool] = {}
    for name in BACKENDS:
        try:
            load_backend(name)
        except HostError:
            found[name] = False
        else:
            found[name] = True
    return found
