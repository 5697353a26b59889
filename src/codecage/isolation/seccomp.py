"""seccomp-BPF: the syscall deny-list that bubblewrap (--seccomp) installs as the guest starts.

The model is Docker's, bubblewrap's and Flatpak's: every syscall is allowed unless a rule
below denies it. Namespaces, a read-only root and dropped capabilities already contain the
guest; this filter removes the kernel interfaces a contained process has no business with,
so that a kernel bug behind one of them is out of reach too.

What the filter does (see `_rules` for the exact list, logged at DEBUG when compiled):

- the syscalls of `SeccompPlan.denied_syscalls` fail with EPERM;
- `clone3` and `openat2` fail with ENOSYS: their flags and mode sit in a struct that BPF
  cannot read, and callers fall back, as on a kernel without them, to `clone` and `openat`,
  whose arguments the filter can inspect (glibc's and CPython's open() use openat anyway);
- setting S_ISUID or S_ISGID fails with EPERM: chmod-like calls whose mode has either bit,
  and calls that create a file or directory with either bit in their mode argument
  (`SeccompPlan.setid_mode_args`). The guest's uid is the host uid of whoever runs
  codecage, root included, and a `--workspace DIR` outlives the run: a setuid file left
  there would be a privilege-escalation plant on the host;
- `clone` with any CLONE_NEW* flag, `ioctl` TIOCSTI/TIOCLINUX, `personality` with flags
  from ADDR_NO_RANDOMIZE up, and `socket`/`socketpair` of a refused family fail with EPERM;
- a syscall made through another ABI of the CPU (i386 `int 0x80`, x32) kills the process.

pyseccomp (a ctypes wrapper over libseccomp, without type stubs) is used here and nowhere else.
"""

from __future__ import annotations

import atexit
import ctypes
import errno
import logging
import os
import socket
import stat
import termios
import threading
import weakref
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Literal

from codecage import forks
from codecage.errors import HostError
from codecage.models import LayerStatus

log = logging.getLogger(__name__)

LIBSECCOMP_HINT = (
    "install libseccomp (Debian/Ubuntu: `apt-get install libseccomp2`; "
    "Fedora: `dnf install libseccomp`), then run `codecage doctor`"
)

# --- what is denied, and why ------------------------------------------------------------

_DENIED_SYSCALLS: tuple[str, ...] = (
    # Reading or changing another process's memory, registers or files: the classic way
    # out of a sandbox that shares a kernel with something more privileged.
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "process_madvise",
    "kcmp",  # compares kernel objects of two processes (an address-layout oracle)
    "pidfd_getfd",  # copies a file descriptor out of another process
    # Changing the filesystem view: bubblewrap builds the mount tree, the guest must
    # not remount, unmount or re-root it (old and new mount APIs alike).
    "mount",
    "umount2",
    "pivot_root",
    "chroot",
    "fsopen",
    "fsconfig",
    "fsmount",
    "fspick",
    "move_mount",
    "open_tree",
    "open_tree_attr",
    "mount_setattr",
    # New or foreign namespaces: a new user namespace hands out every capability inside
    # it and with them large, bug-prone parts of the kernel (netfilter, filesystems).
    # `clone` with CLONE_NEW* flags is refused by a rule of its own, below.
    "unshare",
    "setns",
    # Kernel subsystems that are a steady source of privilege escalations and that agent
    # code does not need: eBPF, perf events, userfaultfd (a race-widening tool), io_uring.
    "bpf",
    "perf_event_open",
    "userfaultfd",
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    # Kernel keyrings are not namespaced: keys would be shared with the host user.
    "keyctl",
    "add_key",
    "request_key",
    # Loading code into the kernel, or replacing it.
    "kexec_load",
    "kexec_file_load",
    "init_module",
    "finit_module",
    "delete_module",
    # Whole-machine state: power, swap, process accounting, disk quotas, the kernel log,
    # raw I/O ports, the terminal of the session.
    "reboot",
    "swapon",
    "swapoff",
    "acct",
    "quotactl",
    "quotactl_fd",
    "syslog",
    "iopl",
    "ioperm",
    "vhangup",
    # The system clock is not namespaced (time namespaces only offset monotonic/boottime).
    "settimeofday",
    "clock_settime",
    "clock_adjtime",
    "adjtimex",
    # Opening files by handle bypasses path lookup, and with it the sandbox's mount tree
    # (the "shocker" container escape).
    "open_by_handle_at",
    "name_to_handle_at",
    # Obsolete interfaces, kept by the kernel for old binaries; nothing today needs them.
    "uselib",
    "ustat",
    "sysfs",
    "_sysctl",
    "nfsservctl",
    "lookup_dcookie",
    # NUMA memory placement: moves pages of this or another process between nodes, a
    # noisy-neighbour tool on a shared host. get_mempolicy stays allowed: it only reads
    # the caller's own policy, and libnuma/hwloc (under OpenBLAS, PyTorch) probe with it.
    "mbind",
    "set_mempolicy",
    "set_mempolicy_home_node",
    "migrate_pages",
    "move_pages",
)

