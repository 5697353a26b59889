"""The gVisor backend: the guest runs on runsc's user-space kernel (the Sentry), not the host's.

What it adds over bubblewrap: the guest's syscalls are served by the Sentry, a Linux kernel
written in Go that runs as an unprivileged host process (uid 65534, its own namespaces, a
strict seccomp filter of runsc's own); files are opened on the Sentry's behalf by a second
process (the gofer); the guest never makes a syscall to the host kernel. Platform ptrace
(no KVM here): the guest's code runs in stub processes the Sentry traces.

How one sandbox starts (`GvisorBackend.start`):

- an OCI bundle is written into the run's directory: `config.json` and a skeleton root
  (the mount points, read-only); runsc's state dir (`--root`) is there too, and each run
  has its own container id, so nothing is shared between runs;
- the launcher is `sh`, blocked on a pipe, then `exec setpriv --pdeathsig KILL runsc run`:
  the engine's `on_created` moves the blocked launcher into the run's cgroup first, so
  runsc, its gofer, the Sentry and every stub process are born in it (memory, CPU and
  pids count the whole sandbox, the gVisor kernel included); nothing of the guest runs
  before `on_created` returns. runsc does not touch cgroups (`--ignore-cgroups`);
- rootless: when codecage is root, the launcher is started as the sandbox's host id
  (`isolation.identity`, never root) and runsc runs with `--rootless`, so runsc, the gofer,
  the Sentry and its stubs are all that unprivileged id, never root. The gofer then opens
  only what that id may (the engine binds copies staged for it, `isolation.staging`), the
  bundle and runsc's state are given to it. With `--network=none` and `--ignore-cgroups`
  rootless needs nothing else (measured with Debian 12's runsc 20221219: `runsc
  --rootless run` as uid 2000000000; docs/security-model.md);
- the Sentry is started "attached": it dies with runsc, and runsc with the thread that
  started it (pdeathsig), like bwrap's --die-with-parent;
- runsc cannot pass extra fds into a container (this version has no --pass-fd). The guest's
  two channels are handed over by SCM_RIGHTS instead: the guest bootstrap (`--fds-from`)
  connects to a Unix socket bound read-only into the sandbox (`--host-uds=open`), and a
  thread of this backend accepts that one connection, sends the engine's socketpair ends
  and removes the socket. The guest then holds the very sockets bwrap would have passed:
  no relay, EOF and shutdown behave the same;
- the engine's seccomp program is raw BPF for the host kernel, which runsc cannot take.
  The same plan (`isolation.seccomp`) is given as an OCI profile with `--oci-seccomp`: the
  Sentry enforces it on the guest's syscalls. What differs is said in `probe()` and in
  docs/security-model.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from codecage.backends.base import (
    Backend,
    ExitStatus,
    HostOverhead,
    LaunchSpec,
    OnCreated,
    SandboxProcess,
    become,
    version_line,
)
from codecage.errors import HostError, SandboxError
from codecage.isolation import identity as identities
from codecage.isolation import rootfs, seccomp
from codecage.isolation.identity import Identity
from codecage.models import LayerStatus

log = logging.getLogger(__name__)

PLATFORM = "ptrace"  # no KVM here; ptrace works wherever runsc does
HANDOFF_DIR = "/opt/codecage-channels"
"""Where the guest finds the Unix socket its two channels are handed over on (read-only,
and empty once the handover is done)."""
_HANDOFF_SOCKET = "channels.sock"
_HANDOFF_TIMEOUT_S = 120.0  # a guest that never connects: the engine's own timeout is first
# runsc, the gofer and the Sentry are Go programs: ~300 host threads before the guest
# starts (the gofer serves each bind mount on threads of its own: ~200 with the default
# profile's binds), and each guest process adds a stub process the Sentry traces (~5).
# The host's pids and memory cgroup bound the sandbox as a whole with this much room; the
# guest's own limits are set inside the Sentry (RLIMIT_NPROC, RLIMIT_AS: HostOverhead).
_HOST_TASKS = 512
_HOST_TASKS_PER_PROCESS = 64
_HOST_MEMORY_MB = 256
_IDS_SWITCH_TIMEOUT_S = 30.0  # setpriv's switch to the sandbox's id: milliseconds; a bound
_SIGNAL_EXIT_BASE = 128  # runsc reports a container killed by signal N as exit code 128 + N
_INSTALL_HINT = "install gVisor: apt-get install runsc (or run scripts/setup as root)"

# Host paths the sandbox's /proc holds in bwrap's plan (masks of host files): gVisor's
# /proc is the Sentry's own and has none of them, so they are left out.
_PROC = "/proc"


class GvisorBackend:
    """gVisor's runsc; see the module docstring for what is in force."""

    name = "gvisor"
    # The launcher, runsc, its gofer and the Sentry run as the sandbox's host id with
    # `runsc --rootless` (never root): the engine's check that a sandbox's first process is
    # not host root applies as to every backend.
    root_launcher = False
    # Rootless, the code is uid 0 of the Sentry with no capability (`guest_ids` says why):
    # the self-test accepts that uid there, never a capability.
    guest_is_sentry_root = os.geteuid() == 0
    # A lent directory's protected entries are read-only binds over it (isolation.lending).
    lends_directories = True
    # Every sandbox starts anew from its OCI bundle, with a guest's two channels only.
    forks_templates = False
    serves_stdio = False
    runs_bubblewrap = False
    # The Sentry is the guest's kernel: its own user namespace, its own unix sockets.
    shares_host_user_namespace = False
    filters_unix_addressing = False
    lost_layers: tuple[str, ...] = ()
    selftest_gaps: frozenset[str] = frozenset()
    host_overhead = HostOverhead(
        pids=_HOST_TASKS,
        pids_per_process=_HOST_TASKS_PER_PROCESS,
        memory_mb=_HOST_MEMORY_MB,
        guest_rlimits=True,
    )

    def __init__(self) -> None:
        self.executable = _find_runsc()
        if os.geteuid() != 0:
            raise HostError(
                "the gVisor backend needs root here: it starts runsc --rootless as the "
                "sandbox's own dedicated host id, which only root can switch to",
                hint="run codecage as root, or choose --backend bwrap",
            )

    def version(self) -> str | None:
        return runsc_version(self.executable)

    def probe(self) -> list[LayerStatus]:
        ok, detail = _runsc_works(self.executable, _probe_identity())
        mechanism = f"gVisor runsc {self.version() or '?'}, platform {PLATFORM}"
        return [
            LayerStatus(name="user-space kernel", active=ok, mechanism=mechanism, detail=detail),
            LayerStatus(
                name="network",
                active=ok,
                mechanism="runsc --network=none + OCI seccomp socket rules",
                detail="no network device in the Sentry but its own loopback; only AF_UNIX "
                "sockets may be created",
            ),
            LayerStatus(
                name="seccomp (guest)",
                active=ok,
                mechanism="OCI profile enforced by the Sentry (--oci-seccomp)",
                detail="the same rules as bwrap's BPF, checked by gVisor's seccomp emulation "
                "on the guest's syscalls; the host kernel sees only the Sentry's and "
                "gofer's syscalls, under runsc's own filters; no kill on a syscall of "
                "another ABI (i386, x32)",
            ),
            LayerStatus(
                name="limits (guest)",
                active=ok,
                mechanism="RLIMIT_NPROC and RLIMIT_AS in the Sentry + the host cgroup",
                detail="max_processes counts this sandbox's tasks only; memory_mb holds per "
                f"process, not for the sandbox as a whole (MemoryError, not memory_limit); "
                f"the host cgroup bounds the whole sandbox, gVisor itself included, at "
                f"memory_mb + {_HOST_MEMORY_MB} MiB and {_HOST_TASKS} + "
                f"{_HOST_TASKS_PER_PROCESS} x max_processes host tasks; tmpfs and memfd pages "
                "count only there",
            ),
        ]

    def start(self, spec: LaunchSpec, on_created: OnCreated | None = None) -> SandboxProcess:
        """Write the bundle, start `sh` blocked on a pipe, let `on_created` move it into the
        run's cgroup, then let it exec runsc: nothing of the sandbox exists before.

        Raises:
            SandboxError: runsc could not be started.
        """
        if spec.control_fd is None or spec.bridge_fd is None or spec.stdio:
            raise SandboxError(
                "the gVisor backend starts a guest with its two channels only",
                hint="start a stdio server's sandbox with the bwrap backend",
            )
        bundle = _Bundle.write(spec)
        block_read, block_write = os.pipe()
        try:
            handoff = _Handoff(
                bundle.handoff_socket,
                spec.control_fd,
                spec.bridge_fd,
                owner=_host_owner(spec),
            )
        except BaseException:
            os.close(block_read)
            os.close(block_write)
            raise
        try:
            popen = subprocess.Popen(
                _as_identity(spec, self._argv(bundle)),
                stdin=block_read,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env={"PATH": os.defpath},
                cwd=spec.cwd,
                process_group=0,
            )
        except OSError as exc:
            handoff.close()
            os.close(block_write)
            raise SandboxError(f"cannot start the sandbox: {exc}") from exc
        except BaseException:
            handoff.close()
            os.close(block_write)
            raise
        finally:
            os.close(block_read)
        gvisor = GvisorProcess(popen, bundle, handoff, self.executable)
        try:
            if bundle.identity is not None:
                _wait_for_ids(gvisor, bundle.identity)
            if on_created is not None:
                on_created(gvisor.pid)
            with contextlib.suppress(OSError):  # the launcher died; its stderr says why
                os.write(block_write, b"go\n")
            handoff.start(gvisor.alive)
        except BaseException:
            gvisor.close()
            raise
        finally:
            os.close(block_write)
        return gvisor

    def _argv(self, bundle: _Bundle) -> list[str]:
        runsc = [
            self.executable,
            "--root",
            str(bundle.state_dir),
            *(["--rootless"] if bundle.identity is not None else []),
            f"--platform={PLATFORM}",
            "--network=none",
            "--ignore-cgroups",  # the engine owns the cgroup: the launcher is already in it
            "--host-uds=open",  # the channel handover (see the module docstring)
            "--oci-seccomp",
            "run",
            "--bundle",
            str(bundle.dir),
            bundle.container_id,
        ]
        setpriv = shutil.which("setpriv")
        if setpriv is not None:  # util-linux: runsc dies with the thread that started it
            runsc = [setpriv, "--pdeathsig", "KILL", "--", *runsc]
        # The pipe is sh's stdin (dash reads single-digit fds only); the guest's is empty.
        script = 'read -r _ && exec "$@" </dev/null'
        return ["/bin/sh", "-c", script, "codecage-gvisor", *runsc]


