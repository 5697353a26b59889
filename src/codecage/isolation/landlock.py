"""Landlock through raw syscalls, and the launcher of the Landlock backend.

Landlock (Linux 5.13+) lets an unprivileged process restrict itself: once a ruleset is in
force, the process and everything it starts may reach only the files under the paths the
rules name, with the rights they name, and (ABI 4+) bind or connect TCP ports only as
rules allow, and (ABI 6+) signal or reach abstract unix sockets only inside its own
domain, and (ABI 9+) connect or send to pathname unix sockets only inside it or under its
read-write paths. Nothing needs a namespace or a privilege, which is why `backends/landlock.py`, the
fallback where user namespaces are unavailable, is built on it.

Two halves, kept apart:

- planning (pure): `Ruleset.plan` turns "read these, write those" into the access masks of
  the running ABI (every right the ABI knows is handled, so what no rule grants is denied);
- applying: `abi()` asks the kernel, `apply()` creates the ruleset, adds a rule per path
  (a rule on a file gets only the rights a file can take) and restricts the calling
  process; it cannot be undone.

This file is also the launcher the backend runs (`python -I -S launcher.py --config-fd N`):
standard library only, no codecage import, so it runs before and outside the host's
package. Its order is fixed: wait for the host's go (the host moved it into the run's
cgroup meanwhile), new session, death with its parent, rlimits, the sandbox identity
(when root and one is given), every capability dropped, no_new_privs, Landlock, the seccomp
filter, then exec of the guest with a scrubbed environment. No preexec_fn anywhere: the
host is multithreaded.

Syscall numbers are the generic ones (444-446 on every architecture since 5.13).
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import resource
import signal
import stat
import struct
import sys
from dataclasses import dataclass

SYS_LANDLOCK_CREATE_RULESET = 444
SYS_LANDLOCK_ADD_RULE = 445
SYS_LANDLOCK_RESTRICT_SELF = 446
_CREATE_RULESET_VERSION = 1 << 0
_RULE_PATH_BENEATH = 1

# Filesystem rights, by the ABI that introduced them (<linux/landlock.h>).
FS_EXECUTE = 1 << 0
FS_WRITE_FILE = 1 << 1
FS_READ_FILE = 1 << 2
FS_READ_DIR = 1 << 3
FS_REMOVE_DIR = 1 << 4
FS_REMOVE_FILE = 1 << 5
FS_MAKE_CHAR = 1 << 6
FS_MAKE_DIR = 1 << 7
FS_MAKE_REG = 1 << 8
FS_MAKE_SOCK = 1 << 9
FS_MAKE_FIFO = 1 << 10
FS_MAKE_BLOCK = 1 << 11
FS_MAKE_SYM = 1 << 12
FS_REFER = 1 << 13  # ABI 2: link/rename across directories
FS_TRUNCATE = 1 << 14  # ABI 3
FS_IOCTL_DEV = 1 << 15  # ABI 5: ioctl on device files
FS_RESOLVE_UNIX = 1 << 16  # ABI 9 (Linux 7.1): connect/sendmsg to a pathname unix socket
NET_BIND_TCP = 1 << 0  # ABI 4
NET_CONNECT_TCP = 1 << 1  # ABI 4
SCOPE_ABSTRACT_UNIX_SOCKET = 1 << 0  # ABI 6
SCOPE_SIGNAL = 1 << 1  # ABI 6
# ABI 7 adds audit logging flags (landlock_restrict_self), no access right; ABI 8 a flag
# to restrict every thread at once.
ABI_RESOLVE_UNIX = 9
"""From this ABI a domain that handles FS_RESOLVE_UNIX reaches only the pathname unix
sockets made inside it or under a rule granting it; below it, any the uid may write to."""

_FS_BY_ABI = {
    1: (1 << 13) - 1,
    2: FS_REFER,
    3: FS_TRUNCATE,
    5: FS_IOCTL_DEV,
    ABI_RESOLVE_UNIX: FS_RESOLVE_UNIX,
}
_FILE_RIGHTS = FS_EXECUTE | FS_WRITE_FILE | FS_READ_FILE | FS_TRUNCATE | FS_IOCTL_DEV
"""The only rights a rule on a file (not a directory) may carry."""

READ_ONLY = FS_EXECUTE | FS_READ_FILE | FS_READ_DIR
READ_WRITE = (
    READ_ONLY
    | FS_WRITE_FILE
    | FS_REMOVE_DIR
    | FS_REMOVE_FILE
    | FS_MAKE_DIR
    | FS_MAKE_REG
    | FS_MAKE_SOCK
    | FS_MAKE_FIFO
    | FS_MAKE_SYM
    | FS_REFER
    | FS_TRUNCATE
    | FS_RESOLVE_UNIX
)
"""Everything but device nodes (MAKE_CHAR/BLOCK) and device ioctls: the run's own sockets
(in its workspace and tmp) may be connected to."""
DEVICE_RW = FS_READ_FILE | FS_WRITE_FILE | FS_TRUNCATE  # /dev/null and the like
DEVICE_RO = FS_READ_FILE  # /dev/urandom
PROC_RO = FS_READ_FILE | FS_READ_DIR


@dataclass(frozen=True, slots=True)
class Rule:
    """Allow `access` under `path` (a directory and everything below it, or one file)."""

    path: str
    access: int


@dataclass(frozen=True, slots=True)
class Ruleset:
    """What one sandbox's Landlock domain handles, and the rules that open it up."""

    abi: int
    handled_fs: int
    handled_net: int
    scoped: int
    rules: tuple[Rule, ...]

    @classmethod
    def plan(cls, abi: int, rules: tuple[Rule, ...], *, network: bool = False) -> Ruleset:
        """Handle every right `abi` knows (what no rule grants is then denied), TCP bind
        and connect (unless `network`) and the ABI 6 scopes; each rule's rights are cut to
        what is handled (pure).

        Raises:
            ValueError: `abi` is below 1 (no Landlock).
        """
        if abi < 1:
            raise ValueError("Landlock is not available (ABI < 1)")
        handled_fs = 0
        for since, rights in _FS_BY_ABI.items():
            if abi >= since:
                handled_fs |= rights
        handled_net = NET_BIND_TCP | NET_CONNECT_TCP if abi >= 4 and not network else 0
        scoped = SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL if abi >= 6 else 0
        cut = tuple(Rule(r.path, r.access & handled_fs) for r in rules if r.access & handled_fs)
        return cls(abi, handled_fs, handled_net, scoped, cut)

    def to_json(self) -> dict[str, object]:
        return {
            "abi": self.abi,
            "handled_fs": self.handled_fs,
            "handled_net": self.handled_net,
            "scoped": self.scoped,
            "rules": [[r.path, r.access] for r in self.rules],
        }

    @classmethod
    def from_json(cls, data: dict[str, object]) -> Ruleset:
        rules = data["rules"]
        if not isinstance(rules, list):
            raise TypeError("rules must be a list")
        return cls(
            abi=int(str(data["abi"])),
            handled_fs=int(str(data["handled_fs"])),
            handled_net=int(str(data["handled_net"])),
            scoped=int(str(data["scoped"])),
            rules=tuple(Rule(str(p), int(a)) for p, a in rules),
        )


