"""The bubblewrap backend: Linux namespaces, a minimal read-only root, seccomp.

Every sandbox gets new user, pid, net, mount, ipc, uts and cgroup namespaces. Inside, the
program runs as uid/gid 1000 with every capability dropped and no_new_privs set, in a new
session (no controlling terminal), as a child of bwrap's init (PID 1), which is killed with
SIGKILL when bwrap or its parent (the host engine) dies; killing PID 1 kills the namespace.
User namespaces are disabled inside (`--disable-userns`), and seccomp refuses unshare/setns
and namespace clone flags, so nested namespaces cannot be made.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import shutil
import subprocess
from collections.abc import Iterator
from typing import TYPE_CHECKING

from codecage.backends.base import (
    Backend,
    ExitStatus,
    HostOverhead,
    LauncherFds,
    LaunchSpec,
    OnCreated,
    SandboxProcess,
    spawn,
    version_line,
)
from codecage.errors import HostError, SandboxError
from codecage.isolation import network, rootfs, userns
from codecage.models import LayerStatus

log = logging.getLogger(__name__)

_NAMESPACES = ("--unshare-ipc", "--unshare-pid", "--unshare-uts")
_NAMESPACES_TRY = ("--unshare-cgroup-try",)
_SIGNAL_EXIT_BASE = 128  # bwrap reports a child killed by signal N as exit code 128 + N


class BwrapBackend:
    """Namespaces via bubblewrap; see the module docstring for what is in force."""

    name = "bwrap"
    # It can start a fork server's template (LaunchSpec.template; engine/forkserver.py).
    forks_templates = True
    # A lent directory's protected entries are bound read-only over it (isolation.lending).
    lends_directories = True
    # Its launcher's stdin and stdout can be a stdio MCP server's transport (LaunchSpec.stdio).
    serves_stdio = True
    runs_bubblewrap = True
    # bwrap becomes the sandbox's id before it starts (setpriv); its init is the one pid
    # beside the guest's; the guest has its own user namespace and the full set of layers.
    root_launcher = False
    guest_is_sentry_root = False
    shares_host_user_namespace = False
    filters_unix_addressing = False
    host_overhead = HostOverhead()
    lost_layers: tuple[str, ...] = ()
    selftest_gaps: frozenset[str] = frozenset()

    def __init__(self) -> None:
        self.executable = _find_bwrap()

    def version(self) -> str | None:
        return bwrap_version(self.executable)

    def probe(self) -> list[LayerStatus]:
        ok, detail = _namespaces_work(self.executable)
        return [
            LayerStatus(
                name="namespaces",
                active=ok,
                mechanism=f"bubblewrap {self.version() or '?'}",
                detail=detail,
            ),
            network.probe(ok),
        ]

    def start(self, spec: LaunchSpec, on_created: OnCreated | None = None) -> SandboxProcess:
        """Start bwrap, and between "namespaces made" (its --info-fd names the sandbox's
        PID 1) and "guest starts" (a byte on its --block-fd) call `on_created`: nothing of
        the guest runs before it returns, and what it starts inherits what it set (the
        cgroup).

        Raises:
            SandboxError: bwrap could not be started, or said something unexpected.
        """
        with _HandshakeFds.opened(spec.seccomp) as fds, _user_namespace(spec) as userns:
            argv = self._argv(spec, fds, userns)
            log.debug("bwrap.launch", extra={"argv": argv})
            ours = (fds.info_write, fds.block_read, fds.seccomp) + (
                () if userns is None else (userns,)
            )
            process = spawn(
                argv,
                pass_fds=(*ours, *spec.channel_fds(), *spec.extra_fds),
                env=spec.env,
                cwd=spec.cwd,
                exit_status=exit_status,
                identity=spec.identity,
                stdin_pipe=spec.stdio,
            )
            try:
                fds.close_sandbox_ends()
                pid = _read_info(fds.info_read)
                if pid is not None:
                    process.track_init(pid)
                if pid is not None and on_created is not None:
                    on_created(pid)
                with contextlib.suppress(OSError):  # bwrap failed; its stderr says why
                    os.write(fds.block_write, b"1")
            except BaseException as exc:
                _raise_if_bwrap_failed(process, exc)
                raise
        return process

    def _argv(self, spec: LaunchSpec, fds: _HandshakeFds, userns: int | None) -> list[str]:
        return [
            self.executable,
            *isolation_args(allow_network=spec.network, template=spec.template, userns=userns),
            *rootfs.bwrap_args(spec.mounts, open_dirs=spec.id_map is not None),
            "--chdir",
            spec.chdir,
            "--info-fd",
            str(fds.info_write),
            "--block-fd",
            str(fds.block_read),
            "--seccomp",
            str(fds.seccomp),
            "--",  # what follows is the command inside, never read as an option of bwrap's
            *spec.guest_argv,
        ]


@contextlib.contextmanager
def _user_namespace(spec: LaunchSpec) -> Iterator[int | None]:
    """The user namespace of a template whose runs drop to ids of their own (`id_map`),
    made by root and mapped before bwrap joins it; None: bwrap makes one of one id.

    Raises:
        SandboxError: it cannot be made.
    """
    if spec.id_map is None:
        yield None
        return
    first, count = spec.id_map
    try:
        fd = userns.mapped(first, count, rootfs.SANDBOX_UID)
    except OSError as exc:
        raise SandboxError(f"cannot make the template's user namespace: {exc}") from exc
    try:
        yield fd
    finally:
        os.close(fd)


def isolation_args(
    *, allow_network: bool, template: bool = False, userns: int | None = None
) -> list[str]:
    """bwrap's options for everything but the mounts and the handshake: the namespaces,
    the ids inside, no capabilities, death with the parent, a session of its own (also
    used for sandboxed upstream servers, `bridge.sandboxed`).

    A fork server's `template` (guest/template.py) keeps CAP_SYS_ADMIN and CAP_SETPCAP in
    its user namespace and may make user namespaces: it makes each run's namespaces, and
    never runs user code; each run gives both up, and its filter refuses new namespaces.
    With `userns` (a namespace of many ids, `isolation.userns.mapped`) it joins that one
    instead of making its own, and keeps CAP_SETUID and CAP_SETGID too: each run drops to
    its own id in it (no further user namespace can be made in it: see `mapped`).
    """
    powers = ["--cap-add", "CAP_SYS_ADMIN", "--cap-add", "CAP_SETPCAP"] if template else []
    if template and userns is not None:
        powers += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    user = ["--unshare-user", "--disable-userns"] if userns is None else ["--userns", str(userns)]
    return [
        *user,
        *_NAMESPACES,
        *_NAMESPACES_TRY,
        *network.bwrap_args(network.plan(allow_network=allow_network)),
        "--uid",
        str(rootfs.SANDBOX_UID),
        "--gid",
        str(rootfs.SANDBOX_GID),
        "--cap-drop",
        "ALL",
        *powers,
        "--die-with-parent",
        "--new-session",
        "--hostname",
        "sandbox",
    ]


def find_bwrap() -> str:
    """The bwrap executable.

    Raises:
        HostError: bubblewrap is not installed.
    """
    return _find_bwrap()


def _raise_if_bwrap_failed(process: SandboxProcess, exc: BaseException) -> None:
    """Close `process`; when bwrap had already failed (what went wrong after it then is a
    consequence, e.g. a cgroup move of a process that is gone), raise what bwrap said."""
    said = _stderr_of(process) if process.poll() is not None else None
    process.close()
    if said is not None and isinstance(exc, Exception):
        raise SandboxError(f"the sandbox failed to start: {said}") from exc


def _stderr_of(process: SandboxProcess) -> str:
    with contextlib.suppress(OSError, ValueError):
        return process.stderr.read(4096).decode("utf-8", "replace").strip() or "no message"
    return "no message"


def exit_status(returncode: int) -> ExitStatus:
    """bwrap's exit, backend-neutral: a negative code is bwrap itself killed (e.g. its
    parent died); above 128 it is either the child's exit code or 128 + the signal that
    killed it, which only the guest's report tells apart."""
    if returncode < 0:
        return ExitStatus(code=None, signal=-returncode)
    if returncode > _SIGNAL_EXIT_BASE:
        return ExitStatus(code=returncode, signal=returncode - _SIGNAL_EXIT_BASE)
    return ExitStatus(code=returncode)