def runsc_identity(spec: LaunchSpec) -> Identity | None:
    """The host id runsc, its gofer and the Sentry run as, rootless: the sandbox's own when
    codecage is root and the engine names one; None: as the caller, as runsc's default."""
    if os.geteuid() == 0 and spec.identity is not None and spec.identity.uid != 0:
        return spec.identity
    return None


def _as_identity(spec: LaunchSpec, argv: list[str]) -> list[str]:
    """`argv` started as `runsc_identity(spec)` (setpriv, no supplementary groups), or as
    it is. The launcher is the first process `on_created` sees: never root then."""
    who = runsc_identity(spec)
    return argv if who is None else [*become(who), *argv]


def _wait_for_ids(process: SandboxProcess, who: Identity) -> None:
    """Until the launcher is `who` (setpriv has switched and exec'd `sh`, which then waits
    on its pipe): the engine's `on_created` checks the ids of that process, and must see
    the ids the sandbox runs as, not setpriv's before the switch.

    Raises:
        SandboxError: it never became `who` (it died first: its stderr says why).
    """
    # Both lines: the uid and the gid are not switched in one step, and `on_created`
    # refuses a launcher whose gid still reads 0.
    wanted = (f"Uid:\t{_four(who.uid)}\n", f"Gid:\t{_four(who.gid)}\n")
    deadline = time.monotonic() + _IDS_SWITCH_TIMEOUT_S
    while time.monotonic() < deadline and process.alive():
        with contextlib.suppress(OSError):
            status = Path(f"/proc/{process.pid}/status").read_text("ascii", errors="replace")
            if all(line in status for line in wanted):
                return
        time.sleep(0.001)
    raise SandboxError(f"the gVisor launcher did not become uid {who.uid}, gid {who.gid}")