# --- applying -------------------------------------------------------------------------


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _syscall(number: int, *args: object) -> int:
    libc = _libc()
    libc.syscall.restype = ctypes.c_long
    ctypes.set_errno(0)
    result = int(libc.syscall(ctypes.c_long(number), *args))
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return result


def abi() -> int:
    """The Landlock ABI version of the running kernel; 0 when it has none or it is off."""
    try:
        return _syscall(SYS_LANDLOCK_CREATE_RULESET, None, ctypes.c_size_t(0),
                        ctypes.c_uint32(_CREATE_RULESET_VERSION))  # fmt: skip
    except OSError:
        return 0


def _attr_bytes(ruleset: Ruleset) -> bytes:
    """struct landlock_ruleset_attr, as long as the ABI knows it."""
    if ruleset.abi >= 6:
        return struct.pack("=QQQ", ruleset.handled_fs, ruleset.handled_net, ruleset.scoped)
    if ruleset.abi >= 4:
        return struct.pack("=QQ", ruleset.handled_fs, ruleset.handled_net)
    return struct.pack("=Q", ruleset.handled_fs)


def prepare(ruleset: Ruleset) -> int:
    """Create `ruleset` in the kernel and add its rules; returns the ruleset's fd (for
    `restrict`). A path that does not exist is skipped (it grants nothing); a rule on a
    file gets only the rights a file can take. Done while the paths can still be opened
    (before the launcher changes its identity).

    Raises:
        OSError: the kernel refused the ruleset or a rule, or a path cannot be opened.
    """
    attr = _attr_bytes(ruleset)
    buf = ctypes.create_string_buffer(attr, len(attr))
    fd = _syscall(SYS_LANDLOCK_CREATE_RULESET, buf, ctypes.c_size_t(len(attr)), ctypes.c_uint32(0))
    try:
        for rule in ruleset.rules:
            _add_rule(fd, rule)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _add_rule(ruleset_fd: int, rule: Rule) -> None:
    try:
        path_fd = os.open(rule.path, os.O_PATH | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    try:
        access = rule.access
        if not stat.S_ISDIR(os.fstat(path_fd).st_mode):
            access &= _FILE_RIGHTS
        if not access:
            return
        # struct landlock_path_beneath_attr is packed: u64 then s32.
        beneath = ctypes.create_string_buffer(struct.pack("=Qi", access, path_fd), 12)
        _syscall(SYS_LANDLOCK_ADD_RULE, ctypes.c_int(ruleset_fd),
                 ctypes.c_int(_RULE_PATH_BENEATH), beneath, ctypes.c_uint32(0))  # fmt: skip
    finally:
        os.close(path_fd)


def restrict(ruleset_fd: int) -> None:
    """Put the calling thread (and what it starts) under the prepared ruleset, for good;
    closes its fd. The caller must have set no_new_privs (or hold CAP_SYS_ADMIN).

    Raises:
        OSError: the kernel refused.
    """
    try:
        _syscall(SYS_LANDLOCK_RESTRICT_SELF, ctypes.c_int(ruleset_fd), ctypes.c_uint32(0))
    finally:
        os.close(ruleset_fd)


def apply(ruleset: Ruleset) -> None:
    """`prepare` then `restrict`: the calling process is under `ruleset` from now on.

    Raises:
        OSError: the kernel refused.
    """
    restrict(prepare(ruleset))


# --- the launcher ---------------------------------------------------------------------

_PR_SET_PDEATHSIG = 1
_PR_CAPBSET_DROP = 24
_PR_SET_SECUREBITS = 28
_PR_SET_NO_NEW_PRIVS = 38
_PR_CAP_AMBIENT = 47
_PR_CAP_AMBIENT_CLEAR_ALL = 4
_PR_SET_SECCOMP = 22
_SECCOMP_MODE_FILTER = 2
_SECBIT_LOCKS = 0x2F  # NOROOT, NOROOT_LOCKED, NO_SETUID_FIXUP_LOCKED, KEEP_CAPS_LOCKED
_LINUX_CAPABILITY_VERSION_3 = 0x20080522
LAUNCHER_FAILED = 126
"""The launcher's exit code when a step failed before the guest ran (stderr says which)."""


class _Fprog(ctypes.Structure):
    _fields_ = (("len", ctypes.c_ushort), ("filter", ctypes.c_void_p))


def _prctl(option: int, arg: int = 0) -> None:
    libc = _libc()
    ctypes.set_errno(0)
    if libc.prctl(option, ctypes.c_ulong(arg), 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl({option}): {os.strerror(err)}")


def _drop_capabilities() -> None:
    """No capability now or after any exec: securebits locked (no root fix-up), the
    bounding and ambient sets emptied, then every set zeroed."""
    _bound_capabilities()
    header = struct.pack("=Ii", _LINUX_CAPABILITY_VERSION_3, 0)
    data = bytes(24)  # two __user_cap_data_struct, all zero
    ctypes.set_errno(0)
    if _libc().capset(ctypes.c_char_p(header), ctypes.c_char_p(data)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"capset: {os.strerror(err)}")


def _bound_capabilities() -> None:
    """Securebits locked and the bounding and ambient sets emptied: what only a process
    with CAP_SETPCAP can do, so done before root becomes the sandbox's identity."""
    if os.geteuid() == 0:
        _prctl(_PR_SET_SECUREBITS, _SECBIT_LOCKS)
    try:
        with open("/proc/sys/kernel/cap_last_cap", encoding="ascii") as f:
            last = int(f.read())
    except OSError:
        last = 40
    for cap in range(last + 1):
        try:
            _prctl(_PR_CAPBSET_DROP, cap)
        except OSError as exc:
            if exc.errno not in (errno.EPERM, errno.EINVAL):
                raise
            break  # unprivileged: the bounding set cannot change, and need not
    _libc().prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)


def _load_seccomp(fd: int) -> None:
    bpf = b""
    while chunk := os.read(fd, 65536):
        bpf += chunk
    os.close(fd)
    if not bpf or len(bpf) % 8:
        raise OSError(errno.EINVAL, "the seccomp filter is empty or not whole instructions")
    program = ctypes.create_string_buffer(bpf, len(bpf))
    fprog = _Fprog(len(bpf) // 8, ctypes.addressof(program))
    libc = _libc()
    ctypes.set_errno(0)
    if libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"seccomp: {os.strerror(err)}")


def _read_all(fd: int) -> bytes:
    data = b""
    while chunk := os.read(fd, 65536):
        data += chunk
    os.close(fd)
    return data


def launch(config: dict[str, object]) -> None:
    """Do the launcher's steps in order, then exec the guest; returns only by raising."""
    # Once it is the sandbox's identity, the launcher may not read its own interpreter's
    # stdlib (a pyenv under /root): what it uses later is loaded now.
    import encodings.ascii  # noqa: F401 - text files opened later decode with it

    identity = config.get("identity")
    if isinstance(identity, list) and os.geteuid() == 0:
        _bound_capabilities()
        uid, gid = int(identity[0]), int(identity[1])
        os.setgroups([])
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)
    ready_fd = int(str(config["ready_fd"]))
    os.write(ready_fd, b"1")  # the host now checks who we are, and moves us into the cgroup
    os.close(ready_fd)
    block_fd = int(str(config["block_fd"]))
    os.read(block_fd, 1)  # the host's go
    os.close(block_fd)
    parent = int(str(config["parent_pid"]))
    if os.getsid(0) != os.getpid():
        os.setsid()
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the host died before the line above
        raise OSError(errno.ESRCH, "the host process is gone")
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    ruleset = config["ruleset"]
    if not isinstance(ruleset, dict):
        raise TypeError("ruleset must be an object")
    ruleset_fd = prepare(Ruleset.from_json(ruleset))
    _drop_capabilities()
    _prctl(_PR_SET_NO_NEW_PRIVS, 1)
    os.chdir(str(config["cwd"]))
    restrict(ruleset_fd)
    _load_seccomp(int(str(config["seccomp_fd"])))
    argv = config["argv"]
    env = config["env"]
    if not isinstance(argv, list) or not isinstance(env, dict):
        raise TypeError("argv must be a list and env an object")
    guest_env = {str(k): str(v) for k, v in env.items()}
    os.execve(str(argv[0]), [str(a) for a in argv], guest_env)  # noqa: S606 - the guest


def main(args: list[str]) -> int:
    try:
        config = json.loads(_read_all(int(args[args.index("--config-fd") + 1])))
        launch(config)
    except BaseException as exc:
        sys.stderr.write(f"codecage landlock launcher: {type(exc).__name__}: {exc}\n")
        sys.stderr.flush()
        os._exit(LAUNCHER_FAILED)
    return LAUNCHER_FAILED  # pragma: no cover - execve does not return


if __name__ == "__main__":
    sys.exit(main(sys.argv))
