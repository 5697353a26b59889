"""The fork server's template and the sandboxes it forks (inside the sandbox, stdlib only).

A template is a guest that has started the interpreter and imported the profile's modules
once, and then never runs user code: it waits on its control socket for "fork" requests.
Each request brings the new sandbox's fds (SCM_RIGHTS) and makes two processes:

    template ── init (PID 1 of a new pid namespace; new mount, ipc, uts and net namespaces:
                  the run's /workspace, /tmp and /proc; reports the guest's exit, then exits)
                 └── guest (PID 2; a user namespace of its own; no capability, the run's
                     seccomp filter, a session of its own) -> the bootstrap's usual path:
                     "ready", then the one request

The template runs (in the bubblewrap sandbox the host started it in) with CAP_SYS_ADMIN and
CAP_SETPCAP in that sandbox's user namespace and a seccomp filter that allows unshare,
setns, mount and move_mount, which the namespaces need; init and the guest give up both
before anything of a run starts, and install the run's own filter (the same one a
bubblewrap sandbox gets) on top. Nothing of one run reaches another: each has its own
namespaces, workspace (a tmpfs the host mounted and passes as a detached mount), /tmp,
cgroup (the host moves init into it before init makes anything) and, when codecage runs as
root, host id: the template's user namespace maps a range of host ids (made by the host,
`isolation.userns.mapped`; no user namespace can be made inside it), the template keeps
CAP_SETUID and CAP_SETGID there, and each maker drops to the run's own id (`uid`, the same
for the gid) before it says hello: the run's processes, files and sockets are that host
id's, and RLIMIT_NPROC (counted per user namespace and id) counts the run's own processes.

Host -> template (the template's control socket): one JSON line and, in the same message,
the fds in `FORK_FDS` order.
    {"v":1,"kind":"fork","tmp_bytes":N[,"uid":ID]}
Init -> host (the "exit" socket; the host reads init's host pid from SO_PASSCRED):
    b"h" hello; the host moves init into the run's cgroup and answers b"g" (go)
    b"x <exit code> <signal>\\n" the guest's end, then init exits
"""

from __future__ import annotations

import _socket
import ctypes
import errno
import gc
import json
import os
import sys
from typing import Any

from . import contract  # `codecage.contract` in the sandbox, `codecage.guest.contract` here

FORK_FDS = ("control", "bridge", "stdout", "stderr", "exit", "workspace")
MAX_FORK_REQUEST_BYTES = 4096
KIND_FORK = "fork"

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
_RUN_NAMESPACES = CLONE_NEWNS | CLONE_NEWIPC | CLONE_NEWUTS | CLONE_NEWNET

_MS_RDONLY = 0x1
_MS_NOSUID = 0x2
_MS_NODEV = 0x4
_MS_NOEXEC = 0x8
_MS_REMOUNT = 0x20
_MS_BIND = 0x1000
_MS_REC = 0x4000
_MS_PRIVATE = 0x40000
_AT_FDCWD = -100
_MOVE_MOUNT_F_EMPTY_PATH = 0x4
_SYS_MOVE_MOUNT = 429  # the same number on every architecture (the generic table)

_PR_SET_PDEATHSIG = 1
_PR_SET_DUMPABLE = 4
_PR_SET_SECCOMP = 22
_PR_CAPBSET_DROP = 24
_PR_SET_NO_NEW_PRIVS = 38
_PR_CAP_AMBIENT = 47
_PR_CAP_AMBIENT_CLEAR_ALL = 4
_SECCOMP_MODE_FILTER = 2
_LINUX_CAPABILITY_VERSION_3 = 0x20080522
_SIGKILL = 9

# bubblewrap covers these with read-only binds of themselves in every /proc it mounts.
_PROC_COVERED = ("sys", "sysrq-trigger", "irq", "bus")
_RECEIVE_TICK_S = 1.0  # how often an idle template reaps the inits that ended

_libc = ctypes.CDLL(None, use_errno=True)


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    ]