def _four(number: int) -> str:
    """An id as /proc/PID/status shows it: real, effective, saved and filesystem."""
    return "\t".join([str(number)] * 4)


class GvisorProcess(SandboxProcess):
    """A runsc sandbox: `runsc run` is the launcher (its exit is the guest's), the Sentry
    and the gofer are its children, the Sentry in a session of its own. Killing kills all
    three by pid, and `close` waits until they are gone and removes runsc's state."""

    def __init__(
        self,
        popen: subprocess.Popen[bytes],
        bundle: _Bundle,
        handoff: _Handoff,
        runsc: str,
    ) -> None:
        super().__init__(popen, exit_status)
        self._bundle = bundle
        self._handoff = handoff
        self._runsc = runsc
        self._closed = False

    def kill(self) -> None:
        """SIGKILL the Sentry, the gofer and the Sentry's stub processes (as runsc's state
        and /proc name them) and the launcher's process group."""
        for pid in _with_descendants(self._bundle.sandbox_pids()):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        super().kill()

    def close(self) -> None:
        """Kill, reap, wait until no process of the sandbox is left, remove runsc's state
        (`runsc delete --force`, then its directory); idempotent."""
        if self._closed:
            return
        self._closed = True
        pids = _with_descendants(self._bundle.sandbox_pids())
        try:
            super().close()
        finally:
            self._handoff.close()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            self._bundle.delete(self._runsc, left=_wait_gone(pids))