# clone3 -> clone; openat2 -> openat (openat2's mode is in a struct open_how, out of reach
# of the S_ISUID/S_ISGID rules below; glibc does not use openat2 for open()).
_ENOSYS_SYSCALLS: tuple[str, ...] = ("clone3", "openat2")

# Setting S_ISUID or S_ISGID. Inside the sandbox they do nothing (no_new_privs, nosuid
# mounts), but the guest's uid maps to the uid that started bwrap: when that is root, a
# setuid file in a user's --workspace DIR stays behind as a setuid-root binary on the host.
# Each syscall that sets a mode is named with the index of its mode argument. open and
# openat read the mode only with O_CREAT or O_TMPFILE; glibc passes 0 otherwise, so
# looking at the mode alone refuses nothing a real program does. mkdir ignores S_ISUID and
# S_ISGID today; the rule refuses asking for them all the same.
_SETID_MODE_ARGS: tuple[tuple[str, int], ...] = (
    ("chmod", 1),
    ("fchmod", 1),
    ("fchmodat", 2),
    ("fchmodat2", 2),
    ("open", 2),
    ("openat", 3),
    ("creat", 1),
    ("mkdir", 1),
    ("mkdirat", 2),
    ("mknod", 1),
    ("mknodat", 2),
)
# <sys/stat.h>. One MASKED_EQ rule per bit: libseccomp ORs the rules of a syscall, and
# the kernel reads the mode as a umode_t, so only these low bits matter, whatever the rest.
_SETID_BITS: dict[str, int] = {"S_ISUID": stat.S_ISUID, "S_ISGID": stat.S_ISGID}

# <linux/sched.h>. CLONE_NEWTIME (0x80) lies in the exit-signal byte of clone(), so the
# kernel honours it only through clone3 or unshare, both refused outright; the rule costs
# nothing and would only refuse an exit signal above 127, which no valid signal is.
_CLONE_NAMESPACE_FLAGS: dict[str, int] = {
    "CLONE_NEWTIME": 0x00000080,
    "CLONE_NEWNS": 0x00020000,
    "CLONE_NEWCGROUP": 0x02000000,
    "CLONE_NEWUTS": 0x04000000,
    "CLONE_NEWIPC": 0x08000000,
    "CLONE_NEWUSER": 0x10000000,
    "CLONE_NEWPID": 0x20000000,
    "CLONE_NEWNET": 0x40000000,
}

# Pushing bytes into the input queue of a terminal (TIOCSTI) or of the Linux console
# (TIOCLINUX) lets code type commands into a shell outside the sandbox that shares the
# terminal. The kernel reads ioctl's request as 32 bits, so only those are compared:
# otherwise setting any upper bit would slip past the rule (Flatpak CVE-2019-10063).
_TERMINAL_INJECTION_IOCTLS: dict[str, int] = {
    "TIOCSTI": termios.TIOCSTI,
    "TIOCLINUX": termios.TIOCLINUX,
}
_IOCTL_REQUEST_MASK = 0xFFFFFFFF