def _check(result: int, what: str) -> int:
    if result < 0:
        code = ctypes.get_errno()
        raise OSError(code, f"{what}: {os.strerror(code)}")
    return result


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str = "") -> None:
    _check(
        _libc.mount(
            source.encode() if source else None,
            target.encode(),
            fstype.encode() if fstype else None,
            ctypes.c_ulong(flags),
            data.encode() if data else None,
        ),
        f"mount {target}",
    )


def _prctl(option: int, arg: int) -> None:
    _check(_libc.prctl(option, ctypes.c_ulong(arg), 0, 0, 0), f"prctl {option}")


# --- the template ---------------------------------------------------------------------------


def serve(control: _socket.socket, run_filter: bytes) -> _socket.socket:
    """Answer fork requests until the host closes the control socket (then exit). Returns
    in each forked guest only, with that sandbox's control socket at contract.CONTROL_FD."""
    control.settimeout(_RECEIVE_TICK_S)
    # A fork that failed says why on stderr; should nobody read it, drop the words rather
    # than block the template.
    os.set_blocking(2, False)
    gc.collect()
    gc.freeze()  # the forks' collections skip what exists now: fewer pages copied
    while True:
        _reap_ended()
        request = _receive(control)
        if request is None:
            continue
        fds, tmp_bytes, uid = request
        try:
            pid = os.fork()
        except OSError as exc:
            pid = -1  # the host sees the request's exit socket close, unanswered
            _say(f"codecage: the template could not fork: {exc!r}")
        if pid == 0:
            named = dict(zip(FORK_FDS, fds, strict=True))
            return _start_sandbox(control, named, tmp_bytes, run_filter, uid)
        for fd in fds:
            os.close(fd)