class _HandshakeFds(LauncherFds):
    """The seccomp filter (a memfd), the info pipe (bwrap -> host), the block pipe (host ->
    bwrap)."""

    sandbox_ends = ("info_write", "block_read", "seccomp")
    seccomp = info_read = info_write = block_read = block_write = -1

    def open(self, bpf: bytes) -> None:
        self.seccomp = self.memfd("codecage-seccomp", bpf)
        self.info_read, self.info_write = self.pipe()
        self.block_read, self.block_write = self.pipe()


def _read_info(fd: int) -> int | None:
    """The sandbox's PID 1 as bwrap's --info-fd names it; None when bwrap failed first.

    Raises:
        SandboxError: bwrap wrote something else.
    """
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


def _find_bwrap() -> str:
    path = shutil.which("bwrap")
    if path is None:
        raise HostError(
            "bubblewrap (bwrap) is not installed",
            hint="install it: apt-get install bubblewrap (or run scripts/setup as root)",
        )
    return path


@functools.cache
def bwrap_version(executable: str) -> str | None:
    line = version_line(executable)  # "bubblewrap 0.8.0"
    return line.split()[-1] if line and line.split() else None


@functools.cache
def _namespaces_work(executable: str) -> tuple[bool, str]:
    """Can bwrap create every namespace we ask for here? (one real, empty sandbox)"""
    argv = [
        executable,
        "--unshare-user",
        *_NAMESPACES,
        "--unshare-net",
        "--disable-userns",
        "--ro-bind",
        "/",
        "/",
        "true",
    ]
    try:
        proc = subprocess.run(
            argv, capture_output=True, text=True, timeout=30, env={}, cwd="/", check=False
        )
    except (OSError, subprocess.SubprocessError) as exc:
        return False, f"bwrap could not start: {exc}"
    if proc.returncode != 0:
        return False, f"bwrap failed: {proc.stderr.strip()[:300]}"
    return True, "user, pid, net, mount, ipc, uts and cgroup namespaces; nested userns disabled"


if TYPE_CHECKING:  # mypy checks that it is a Backend: every trait stated, with its type
    _IS_A_BACKEND: type[Backend] = BwrapBackend