# personality(): the execution domain (PER_LINUX, PER_LINUX32) and UNAME26 stay allowed;
# every flag from ADDR_NO_RANDOMIZE (0x0040000) up is refused: ADDR_NO_RANDOMIZE,
# MMAP_PAGE_ZERO, READ_IMPLIES_EXEC, ADDR_COMPAT_LAYOUT and the ADDR_LIMIT_* layouts do
# nothing but switch off defences (ASLR, non-executable data, the guard below address
# mmap_min_addr) that exploits have had to get around. One comparison
# per argument is all libseccomp allows in a rule, so the query value 0xffffffff is refused
# with them (Docker allows it); only tools like setarch and gdb query, to set those flags.
_PERSONALITY_FLAGS_FLOOR = 0x0040000

# Socket families when the run is allowed egress: IP sockets, which reach only the
# sandbox's own loopback (the relay to the host proxy). Netlink stays refused (glibc's
# getaddrinfo then assumes both IPv4 and IPv6, and names are the proxy's to resolve), and
# AF_PACKET, AF_VSOCK, AF_ALG, AF_RDS and the other families too: rarely needed and a long
# list of kernel CVEs. Without network only AF_UNIX is allowed.
_NETWORK_SOCKET_FAMILIES: tuple[int, ...] = (
    socket.AF_UNIX,
    socket.AF_INET,
    socket.AF_INET6,
)
_SOCKET_SYSCALLS: tuple[str, ...] = ("socket", "socketpair")

# Since Linux 5.1 (syscall 424) every architecture numbers a new syscall the same, except
# alpha, ia64 and mips (offsets). When libseccomp is older than the syscall, the filter
# names it by this number, on the architectures below, rather than leave it out.
_UNIFIED_SYSCALL_NUMBERS: dict[str, int] = {
    "io_uring_setup": 425,
    "io_uring_enter": 426,
    "io_uring_register": 427,
    "open_tree": 428,
    "move_mount": 429,
    "fsopen": 430,
    "fsconfig": 431,
    "fsmount": 432,
    "fspick": 433,
    "clone3": 435,
    "pidfd_getfd": 438,
    "process_madvise": 440,
    "mount_setattr": 442,
    "quotactl_fd": 443,
    "set_mempolicy_home_node": 450,
    "fchmodat2": 452,
    "open_tree_attr": 467,
}
_UNIFIED_NUMBERING_ARCHES: frozenset[str] = frozenset(
    {"x86_64", "x86", "aarch64", "arm", "riscv64", "ppc", "ppc64", "ppc64le", "s390", "s390x"}
)

_U64 = 0xFFFF_FFFF_FFFF_FFFF


# --- the plan (pure) ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SeccompPlan:
    """The filter to build for one run.

    Attributes:
        denied_syscalls: answered with EPERM whatever their arguments.
        enosys_syscalls: answered with ENOSYS, so that libc falls back to an older call
            (clone3 -> clone, openat2 -> openat, whose arguments the filter can inspect).
        allow_inet_sockets: False: socket()/socketpair() of any family but AF_UNIX get
            EPERM. True: AF_INET and AF_INET6 are allowed too (egress through the relay);
            every other family, netlink included, still gets EPERM.
        setid_mode_args: (syscall, index of its mode argument) pairs: the syscall is
            answered with EPERM when that argument has S_ISUID or S_ISGID set, so that no
            file or directory gets either bit (chmod, fchmod, fchmodat, fchmodat2, and the
            calls that create with a mode: open, openat, creat, mkdir, mkdirat, mknod,
            mknodat). Empty: no such rule.
        unix_addressing: True: a socket may be connected and sent to by address. False:
            `connect`, `sendmsg` and `sendmmsg` are answered with EACCES, and so is `sendto`
            with an address (a send on a connected socket, sendto with none, still works):
            for a guest that shares the host's filesystem (the Landlock fallback) where
            Landlock cannot refuse a pathname unix socket itself (ABI < 9). Only AF_UNIX
            sockets can be made there, and the run's channels are handed over as fds, so
            this keeps it from every host socket, at the cost of its own (a listener in
            its tmp cannot be connected to either).

    Besides these, every filter refuses `clone` with a CLONE_NEW* flag, the TIOCSTI and
    TIOCLINUX ioctls and `personality` flags from ADDR_NO_RANDOMIZE up (EPERM), and kills
    the process on a syscall of another ABI (i386, x32).
    """

    denied_syscalls: tuple[str, ...]
    enosys_syscalls: tuple[str, ...]
    allow_inet_sockets: bool
    setid_mode_args: tuple[tuple[str, int], ...]
    unix_addressing: bool = True

    def __post_init__(self) -> None:
        both = set(self.denied_syscalls) & set(self.enosys_syscalls)
        if both:
            raise ValueError(f"syscalls both denied and ENOSYS: {sorted(both)}")
        # A mode rule for a syscall that is refused outright would never be reached.
        refused = set(self.denied_syscalls) | set(self.enosys_syscalls)
        shadowed = {name for name, _ in self.setid_mode_args} & refused
        if shadowed:
            raise ValueError(f"mode rules for syscalls already refused: {sorted(shadowed)}")
        bad_args = [(name, arg) for name, arg in self.setid_mode_args if not 0 <= arg <= 5]
        if bad_args:
            raise ValueError(f"syscall arguments are numbered 0 to 5: {bad_args}")