def exit_status(returncode: int) -> ExitStatus:
    """runsc's exit, backend-neutral: as bwrap's, a container killed by signal N is 128 + N,
    which only the guest's report tells from an exit code; negative is runsc killed."""
    if returncode < 0:
        return ExitStatus(code=None, signal=-returncode)
    if returncode > _SIGNAL_EXIT_BASE:
        return ExitStatus(code=returncode, signal=returncode - _SIGNAL_EXIT_BASE)
    return ExitStatus(code=returncode)


# --- the OCI bundle ---------------------------------------------------------------------


class _Bundle:
    """One run's OCI bundle and runsc state, all inside the run's directory."""

    def __init__(self, base: Path) -> None:
        self.dir = base / "gvisor"
        self.rootfs = self.dir / "rootfs"
        self.state_dir = self.dir / "state"
        self.handoff_dir = self.dir / "channels"
        self.handoff_socket = self.handoff_dir / _HANDOFF_SOCKET
        self.container_id = f"codecage-{uuid.uuid4().hex}"
        self.identity: Identity | None = None  # runsc's host id when rootless

    @classmethod
    def write(cls, spec: LaunchSpec) -> _Bundle:
        """Write config.json, the skeleton root (mount points only) and the empty state dir.

        Raises:
            SandboxError: the run's directory cannot be written.
        """
        bundle = cls(spec.cwd)
        try:
            bundle.dir.mkdir(mode=0o700)
            bundle.state_dir.mkdir(mode=0o700)
            bundle.handoff_dir.mkdir(mode=0o755)
            bundle.rootfs.mkdir(mode=0o755)
            mounts = _oci_mounts(_with_own_etc(spec, bundle.dir / "etc"), bundle.rootfs)
            mounts.append(_bind(HANDOFF_DIR, str(bundle.handoff_dir), read_only=True))
            _mount_point(bundle.rootfs, HANDOFF_DIR, directory=True)
            config = _config(spec, mounts)
            _give_workspace(spec)
            (bundle.dir / "config.json").write_text(json.dumps(config), encoding="utf-8")
            bundle.rootfs.chmod(0o555)
            bundle.identity = runsc_identity(spec)
            if bundle.identity is not None:
                bundle.give_to(bundle.identity)
        except OSError as exc:
            raise SandboxError(f"cannot write the gVisor bundle: {exc}") from exc
        return bundle

    def give_to(self, who: Identity) -> None:
        """Let rootless runsc (as `who`) read the bundle and keep its state: the bundle's
        directory, its state and channel directories become `who`'s; the skeleton root and
        config stay root's and read-only (runsc reads them, never writes them).

        Raises:
            OSError: a chown failed.
        """
        for path in (self.dir, self.state_dir, self.handoff_dir):
            os.chown(path, who.uid, who.gid)

    def sandbox_pids(self) -> list[int]:
        """The Sentry's and the gofer's host pids, as runsc's state file names them."""
        pids: list[int] = []
        with contextlib.suppress(OSError, ValueError, TypeError, AttributeError):
            for state in self.state_dir.glob("*.state"):
                data = json.loads(state.read_text(encoding="utf-8"))
                pids += [int(data["sandbox"]["pid"]), int(data.get("goferPid") or 0)]
        return [p for p in pids if p > 0]

    def delete(self, runsc: str, *, left: list[int]) -> None:
        """Remove runsc's record of the container. Its processes are gone by now, and
        nothing of it is mounted in the host's namespace, so removing the state dir is
        enough; `runsc delete --force` (more than a second here) only for processes left."""
        if left:
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                subprocess.run(
                    [runsc, "--root", str(self.state_dir), "delete", "--force", self.container_id],
                    capture_output=True,
                    timeout=10,
                    env={"PATH": os.defpath},
                    cwd="/",
                    check=False,
                )
        shutil.rmtree(self.state_dir, ignore_errors=True)