def _reap_ended() -> None:
    """Collect the makers that have exited (the template is their parent)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _receive(control: _socket.socket) -> tuple[list[int], int, int | None] | None:
    """One fork request: its fds, the size of its /tmp and the run's id in this user
    namespace (None: the template's own); None for nothing (a tick, or a
    malformed request, whose fds are closed: the host then sees its exit socket close).
    The host closing the socket ends the template."""
    try:
        data, ancillary, _, _ = control.recvmsg(
            MAX_FORK_REQUEST_BYTES,
            _socket.CMSG_SPACE(len(FORK_FDS) * 4),
            _socket.MSG_CMSG_CLOEXEC,
        )
    except (TimeoutError, InterruptedError):
        return None
    if not data:
        raise SystemExit(0)
    fds = [
        int.from_bytes(payload[i : i + 4], sys.byteorder, signed=True)
        for level, kind, payload in ancillary
        if level == _socket.SOL_SOCKET and kind == _socket.SCM_RIGHTS
        for i in range(0, len(payload) - len(payload) % 4, 4)
    ]
    try:
        message: Any = json.loads(data)
        tmp_bytes = int(message["tmp_bytes"])
        uid = None if message.get("uid") is None else int(message["uid"])
        if message.get("kind") != KIND_FORK or len(fds) != len(FORK_FDS) or tmp_bytes < 1:
            raise ValueError(message)
        if uid is not None and uid <= 0:
            raise ValueError(message)
    except (ValueError, KeyError, TypeError):
        _say(f"codecage: a malformed fork request ({len(data)} bytes, {len(fds)} fds)")
        for fd in fds:
            os.close(fd)
        return None
    return fds, tmp_bytes, uid


# --- the maker and init: one run's namespaces ---------------------------------------------------


def _start_sandbox(
    template_control: _socket.socket,
    fds: dict[str, int],
    tmp_bytes: int,
    run_filter: bytes,
    uid: int | None = None,
) -> _socket.socket:
    """In the maker (the template's child): drop to the run's own id (`uid`), and once
    the host has moved it into the run's cgroup, make the run's namespaces and mounts and
    fork init, the PID 1 of the new pid namespace, then exit (a pid namespace made by
    unshare takes the maker's next child; the template's own children must stay in its
    namespace). Returns in the guest only; any failure ends the process (the host sees
    the exit socket close)."""
    try:
        template_control.detach()  # closed below: the guest's own control fd takes its number
        _close_fds_but({0, 1, 2, *fds.values()})
        exit_sock = _socket.socket(fileno=fds["exit"])
        if uid is not None:
            _become_run_id(uid)
        _hello(exit_sock)  # the host checks the id it sees before anything is made
        _make_run_namespaces(fds["workspace"], tmp_bytes)
        if os.fork() == 0:
            return _init(exit_sock, fds, run_filter)
    except BaseException as exc:
        _fail(exc)
    os._exit(0)


def _init(exit_sock: _socket.socket, fds: dict[str, int], run_filter: bytes) -> _socket.socket:
    """PID 1 of the run: its /proc, then the guest; it reports how the guest ended.
    Returns in the guest only."""
    try:
        _mount_proc()
        exit_sock.sendall(b"i")  # the host reads init's host pid: how it kills the run
        pid = os.fork()
        if pid == 0:
            exit_sock.detach()
            os.close(fds["exit"])
            return _become_guest(fds, run_filter)
        for name in ("control", "bridge", "stdout", "stderr"):
            os.close(fds[name])
        _drop_capabilities()
        _prctl(_PR_SET_DUMPABLE, 0)  # the guest cannot read or write init's memory
        _install_filter(run_filter)
        _wait_for(pid, exit_sock)
    except BaseException as exc:
        _fail(exc)
    os._exit(0)


def _fail(exc: BaseException) -> None:
    _say(f"codecage: the sandbox could not be forked: {exc!r}")
    os._exit(71)


def _say(line: str) -> None:
    try:
        os.write(2, (line + "\n").encode())
    except OSError:
        pass


def _become_run_id(uid: int) -> None:
    """Be the run's own id (uid and gid, no supplementary group). The maker keeps its
    capabilities in the template's user namespace (its ids were not 0: the kernel keeps
    them), which the namespaces and mounts below need; init and the guest give them up.
    Changing ids made the process not dumpable: set back, as a process started anew is
    (the guest's own processes read its /proc)."""
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
    _prctl(_PR_SET_DUMPABLE, 1)


def _hello(exit_sock: _socket.socket) -> None:
    """Tell the host this process exists (it reads the host pid from the message's
    credentials) and wait until it has moved it into the run's cgroup."""
    exit_sock.sendall(b"h")
    if exit_sock.recv(1) != b"g":
        raise SystemExit(0)  # the host gave up on this sandbox


def _make_run_namespaces(workspace_tree: int, tmp_bytes: int) -> None:
    _check(_libc.unshare(CLONE_NEWPID | _RUN_NAMESPACES), "unshare")
    # Private first: nothing mounted below may propagate back to the template's mounts.
    _mount(None, "/", None, _MS_REC | _MS_PRIVATE)
    _check(
        _libc.syscall(
            _SYS_MOVE_MOUNT, workspace_tree, b"", _AT_FDCWD, b"/workspace", _MOVE_MOUNT_F_EMPTY_PATH
        ),
        "move_mount /workspace",
    )
    os.close(workspace_tree)
    _mount("tmpfs", "/tmp", "tmpfs", _MS_NOSUID | _MS_NODEV, f"size={tmp_bytes},mode=1777")  # noqa: S108
    # /dev/shm of its own too: the template's is in its /dev, which every run would share.
    shm = "/dev/shm"  # noqa: S108 - the run's own tmpfs, mounted here
    if os.path.isdir(shm):
        _mount("tmpfs", shm, "tmpfs", _MS_NOSUID | _MS_NODEV, f"size={tmp_bytes},mode=1777")


def _mount_proc() -> None:
    """A read-only /proc of the run's pid namespace (mounted by a process inside it), with
    bubblewrap's covers and the contract's masks, as a bwrap sandbox has it. (The template
    itself has no masks: the kernel mounts a new proc only where the old one is fully
    visible.)"""
    _mount("proc", "/proc", "proc", _MS_RDONLY | _MS_NOSUID | _MS_NODEV | _MS_NOEXEC)
    for name in _PROC_COVERED:
        path = f"/proc/{name}"
        if os.path.exists(path):
            _read_only_bind(path, path)
    # An empty file to mask files with, made in the run's /tmp and unlinked once bound:
    # nothing of the run can reach it to write into it.
    empty = "/tmp/.codecage-empty"  # noqa: S108 - the run's own tmpfs, nothing in it yet
    os.close(os.open(empty, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o444))
    try:
        for path in contract.PROC_MASKED:
            if os.path.isdir(path):
                flags = _MS_RDONLY | _MS_NOSUID | _MS_NODEV | _MS_NOEXEC
                _mount("tmpfs", path, "tmpfs", flags, "size=4k,nr_inodes=1,mode=555")
            elif os.path.exists(path):
                _read_only_bind(empty, path)
    finally:
        os.unlink(empty)


def _read_only_bind(source: str, target: str) -> None:
    _mount(source, target, None, _MS_BIND)
    _mount(None, target, None, _MS_BIND | _MS_REMOUNT | _MS_RDONLY | _MS_NOSUID | _MS_NODEV)


def _wait_for(guest: int, exit_sock: _socket.socket) -> None:
    """Reap every process reparented to init until the guest ends; report how it ended.
    Init exiting then kills whatever is left in the namespace."""
    while True:
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:
            return
        except InterruptedError:
            continue
        if pid == guest:
            break
    code = os.waitstatus_to_exitcode(status)
    line = f"x {code if code >= 0 else ''} {-code if code < 0 else ''}\n"
    try:
        exit_sock.sendall(line.encode("ascii"))
    except OSError:
        pass


# --- the guest: PID 2, what runs the code ------------------------------------------------------


def _become_guest(fds: dict[str, int], run_filter: bytes) -> _socket.socket:
    """Take the run's fds, enter a user namespace of its own, give up every capability and
    install the run's filter: from here it is a sandbox like any other."""
    _prctl(_PR_SET_PDEATHSIG, _SIGKILL)
    devnull = os.open("/dev/null", os.O_RDONLY)
    contract.place_fds(
        [
            (devnull, 0),
            (fds["stdout"], 1),
            (fds["stderr"], 2),
            (fds["control"], 3),
            (fds["bridge"], 4),
        ],
        park_at=300,
    )
    _close_fds_but({0, 1, 2, 3, 4})
    _drop_capabilities()
    _prctl(_PR_SET_NO_NEW_PRIVS, 1)
    _install_filter(run_filter)
    os.setsid()
    os.chdir("/workspace")
    return _socket.socket(fileno=3)


def _close_fds_but(keep: set[int]) -> None:
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd not in keep:
            try:
                os.close(fd)
            except OSError:
                pass  # the fd of the listdir itself is already gone


def _drop_capabilities() -> None:
    """No capability left, in any set, ambient and bounding included."""
    _prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL)
    with open("/proc/sys/kernel/cap_last_cap", "rb") as f:
        last = int(f.read())
    for cap in range(last + 1):
        result = _libc.prctl(_PR_CAPBSET_DROP, ctypes.c_ulong(cap), 0, 0, 0)
        if result < 0 and ctypes.get_errno() != errno.EINVAL:
            _check(result, f"drop capability {cap}")
    header = _CapHeader(_LINUX_CAPABILITY_VERSION_3, 0)
    data = (_CapData * 2)()
    _check(_libc.capset(ctypes.byref(header), data), "capset")


def _install_filter(bpf: bytes) -> None:
    """The run's seccomp filter (a BPF program, as bubblewrap's --seccomp takes it)."""
    buffer = ctypes.create_string_buffer(bpf, len(bpf))
    program = _SockFprog(len(bpf) // 8, ctypes.cast(buffer, ctypes.c_void_p))
    _check(
        _libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(program), 0, 0),
        "seccomp",
    )