_TEMPLATE_NEEDS: tuple[str, ...] = ("unshare", "mount", "move_mount")
"""What a fork server's template (guest/template.py) calls to make each run's namespaces
and mounts; the run's own processes then install the full filter on top."""


def plan(
    *, network: bool = False, template: bool = False, unix_addressing: bool = True
) -> SeccompPlan:
    """The seccomp filter for a run, with or without network access; or, `template`, for a
    fork server's template: the same, less `_TEMPLATE_NEEDS`; without `unix_addressing`,
    no connect or addressed send (`SeccompPlan.unix_addressing`). Pure.

    Raises:
        Nothing.
    """
    denied = _DENIED_SYSCALLS
    if template:
        denied = tuple(name for name in denied if name not in _TEMPLATE_NEEDS)
    return SeccompPlan(
        denied_syscalls=denied,
        enosys_syscalls=_ENOSYS_SYSCALLS,
        allow_inet_sockets=network,
        setid_mode_args=_SETID_MODE_ARGS,
        unix_addressing=unix_addressing,
    )


@dataclass(frozen=True, slots=True)
class _Cond:
    """One comparison of a syscall argument (libseccomp's struct scmp_arg_cmp)."""

    arg: int
    op: Literal["EQ", "NE", "GE", "MASKED_EQ"]
    value: int
    mask: int = _U64  # only read by MASKED_EQ

    def describe(self) -> str:
        if self.op == "MASKED_EQ":
            return f"a{self.arg} & {self.mask:#x} == {self.value:#x}"
        symbol = {"EQ": "==", "NE": "!=", "GE": ">="}[self.op]
        return f"a{self.arg} {symbol} {self.value:#x}"


@dataclass(frozen=True, slots=True)
class _Rule:
    """Answer `syscall` with `errno` when every condition holds (always, when none)."""

    syscall: str
    errno: int
    conditions: tuple[_Cond, ...] = ()

    def describe(self) -> str:
        where = " and ".join(c.describe() for c in self.conditions)
        return f"{self.syscall}{f' if {where}' if where else ''} -> {errno.errorcode[self.errno]}"


def _values_outside(allowed: tuple[int, ...], arg: int) -> tuple[_Cond, ...]:
    """Comparisons of `arg` that, taken together, match every 64-bit value not in `allowed`.

    libseccomp takes one comparison per argument in a rule, so a range cannot be written
    as `low <= x <= high`: the gaps between allowed values become aligned power-of-two
    blocks (one MASKED_EQ each), and everything above the largest allowed value one GE.
    """
    conds: list[_Cond] = []
    low = 0
    for value in sorted(set(allowed)):
        while low < value:
            size = 1 << ((value - low).bit_length() - 1)
            if low:
                size = min(size, low & -low)
            if size == 1:
                conds.append(_Cond(arg, "EQ", low))
            else:
                conds.append(_Cond(arg, "MASKED_EQ", low, mask=_U64 & ~(size - 1)))
            low += size
        low = value + 1
    conds.append(_Cond(arg, "GE", low))
    return tuple(conds)