def guest_ids(spec: LaunchSpec) -> tuple[int, int]:
    """The guest's uid and gid in the Sentry. gVisor does not map ids: the Sentry's ids are
    the ones the gofer gives the files the guest creates on the host. So the host identity
    when the engine names one, else the sandbox user of /etc/passwd (1000).

    Rootless (`runsc_identity`), the gofer runs in a user namespace where its host id (the
    sandbox's) is 0: the Sentry sees the workspace and every file the guest made as uid 0,
    and every other host file as 65534. The guest is then uid 0 of the Sentry, with no
    capability at all (empty bounding set, no_new_privs: an exec gains none): the owner of
    its own files, nothing more. On the host those files are the sandbox's id's."""
    if runsc_identity(spec) is not None:
        return 0, 0
    if spec.identity is not None:
        return spec.identity.uid, spec.identity.gid
    return rootfs.SANDBOX_UID, rootfs.SANDBOX_GID


def _host_owner(spec: LaunchSpec) -> tuple[int, int]:
    """Who owns, on the host, what the guest must own in the Sentry (the channels' socket):
    rootless, runsc's id (the gofer's, which the Sentry sees as 0); else the guest's ids."""
    who = runsc_identity(spec)
    return (who.uid, who.gid) if who is not None else guest_ids(spec)


def _with_own_etc(spec: LaunchSpec, etc_dir: Path) -> tuple[rootfs.Mount, ...]:
    """The mounts with /etc/passwd and /etc/group naming the guest's own ids: gVisor maps
    none, so the engine's (uid 1000) would leave the code's uid without a name (`getpass`,
    `pwd.getpwuid` fail)."""
    uid, gid = guest_ids(spec)
    rootfs.write_etc(etc_dir, uid, gid)
    own = {"/etc/passwd": etc_dir / "passwd", "/etc/group": etc_dir / "group"}
    return tuple(
        dataclasses.replace(m, source=str(own[m.dest])) if m.dest in own else m for m in spec.mounts
    )