def _rules(seccomp_plan: SeccompPlan, *, clone_flags_arg: int) -> tuple[_Rule, ...]:
    """Every rule of the filter for `seccomp_plan`, in order. Pure."""
    rules = [_Rule(name, errno.EPERM) for name in seccomp_plan.denied_syscalls]
    rules += [_Rule(name, errno.ENOSYS) for name in seccomp_plan.enosys_syscalls]
    rules += [
        _Rule("clone", errno.EPERM, (_Cond(clone_flags_arg, "MASKED_EQ", flag, mask=flag),))
        for flag in _CLONE_NAMESPACE_FLAGS.values()
    ]
    rules += [
        _Rule("ioctl", errno.EPERM, (_Cond(1, "MASKED_EQ", cmd, mask=_IOCTL_REQUEST_MASK),))
        for cmd in _TERMINAL_INJECTION_IOCTLS.values()
    ]
    rules.append(_Rule("personality", errno.EPERM, (_Cond(0, "GE", _PERSONALITY_FLAGS_FLOOR),)))
    rules += [
        _Rule(name, errno.EPERM, (_Cond(arg, "MASKED_EQ", bit, mask=bit),))
        for name, arg in seccomp_plan.setid_mode_args
        for bit in _SETID_BITS.values()
    ]
    for call in _SOCKET_SYSCALLS:
        if not seccomp_plan.allow_inet_sockets:
            rules.append(_Rule(call, errno.EPERM, (_Cond(0, "NE", socket.AF_UNIX),)))
            continue
        rules += [
            _Rule(call, errno.EPERM, (cond,))
            for cond in _values_outside(_NETWORK_SOCKET_FAMILIES, arg=0)
        ]
    if not seccomp_plan.unix_addressing:
        rules += [_Rule(name, errno.EACCES) for name in _ADDRESSING_SYSCALLS]
        # sendto(fd, buf, len, flags, dest_addr, addrlen): refused when dest_addr is set.
        rules.append(_Rule("sendto", errno.EACCES, (_Cond(4, "NE", 0),)))
    return tuple(rules)


_ADDRESSING_SYSCALLS = ("connect", "sendmsg", "sendmmsg")
"""What names a socket to reach by an address seccomp cannot read (`unix_addressing`)."""


# --- libseccomp (the only place pyseccomp is used) ------------------------------------------


def _pyseccomp() -> ModuleType:
    """Import pyseccomp here rather than at the top: it loads libseccomp on import, and a
    host without libseccomp must still be able to import codecage and report the layer
    missing (`codecage info`) instead of failing at start-up.

    Raises:
        HostError: libseccomp (or pyseccomp) cannot be loaded.
    """
    try:
        import pyseccomp
    except (ImportError, OSError, RuntimeError, AttributeError) as exc:
        raise HostError(
            f"seccomp filters cannot be built: libseccomp cannot be loaded ({exc})",
            hint=LIBSECCOMP_HINT,
        ) from exc
    module: ModuleType = pyseccomp
    return module


def _libseccomp_version() -> str:
    """libseccomp's version as X.Y.Z, "unknown" where it does not say (before 2.3)."""

    class _Version(ctypes.Structure):
        _fields_ = (("major", ctypes.c_uint), ("minor", ctypes.c_uint), ("micro", ctypes.c_uint))

    try:
        # The SONAME pyseccomp has already loaded; dlopen returns the same library.
        lib = ctypes.CDLL("libseccomp.so.2")
        version_fn = lib.seccomp_version
    except (OSError, AttributeError):
        return "unknown"
    version_fn.restype = ctypes.POINTER(_Version)
    version_fn.argtypes = ()
    v = version_fn().contents
    return f"{v.major}.{v.minor}.{v.micro}"