def _give_workspace(spec: LaunchSpec) -> None:
    """Without an identity from the engine, the workspace is the caller's (root's, mode
    0700): the guest, uid 1000 in the Sentry, is given its root directory (a lent
    directory's owner is put back by the engine's hand-back, an owned one is destroyed)."""
    if spec.identity is not None:
        return
    for m in spec.mounts:
        if m.dest == rootfs.WORKSPACE and m.kind == "bind" and m.source is not None:
            os.chown(m.source, rootfs.SANDBOX_UID, rootfs.SANDBOX_GID)


def _config(spec: LaunchSpec, mounts: list[dict[str, Any]]) -> dict[str, Any]:
    argv = _guest_argv(spec.guest_argv)
    uid, gid = guest_ids(spec)
    # No user namespace of the spec's own: rootless runsc refuses one ("cannot create gofer
    # process: fork/exec /proc/self/exe: operation not permitted", runsc 20221219).
    namespaces = ("pid", "network", "ipc", "uts", "mount", "cgroup")
    no_caps: dict[str, list[str]] = {
        k: [] for k in ("bounding", "effective", "inheritable", "permitted", "ambient")
    }
    return {
        "ociVersion": "1.0.2",
        "process": {
            "terminal": False,
            "user": {"uid": uid, "gid": gid},
            "args": list(argv),
            "env": [f"{k}={v}" for k, v in spec.env.items()],
            "cwd": rootfs.WORKSPACE,
            "capabilities": no_caps,
            "noNewPrivileges": True,
        },
        "root": {"path": "rootfs", "readonly": True},
        "hostname": "sandbox",
        "mounts": mounts,
        "linux": {
            "namespaces": [{"type": t} for t in namespaces],
            "seccomp": oci_seccomp(network=spec.network),
        },
    }


def _guest_argv(argv: tuple[str, ...]) -> tuple[str, ...]:
    """The engine's guest command line, its fd numbers (which do not exist in the
    sandbox) replaced by where the guest receives its channels."""
    out: list[str] = []
    skip = False
    for i, arg in enumerate(argv):
        if skip:
            skip = False
            continue
        if arg in ("--control-fd", "--bridge-fd") and i + 1 < len(argv):
            skip = True
            if arg == "--control-fd":
                out += ["--fds-from", f"{HANDOFF_DIR}/{_HANDOFF_SOCKET}"]
            continue
        out.append(arg)
    return tuple(out)


def _oci_mounts(mounts: tuple[rootfs.Mount, ...], root: Path) -> list[dict[str, Any]]:
    """bwrap's mount table as OCI mounts, with their mount points made in `root`."""
    out: list[dict[str, Any]] = []
    proc_read_only = any(m.kind == "remount-ro" and m.dest == _PROC for m in mounts)
    for m in mounts:
        dest = m.dest
        if dest != _PROC and dest.startswith(_PROC + "/"):
            continue  # masks of host /proc files: the Sentry's /proc has none of them
        match m.kind:
            case "ro-bind" | "bind":
                source = _source(m)
                _mount_point(root, dest, directory=Path(source).is_dir())
                out.append(_bind(dest, source, read_only=m.kind == "ro-bind"))
            case "tmpfs":
                _mount_point(root, dest, directory=True)
                out.append(_tmpfs(dest, m.size_bytes))
            case "proc":
                _mount_point(root, dest, directory=True)
                options = ["ro"] if proc_read_only else []
                out.append(
                    {"destination": dest, "type": "proc", "source": "proc", "options": options}
                )
            case "dev":
                # The Sentry makes its own /dev; its /dev/shm is root's: a private one.
                _mount_point(root, dest, directory=True)
                out.append(_tmpfs(f"{dest}/shm", None))
            case "dir":
                _mount_point(root, dest, directory=True)
            case "symlink":
                path = root / dest.lstrip("/")
                path.parent.mkdir(parents=True, exist_ok=True)
                with contextlib.suppress(FileExistsError):
                    path.symlink_to(_source(m))
            case "remount-ro":
                pass  # the root is read-only (config.json); /proc above
    return out


def _tmpfs(dest: str, size_bytes: int | None) -> dict[str, Any]:
    """A tmpfs of the Sentry's: its pages are the Sentry's memory, its size is enforced
    by the Sentry (ENOSPC past it)."""
    options = ["mode=1777"] + ([f"size={size_bytes}"] if size_bytes is not None else [])
    return {"destination": dest, "type": "tmpfs", "source": "tmpfs", "options": options}


def _bind(dest: str, source: str, *, read_only: bool) -> dict[str, Any]:
    options = ["bind", "ro" if read_only else "rw"]  # nosuid, nodev: the Sentry's own
    return {"destination": dest, "type": "bind", "source": source, "options": options}


def _mount_point(root: Path, dest: str, *, directory: bool) -> None:
    path = root / dest.lstrip("/")
    if directory:
        path.mkdir(parents=True, exist_ok=True)
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists():
            path.touch(mode=0o444)


def _source(mount: rootfs.Mount) -> str:
    if mount.source is None:
        raise ValueError(f"{mount.kind} mount of {mount.dest} has no source")
    return mount.source


@functools.cache
def oci_seccomp(*, network: bool) -> dict[str, Any]:
    """The engine's seccomp plan as an OCI profile (what `--oci-seccomp` takes), without
    the rules that answer ENOSYS (clone3, openat2).

    runsc answers every ERRNO rule with EPERM, whatever its errnoRet says (measured with
    Debian 12's runsc); EPERM from clone3 makes glibc's pthread_create fail instead of
    falling back to clone, so no thread could start (numpy's OpenBLAS failed to import).
    Left out, those calls get the Sentry's own answer, ENOSYS: it implements neither
    (`tests/test_gvisor_backend.py` checks that they still answer ENOSYS in the guest)."""
    profile = seccomp.oci_profile(seccomp.plan(network=network))
    enosys = set(seccomp.plan(network=network).enosys_syscalls)
    profile["syscalls"] = [e for e in profile["syscalls"] if not set(e["names"]) & enosys]
    return profile


# --- the channels' handover -------------------------------------------------------------


class _Handoff:
    """The Unix socket the guest's channels are handed over on, and the thread that does
    it: one accepted connection gets the engine's two socketpair ends by SCM_RIGHTS, then
    the socket is removed. Holds its own duplicates of the two fds until then (the engine
    closes its guest ends as soon as `start` returns)."""

    def __init__(
        self,
        path: Path,
        control_fd: int,
        bridge_fd: int,
        owner: tuple[int, int],
    ) -> None:
        self._path = path
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._fds: list[int] = []
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        try:
            self._listener.bind(str(path))
            # The Sentry checks the guest's right to connect: the socket is the guest's only.
            os.chown(path, *owner)
            path.chmod(0o600)
            self._listener.listen(1)
            self._listener.settimeout(0.05)
            self._fds = [os.dup(control_fd), os.dup(bridge_fd)]
        except BaseException:
            self.close()
            raise

    def start(self, alive: Any) -> None:
        self._thread = threading.Thread(
            target=self._serve, args=(alive,), name="codecage-gvisor-handoff", daemon=True
        )
        self._thread.start()

    def _serve(self, alive: Any) -> None:
        deadline = time.monotonic() + _HANDOFF_TIMEOUT_S
        try:
            while not self._done.is_set() and time.monotonic() < deadline:
                try:
                    conn, _ = self._listener.accept()
                except TimeoutError:
                    if not alive():
                        return  # runsc ended before the guest came: EOF on the channels
                    continue
                except OSError:
                    return
                with conn, self._lock:
                    if self._fds:
                        conn.settimeout(5)
                        with contextlib.suppress(OSError):
                            socket.send_fds(conn, [b"fds"], self._fds)
                return
        finally:
            self.close()

    def close(self) -> None:
        """Close the listener and the duplicates, remove the socket; idempotent, any thread."""
        self._done.set()
        with self._lock:
            fds, self._fds = self._fds, []
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)
            self._listener.close()
            with contextlib.suppress(OSError):
                self._path.unlink()