def _arch_name(seccomp: ModuleType, arch: int) -> str:
    names: dict[int, str] = {
        int(value): str(name).lower()
        for name, value in vars(seccomp.Arch).items()
        if name.isupper() and name != "NATIVE"
    }
    return names.get(arch, f"arch {arch:#x}")


@dataclass(frozen=True, slots=True)
class _Compiled:
    program: bytes
    arch: str
    bad_arch_action: str
    skipped: tuple[tuple[str, str], ...]  # (syscall, why it is not in the filter)


def _syscall_number(seccomp: ModuleType, name: str, arch: str) -> int | str:
    """The number of `name` on the native architecture, or why the filter cannot name it."""
    number = int(seccomp.resolve_syscall(seccomp.Arch.NATIVE, name))
    if number >= 0:
        return number
    if name in _UNIFIED_SYSCALL_NUMBERS and arch in _UNIFIED_NUMBERING_ARCHES:
        return _UNIFIED_SYSCALL_NUMBERS[name]
    if number == -1:  # __NR_SCALL_NONE: libseccomp has never heard of it
        return f"unknown to libseccomp {_libseccomp_version()}"
    # A negative "pseudo-syscall" number: a real syscall, but of other architectures.
    return f"not a syscall on {arch}"


def _set_bad_arch_action(seccomp: ModuleType, syscall_filter: Any) -> str:
    # A filter covers one ABI. On x86_64 a process can still enter the kernel as i386
    # (`int 0x80`) or x32 (syscall numbers with bit 30 set); with other numbers, such a
    # call would slip past every rule above. libseccomp answers them with this action.
    try:
        syscall_filter.set_attr(seccomp.Attr.ACT_BADARCH, seccomp.KILL_PROCESS)
    except OSError:
        # Kernels before 4.14 have no SECCOMP_RET_KILL_PROCESS; killing the thread is
        # the strongest answer left.
        syscall_filter.set_attr(seccomp.Attr.ACT_BADARCH, seccomp.KILL_THREAD)
        log.warning("seccomp: this kernel cannot kill the process; bad-arch kills the thread")
        return "KILL_THREAD"
    return "KILL_PROCESS"


# libseccomp keeps process-wide state (its API level, probed on first use) and is not
# documented as thread-safe; the pool's starter threads may compile at the same moment.
_LIBSECCOMP_LOCK = threading.Lock()
_exiting = False  # set (under the lock) by `_no_filters_at_exit`; no compile starts after


class _ExitOrder:
    """A weakly referable nobody: see `_no_filters_at_exit`."""


def _no_filters_at_exit() -> None:
    """At interpreter exit, wait for a compile under way and let no other one begin.

    pyseccomp frees each filter with a `weakref.finalize`, and the interpreter's exit runs
    every finalizer still pending (`weakref.finalize._exitfunc`, an atexit hook) whichever
    thread is still using its object. A warm pool's starter (a daemon thread) compiling a
    filter while the process exits early (`codecage serve` refusing its configuration)
    then wrote into a filter freed under it: SIGSEGV, a few exits in a hundred. This hook
    runs before that one (atexit runs the later registered first; see below), so no filter
    is in use when that one runs, and none is made after: a compile from then on fails, a
    HostError like any other, which a starter thread survives.
    """
    global _exiting
    with _LIBSECCOMP_LOCK:
        _exiting = True


def _new_lock_in_child() -> None:
    """A forked child's own lock: a thread of the parent may have held the old one at the
    fork, and the child's exit (`_no_filters_at_exit`) would wait for it for ever."""
    global _LIBSECCOMP_LOCK
    _LIBSECCOMP_LOCK = threading.Lock()


# weakref registers its exit hook with the first finalizer of the process; one made here
# (for an object that dies at once) makes sure it is registered before ours.
weakref.finalize(_ExitOrder(), lambda: None)
atexit.register(_no_filters_at_exit)
forks.on_fork_in_child(_new_lock_in_child)


def _compile(seccomp_plan: SeccompPlan) -> _Compiled:
    with _LIBSECCOMP_LOCK:
        if _exiting:
            raise HostError(
                "no seccomp filter is built while the process exits",
                hint="nothing to do: the sandbox that needed it is not started",
            )
        return _compile_unlocked(seccomp_plan)