# --- the host ---------------------------------------------------------------------------


def _with_descendants(pids: list[int]) -> list[int]:
    """`pids` and every process below them (the Sentry's stubs), from /proc."""
    found: list[int] = []
    todo = list(pids)
    while todo:
        pid = todo.pop()
        if pid in found:
            continue
        found.append(pid)
        with contextlib.suppress(OSError, ValueError):
            for task in Path(f"/proc/{pid}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text("ascii").split()]
    return found


def _wait_gone(pids: list[int], timeout_s: float = 5.0) -> list[int]:
    """Wait until `pids` (not our children: runsc's) have exited; those still there."""
    deadline = time.monotonic() + timeout_s
    left = list(pids)
    while left and time.monotonic() < deadline:
        left = [p for p in left if _running(p)]
        if left:
            time.sleep(0.002)
    if left:
        log.warning("gvisor.processes_left", extra={"pids": left})
    return left


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            state = f.read().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def _find_runsc() -> str:
    path = shutil.which("runsc") or next(
        (p for p in ("/usr/bin/runsc", "/usr/local/bin/runsc") if os.access(p, os.X_OK)), None
    )
    if path is None:
        raise HostError("gVisor (runsc) is not installed", hint=_INSTALL_HINT)
    return path


@functools.cache
def runsc_version(executable: str) -> str | None:
    line = version_line(executable)  # "runsc version 0.0~20221219.0"
    return line.split()[-1] if line and line.split() else None


def _probe_identity() -> Identity | None:
    """Who runsc runs as in `probe`: the sandboxes' host id when codecage is root (rootless,
    as every run), else None (the caller)."""
    if os.geteuid() != 0:
        return None
    who = identities.plan().identity
    return who if who.uid != 0 else None


@functools.cache
def _runsc_works(executable: str, who: Identity | None = None) -> tuple[bool, str]:
    """Can runsc start a sandbox here, as the runs start it? (`runsc do true`, the floor of
    every run: rootless as `who` when given, with a state directory of its own)"""
    with tempfile.TemporaryDirectory(prefix="codecage-runsc-probe-") as state:
        argv = [executable, "--root", state]
        if who is not None:
            os.chown(state, who.uid, who.gid)
            argv = [*become(who), *argv, "--rootless"]
        argv += ["--network=none", f"--platform={PLATFORM}", "--ignore-cgroups", "do", "true"]
        try:
            proc = subprocess.run(
                argv,
                capture_output=True,
                text=True,
                timeout=60,
                env={"PATH": os.defpath},
                cwd="/",
                check=False,
            )
        except (OSError, subprocess.SubprocessError) as exc:
            return False, f"runsc could not start: {exc}"
    if proc.returncode != 0:
        return False, f"runsc failed: {proc.stderr.strip()[-300:]}"
    who_runs = (
        f"runsc, its gofer and the Sentry are host uid {who.uid} (rootless), never root"
        if who is not None
        else "runsc, its gofer and the Sentry run as you"
    )
    return True, (
        "the guest's syscalls are served by the Sentry (gVisor's kernel, an unprivileged "
        f"host process); files through the gofer; {who_runs}; pid, ipc, uts, mount and "
        "network isolated"
    )


if TYPE_CHECKING:  # mypy checks that it is a Backend: every trait stated, with its type
    _IS_A_BACKEND: type[Backend] = GvisorBackend