def _compile_unlocked(seccomp_plan: SeccompPlan) -> _Compiled:
    """Build the filter with libseccomp and export it as raw BPF.

    Raises:
        HostError: libseccomp cannot be loaded, or refuses the filter.
    """
    seccomp = _pyseccomp()
    ops = {
        "EQ": seccomp.EQ,
        "NE": seccomp.NE,
        "GE": seccomp.GE,
        "MASKED_EQ": seccomp.MASKED_EQ,
    }
    try:
        native = int(seccomp.system_arch())
        arch = _arch_name(seccomp, native)
        # s390 swaps clone's first two arguments (CONFIG_CLONE_BACKWARDS2).
        rules = _rules(seccomp_plan, clone_flags_arg=1 if arch in ("s390", "s390x") else 0)
        syscall_filter = seccomp.SyscallFilter(seccomp.ALLOW)
        bad_arch_action = _set_bad_arch_action(seccomp, syscall_filter)
        skipped: dict[str, str] = {}
        added: list[str] = []
        for rule in rules:
            number = _syscall_number(seccomp, rule.syscall, arch)
            if isinstance(number, str):
                skipped[rule.syscall] = number
                continue
            args = [
                seccomp.Arg(c.arg, ops[c.op], c.mask, c.value)
                if c.op == "MASKED_EQ"
                else seccomp.Arg(c.arg, ops[c.op], c.value)
                for c in rule.conditions
            ]
            syscall_filter.add_rule(seccomp.ERRNO(rule.errno), number, *args)
            added.append(rule.describe())
        with os.fdopen(os.memfd_create("codecage-seccomp", os.MFD_CLOEXEC), "w+b") as out:
            syscall_filter.export_bpf(out)  # libseccomp writes to the fd, not the buffer
            out.seek(0)
            program = out.read()
    except OSError as exc:
        raise HostError(
            f"libseccomp {_libseccomp_version()} could not build the seccomp filter: {exc}",
            hint="upgrade libseccomp to 2.5 or newer (Debian: libseccomp2), "
            "or run `codecage doctor` to see what this host provides",
        ) from exc
    for name, why in skipped.items():
        # A syscall of other architectures leaves nothing open here; one that this
        # libseccomp does not know may exist in the running kernel and is then allowed.
        level = logging.DEBUG if why.startswith("not a syscall") else logging.WARNING
        log.log(level, "seccomp rule skipped", extra={"syscall": name, "reason": why})
    log.debug(
        "seccomp filter compiled for %s (%d BPF instructions): %s",
        arch,
        len(program) // 8,
        "; ".join(added),
        extra={
            "arch": arch,
            "bad_arch_action": bad_arch_action,
            "rules": added,
            "skipped": skipped,
            "bpf_instructions": len(program) // 8,
        },
    )
    return _Compiled(
        program=program,
        arch=arch,
        bad_arch_action=bad_arch_action,
        skipped=tuple(skipped.items()),
    )


# --- public verbs -------------------------------------------------------------------------


def compile_bpf(seccomp_plan: SeccompPlan) -> bytes:
    """The filter as a raw BPF program (an array of struct sock_filter, 8 bytes each, in
    host byte order): what bubblewrap reads from its --seccomp file descriptor.

    Rules for syscalls that libseccomp cannot name on this architecture are left out, with
    a WARNING log; `skipped_syscalls` lists them.

    Raises:
        HostError: libseccomp cannot be loaded (hint: install libseccomp2) or refuses the
            filter.
    """
    return _compile(seccomp_plan).program


_OCI_OPS = {
    "EQ": "SCMP_CMP_EQ",
    "NE": "SCMP_CMP_NE",
    "GE": "SCMP_CMP_GE",
    "MASKED_EQ": "SCMP_CMP_MASKED_EQ",
}


def oci_profile(seccomp_plan: SeccompPlan, *, arch: str = "x86_64") -> dict[str, Any]:
    """The same rules as an OCI `linux.seccomp` profile (for runtimes that take rules, not
    BPF: gVisor's runsc with --oci-seccomp). Pure. Everything not named is allowed; calls
    of another ABI are not covered (the OCI profile names one architecture, the runtime's
    answer to others is its own). MASKED_EQ is libseccomp's: `value` the mask, `valueTwo`
    the datum.
    """
    oci_arch = {"x86_64": "SCMP_ARCH_X86_64", "aarch64": "SCMP_ARCH_AARCH64"}[arch]
    syscalls: list[dict[str, Any]] = []
    for rule in _rules(seccomp_plan, clone_flags_arg=0):
        entry: dict[str, Any] = {
            "names": [rule.syscall],
            "action": "SCMP_ACT_ERRNO",
            "errnoRet": rule.errno,
        }
        if rule.conditions:
            entry["args"] = [
                {
                    "index": c.arg,
                    "op": _OCI_OPS[c.op],
                    "value": c.mask if c.op == "MASKED_EQ" else c.value,
                    "valueTwo": c.value if c.op == "MASKED_EQ" else 0,
                }
                for c in rule.conditions
            ]
        syscalls.append(entry)
    return {"defaultAction": "SCMP_ACT_ALLOW", "architectures": [oci_arch], "syscalls": syscalls}


def skipped_syscalls(seccomp_plan: SeccompPlan) -> tuple[str, ...]:
    """Syscalls that `compile_bpf(seccomp_plan)` leaves out of the filter on this host:
    unknown to this libseccomp, or not syscalls of this architecture. Empty on x86_64
    with libseccomp 2.5 or newer.

    Raises:
        HostError: libseccomp cannot be loaded or refuses the filter.
    """
    return tuple(name for name, _ in _compile(seccomp_plan).skipped)


def probe() -> LayerStatus:
    """Whether this host can build the seccomp filter, and what the filter denies.

    Active means libseccomp compiled the default (no network) filter here and the kernel
    has seccomp; `codecage doctor` proves in a real sandbox that it is enforced.

    Raises:
        Nothing: a missing libseccomp or kernel support is reported as an inactive layer.
    """
    default = plan()
    try:
        compiled = _compile(default)
    except HostError as err:
        return LayerStatus(
            name="seccomp", active=False, mechanism="seccomp-bpf", detail=f"{err}; {err.hint}"
        )
    mechanism = f"seccomp-bpf (libseccomp {_libseccomp_version()})"
    if not _kernel_has_seccomp():
        return LayerStatus(
            name="seccomp",
            active=False,
            mechanism=mechanism,
            detail="the kernel has no seccomp support (CONFIG_SECCOMP)",
        )
    detail = (
        f"EPERM for {', '.join(default.denied_syscalls)}; "
        f"EPERM for clone with {'/'.join(_CLONE_NAMESPACE_FLAGS)}, "
        f"ioctl {'/'.join(_TERMINAL_INJECTION_IOCTLS)}, "
        "personality flags from ADDR_NO_RANDOMIZE up, "
        f"{', '.join(name for name, _ in default.setid_mode_args)} "
        f"with {'/'.join(_SETID_BITS)} in the mode, "
        "socket/socketpair other than AF_UNIX (with egress: other than AF_UNIX, AF_INET, "
        "AF_INET6); "
        f"ENOSYS for {', '.join(default.enosys_syscalls)}; "
        f"a syscall through an ABI other than {compiled.arch} (on x86_64: i386, x32): "
        f"{compiled.bad_arch_action}; "
        f"BPF program of {len(compiled.program) // 8} instructions"
    )
    if compiled.skipped:
        detail += "; left out: " + ", ".join(f"{name} ({why})" for name, why in compiled.skipped)
    return LayerStatus(name="seccomp", active=True, mechanism=mechanism, detail=detail)


def _kernel_has_seccomp() -> bool:
    # /proc/self/status has a "Seccomp:" line when the kernel is built with CONFIG_SECCOMP;
    # distribution kernels build filter mode (CONFIG_SECCOMP_FILTER) with it.
    try:
        with open("/proc/self/status", encoding="utf-8") as status:
            return any(line.startswith("Seccomp:") for line in status)
    except OSError:
        return False
