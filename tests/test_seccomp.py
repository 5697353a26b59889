"""codecage.isolation.seccomp: the plan (pure), the compiled program, and the filter loaded
for real into a child process, which then shows what the kernel refuses.

Each child is `sys.executable -c BOOT`: it installs the BPF program exactly as bubblewrap
does (PR_SET_NO_NEW_PRIVS, then PR_SET_SECCOMP with a struct sock_fprog) and runs a probe
program. The same probes run without the filter too, to show that the answers come from
the filter and not from the host (a test that cannot fail proves nothing).

Most probes pass -1 for every argument: should the filter let such a call through, the
kernel refuses it for a bad pointer, fd or flag before it changes anything, even as root.
The S_ISUID/S_ISGID probes are real calls on files in a directory of their own, and the
test then looks at what is left in it.
"""

from __future__ import annotations

import errno
import json
import os
import platform
import signal
import socket
import stat
import subprocess
import sys
import termios
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyseccomp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from codecage.errors import HostError
from codecage.isolation import seccomp
from codecage.isolation.seccomp import SeccompPlan, compile_bpf, plan, probe, skipped_syscalls

U64 = 2**64 - 1
X86_64 = platform.machine() == "x86_64"

CLONE_NAMESPACE_FLAGS = {
    "CLONE_NEWTIME": 0x00000080,
    "CLONE_NEWNS": 0x00020000,
    "CLONE_NEWCGROUP": 0x02000000,
    "CLONE_NEWUTS": 0x04000000,
    "CLONE_NEWIPC": 0x08000000,
    "CLONE_NEWUSER": 0x10000000,
    "CLONE_NEWPID": 0x20000000,
    "CLONE_NEWNET": 0x40000000,
}
CLONE_FS = 0x00000200
CLONE_VFORK = 0x00004000
ADDR_NO_RANDOMIZE = 0x0040000
PR_GET_SECCOMP = 21
SECCOMP_MODE_FILTER = 2
SETID_BITS = stat.S_ISUID | stat.S_ISGID

# Every syscall that can give a file or directory S_ISUID/S_ISGID, with its mode argument.
SETID_MODE_ARGS = {
    "chmod": 1,
    "fchmod": 1,
    "fchmodat": 2,
    "fchmodat2": 2,
    "open": 2,
    "openat": 3,
    "creat": 1,
    "mkdir": 1,
    "mkdirat": 2,
    "mknod": 1,
    "mknodat": 2,
}

REQUIRED_DENIALS = [
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "mount",
    "umount2",
    "pivot_root",
    "chroot",
    "unshare",
    "setns",
    "bpf",
    "perf_event_open",
    "keyctl",
    "add_key",
    "request_key",
    "kexec_load",
    "kexec_file_load",
    "init_module",
    "finit_module",
    "delete_module",
    "reboot",
    "swapon",
    "swapoff",
    "userfaultfd",
    "open_by_handle_at",
    "name_to_handle_at",
    "acct",
    "settimeofday",
    "clock_settime",
    "clock_adjtime",
    "adjtimex",
    "syslog",
    "quotactl",
    "lookup_dcookie",
    "iopl",
    "ioperm",
    "vhangup",
    "uselib",
    "ustat",
    "sysfs",
    "_sysctl",
    "nfsservctl",
    "kcmp",
    "pidfd_getfd",
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    "fsopen",
    "fsconfig",
    "fsmount",
    "fspick",
    "move_mount",
    "open_tree",
    "mount_setattr",
    "mbind",
    "set_mempolicy",
    "migrate_pages",
    "move_pages",
]


def _syscall_numbers() -> dict[str, int]:
    """Native syscall numbers, from libseccomp's table (the one the filter is built from)."""
    names = {
        *plan().denied_syscalls,
        *plan().enosys_syscalls,
        *SETID_MODE_ARGS,
        "clone",
        "socket",
        "socketpair",
        "ioctl",
        "personality",
        "getpid",
    }
    numbers = {}
    for name in names:
        number = int(pyseccomp.resolve_syscall(pyseccomp.Arch.NATIVE, name))
        if number < 0:
            number = seccomp._UNIFIED_SYSCALL_NUMBERS.get(name, -1)
        if number >= 0:
            numbers[name] = number
    return numbers


NR = _syscall_numbers()

BOOT = r"""
import ctypes, json, os, resource, sys

resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # a SIGSYS death must leave no core file
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
NR = json.loads(sys.argv[2])


def ulong(value):
    return ctypes.c_ulong(value & 0xFFFFFFFFFFFFFFFF)


def sc(name, *args):
    "Raw syscall: its return value, or -errno."
    ctypes.set_errno(0)
    ret = libc.syscall(ctypes.c_long(NR[name]), *[ulong(a) for a in args])
    return -ctypes.get_errno() if ret == -1 else ret


def install(path):
    with open(path, "rb") as f:
        program = f.read()

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    buf = ctypes.create_string_buffer(program, len(program))
    fprog = SockFprog(len(program) // 8, ctypes.addressof(buf))
    if libc.prctl(38, ulong(1), ulong(0), ulong(0), ulong(0)) != 0:  # PR_SET_NO_NEW_PRIVS
        raise OSError(ctypes.get_errno(), "PR_SET_NO_NEW_PRIVS")
    # PR_SET_SECCOMP, SECCOMP_MODE_FILTER
    if libc.prctl(22, ulong(2), ctypes.byref(fprog), ulong(0), ulong(0)) != 0:
        raise OSError(ctypes.get_errno(), "PR_SET_SECCOMP")


if sys.argv[1]:
    install(sys.argv[1])
exec(sys.argv[3])
"""

# The probes' errno of a raw syscall's return, of one that returns an fd (closed), and of
# a Python call (py).
ERRNO_OF = """

def err(ret):
    return -ret if ret < 0 else 0


def closed(ret):
    if ret >= 0:
        os.close(ret)
    return err(ret)


def py(fn):
    try:
        fn()
    except OSError as exc:
        return exc.errno
    return 0
"""

# Runs every probe once and prints {probe: errno, 0 when the call succeeded}.
PROBES = (
    r"""
import socket, subprocess, threading
"""
    + ERRNO_OF
    + r"""

def libc_errno(fn, *args):
    ctypes.set_errno(0)
    return ctypes.get_errno() if fn(*args) == -1 else 0


def clone(flags):
    # Without CLONE_VM a raw clone is a fork: a child that got through exits at once.
    pid = sc("clone", flags, 0, 0, 0, 0)
    if pid == 0:
        os._exit(0)
    if pid > 0:
        os.waitpid(pid, 0)
    return err(pid)


def fork_and_wait():
    pid = os.fork()
    if pid == 0:
        os._exit(7)
    if os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) != 7:
        raise OSError(0, "forked child did not exit 7")


def thread():
    box = []
    t = threading.Thread(target=box.append, args=(1,))
    t.start()
    t.join()
    if box != [1]:
        raise OSError(0, "thread did not run")


def spawn():
    pid = os.posix_spawn("/bin/true", ["true"], {})
    if os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) != 0:
        raise OSError(0, "/bin/true failed")


def read_file():
    with open("/proc/self/status", encoding="utf-8") as f:
        if "Seccomp" not in f.read():
            raise OSError(0, "unexpected /proc/self/status")


def socketpair(family):
    fds = (ctypes.c_int * 2)()
    ret = sc("socketpair", family, socket.SOCK_STREAM, 0, ctypes.addressof(fds))
    if ret == 0:
        os.close(fds[0])
        os.close(fds[1])
    return err(ret)


def ioctl(request):
    r, w = os.pipe()
    try:
        return err(sc("ioctl", r, request, ctypes.addressof(ctypes.c_char(b"x"))))
    finally:
        os.close(r)
        os.close(w)


results = {"seccomp_mode": libc.prctl(21, ulong(0), ulong(0), ulong(0), ulong(0))}
for name in SWEEP:
    results["sweep:" + name] = err(sc(name, -1, -1, -1, -1, -1, -1))
results.update(
    socket_inet=py(lambda: socket.socket(socket.AF_INET, socket.SOCK_STREAM).close()),
    socket_inet6=py(lambda: socket.socket(socket.AF_INET6, socket.SOCK_STREAM).close()),
    socket_netlink=closed(sc("socket", socket.AF_NETLINK, socket.SOCK_RAW, 0)),
    socket_unix=py(lambda: socket.socket(socket.AF_UNIX, socket.SOCK_STREAM).close()),
    socketpair_unix=socketpair(socket.AF_UNIX),
    socketpair_inet=socketpair(socket.AF_INET),
    ptrace_libc=libc_errno(libc.ptrace, 2, os.getpid(), 0, 0),  # PTRACE_PEEKDATA
    mount_libc=libc_errno(libc.mount, None, None, None, ulong(0), None),
    keyctl_invalid=err(sc("keyctl", 99999, 0, 0, 0, 0)),
    unshare_invalid=libc_errno(libc.unshare, CLONE_VFORK),  # no namespace flag at all
    clone_newns_with_fs=clone(CLONE_NEWNS | CLONE_FS | SIGCHLD),
    clone_plain=clone(SIGCHLD),
    clone3_invalid=err(sc("clone3", -1, -1)),
    ioctl_tiocsti=ioctl(TIOCSTI),
    ioctl_tiocsti_upper_bits=ioctl(TIOCSTI | 1 << 32),
    ioctl_tioclinux=ioctl(TIOCLINUX),
    ioctl_fionread=ioctl(FIONREAD),
    personality_linux=err(sc("personality", 0)),
    personality_no_randomize=err(sc("personality", ADDR_NO_RANDOMIZE)),
    read_file=py(read_file),
    fork=py(fork_and_wait),
    thread=py(thread),
    posix_spawn=py(spawn),
    subprocess=py(lambda: subprocess.run(["/bin/true"], check=True)),
)
# Last: these really create namespaces when nothing stops them.
results["clone_newuser"] = clone(CLONE_NEWUSER | SIGCHLD)
results["unshare_newuser"] = libc_errno(libc.unshare, CLONE_NEWUSER)
print(json.dumps(results))
"""
)

PROBE_CONSTANTS = {
    "CLONE_FS": CLONE_FS,
    "CLONE_VFORK": CLONE_VFORK,
    "CLONE_NEWNS": CLONE_NAMESPACE_FLAGS["CLONE_NEWNS"],
    "CLONE_NEWUSER": CLONE_NAMESPACE_FLAGS["CLONE_NEWUSER"],
    "SIGCHLD": int(signal.SIGCHLD),
    "TIOCSTI": termios.TIOCSTI,
    "TIOCLINUX": termios.TIOCLINUX,
    "FIONREAD": termios.FIONREAD,
    "ADDR_NO_RANDOMIZE": ADDR_NO_RANDOMIZE,
}

# A long-lived child for hypothesis: one JSON request per line, one errno per line.
SERVE = r"""
for line in sys.stdin:
    op, *args = json.loads(line)
    if op == "socket":
        ret = sc("socket", *args)
        if ret >= 0:
            os.close(ret)
    elif op == "socketpair":
        fds = (ctypes.c_int * 2)()
        ret = sc("socketpair", *args, ctypes.addressof(fds))
        if ret == 0:
            os.close(fds[0])
            os.close(fds[1])
    elif op == "clone":
        ret = sc("clone", args[0], 0, 0, 0, 0)
        if ret == 0:
            os._exit(0)
        if ret > 0:
            os.waitpid(ret, 0)
    elif op == "ioctl":
        r, w = os.pipe()
        ret = sc("ioctl", r, args[0], ctypes.addressof(ctypes.c_char(b"x")))
        os.close(r)
        os.close(w)
    elif op == "personality":
        ret = sc("personality", args[0])
        sc("personality", 0)
    elif op == "chmod":
        # Made anew each time: the last accepted mode may have made it anything.
        with open("serve-chmod-target", "w", encoding="utf-8"):
            pass
        ret = sc("chmod", ctypes.addressof(CHMOD_TARGET), args[0])
    elif op == "openat":
        ret = sc("openat", -100, ctypes.addressof(CREATED), os.O_CREAT | os.O_WRONLY, args[0])
        if ret >= 0:
            os.close(ret)
            os.unlink("serve-created")
    print(-ret if ret < 0 else 0, flush=True)
"""
SERVE = (
    'CHMOD_TARGET = ctypes.create_string_buffer(b"serve-chmod-target")\n'
    'CREATED = ctypes.create_string_buffer(b"serve-created")\n' + SERVE
)

# Sets S_ISUID, S_ISGID, both or neither through every call that can, each on a name of
# its own in the current directory, and prints {"<call>_<variant>": errno, 0 on success}.
SETID_PROBES = (
    r"""
import stat

AT_FDCWD = -100
CREATE = os.O_CREAT | os.O_WRONLY
MODES = {"setuid": 0o4755, "setgid": 0o2755, "both": 0o6755, "plain": 0o755}
c_strings = []  # keeps each path alive while a raw syscall reads it


def c_path(name):
    buf = ctypes.create_string_buffer(name.encode())
    c_strings.append(buf)
    return ctypes.addressof(buf)
"""
    + ERRNO_OF
    + r"""

def touch(name):
    with open(name, "w", encoding="utf-8"):
        pass
    return name


def py_fchmod(name, mode):
    fd = os.open(touch(name), os.O_RDONLY)
    try:
        os.fchmod(fd, mode)
    finally:
        os.close(fd)


def sys_fchmod(name, mode):
    fd = os.open(touch(name), os.O_RDONLY)
    try:
        return err(sc("fchmod", fd, mode))
    finally:
        os.close(fd)


def python_open():
    with open("python-open.txt", "w", encoding="utf-8") as f:
        f.write("written")
    with open("python-open.txt", encoding="utf-8") as f:
        if f.read() != "written":
            raise OSError(0, "python-open.txt does not read back")


CALLS = {
    "py_chmod": lambda n, m: py(lambda: os.chmod(touch(n), m)),
    "py_fchmod": lambda n, m: py(lambda: py_fchmod(n, m)),
    "py_open": lambda n, m: py(lambda: os.close(os.open(n, CREATE, m))),
    "py_mkdir": lambda n, m: py(lambda: os.mkdir(n, m)),
    "chmod": lambda n, m: err(sc("chmod", c_path(touch(n)), m)),
    "fchmod": sys_fchmod,
    "fchmodat": lambda n, m: err(sc("fchmodat", AT_FDCWD, c_path(touch(n)), m)),
    "fchmodat2": lambda n, m: err(sc("fchmodat2", AT_FDCWD, c_path(touch(n)), m, 0)),
    "open": lambda n, m: closed(sc("open", c_path(n), CREATE, m)),
    "openat": lambda n, m: closed(sc("openat", AT_FDCWD, c_path(n), CREATE, m)),
    "creat": lambda n, m: closed(sc("creat", c_path(n), m)),
    "mkdir": lambda n, m: err(sc("mkdir", c_path(n), m)),
    "mkdirat": lambda n, m: err(sc("mkdirat", AT_FDCWD, c_path(n), m)),
    "mknod": lambda n, m: err(sc("mknod", c_path(n), stat.S_IFREG | m, 0)),
    "mknodat": lambda n, m: err(sc("mknodat", AT_FDCWD, c_path(n), stat.S_IFREG | m, 0)),
}
results = {}
for call, fn in CALLS.items():
    if call.startswith("py_") or call in NR:
        for variant, mode in MODES.items():
            results[f"{call}_{variant}"] = fn(f"{call}_{variant}", mode)
# openat2(AT_FDCWD, path, NULL, 0): the kernel alone says EINVAL (size 0), and creates nothing.
results["openat2"] = err(sc("openat2", AT_FDCWD, c_path("openat2"), 0, 0))
results["python_open"] = py(python_open)
print(json.dumps(results))
"""
)
SETID_CALLS = ["py_chmod", "py_fchmod", "py_open", "py_mkdir", *SETID_MODE_ARGS]

X32_GETPID = r"""
print(libc.syscall(ctypes.c_long(0x40000000 | NR["getpid"])))  # __X32_SYSCALL_BIT
"""

I386_GETPID = r"""
import mmap
code = bytes([0xB8, 0x14, 0, 0, 0, 0xCD, 0x80, 0xC3])  # mov eax, 20 (i386 getpid); int 0x80; ret
page = mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
page.write(code)
function = ctypes.CFUNCTYPE(ctypes.c_int)(ctypes.addressof(ctypes.c_char.from_buffer(page)))
print(function(), os.getpid())
"""


def run_child(program: str, bpf: Path | None, cwd: Path) -> subprocess.CompletedProcess[str]:
    """Run `program` in a fresh interpreter, under the filter in `bpf` when given.

    Its own session: no controlling terminal, so that vhangup and TIOCSTI have none to touch.
    """
    return subprocess.run(
        [sys.executable, "-c", BOOT, str(bpf or ""), json.dumps(NR), program],
        capture_output=True,
        text=True,
        encoding="utf-8",
        timeout=60,
        cwd=cwd,
        env={"PATH": os.defpath},
        start_new_session=True,
        check=False,
    )


def probes_program() -> str:
    constants = "".join(f"{k} = {v!r}\n" for k, v in PROBE_CONSTANTS.items())
    sweep = [name for name in plan().denied_syscalls if name in NR]
    return f"{constants}SWEEP = {sweep!r}\n{PROBES}"


def run_probes(bpf: Path | None, cwd: Path) -> dict[str, int]:
    done = run_child(probes_program(), bpf, cwd)
    assert done.returncode == 0, done.stderr
    results: dict[str, int] = json.loads(done.stdout)
    return results


class Server:
    """A child that has installed a filter and answers syscall requests over a pipe."""

    def __init__(self, bpf: Path, cwd: Path) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", BOOT, str(bpf), json.dumps(NR), SERVE],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            encoding="utf-8",
            cwd=cwd,
            env={"PATH": os.defpath},
            start_new_session=True,
        )

    def errno_of(self, *request: Any) -> int:
        assert self.proc.stdin is not None
        assert self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        answer = self.proc.stdout.readline()
        assert answer, f"the filtered child died: exit {self.proc.wait()}"
        return int(answer)

    def close(self) -> None:
        assert self.proc.stdin is not None
        assert self.proc.stdout is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=10)
        self.proc.stdout.close()


# --- fixtures -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("seccomp")


@pytest.fixture(scope="module")
def default_bpf(workdir: Path) -> Path:
    path = workdir / "default.bpf"
    path.write_bytes(compile_bpf(plan()))
    return path


@pytest.fixture(scope="module")
def network_bpf(workdir: Path) -> Path:
    path = workdir / "network.bpf"
    path.write_bytes(compile_bpf(plan(network=True)))
    return path


@pytest.fixture(scope="module")
def filtered(default_bpf: Path, workdir: Path) -> dict[str, int]:
    return run_probes(default_bpf, workdir)


@pytest.fixture(scope="module")
def bare(workdir: Path) -> dict[str, int]:
    return run_probes(None, workdir)


def run_setid_probes(bpf: Path | None, cwd: Path) -> dict[str, int]:
    cwd.mkdir()
    done = run_child(SETID_PROBES, bpf, cwd)
    assert done.returncode == 0, done.stderr
    results: dict[str, int] = json.loads(done.stdout)
    return results


def setid_entries(directory: Path) -> dict[str, str]:
    """Entries of `directory` (lstat, not followed) that have S_ISUID or S_ISGID: their modes."""
    found = {}
    for entry in directory.iterdir():
        mode = entry.lstat().st_mode
        if mode & SETID_BITS:
            found[entry.name] = oct(mode)
    return found


@pytest.fixture(scope="module")
def setid_filtered_dir(default_bpf: Path, workdir: Path) -> Path:
    return workdir / "setid-filtered"


@pytest.fixture(scope="module")
def setid_filtered(default_bpf: Path, setid_filtered_dir: Path) -> dict[str, int]:
    return run_setid_probes(default_bpf, setid_filtered_dir)


@pytest.fixture(scope="module")
def setid_bare_dir(workdir: Path) -> Path:
    return workdir / "setid-bare"


@pytest.fixture(scope="module")
def setid_bare(setid_bare_dir: Path) -> dict[str, int]:
    return run_setid_probes(None, setid_bare_dir)


@pytest.fixture(scope="module")
def server(default_bpf: Path, workdir: Path) -> Iterator[Server]:
    child = Server(default_bpf, workdir)
    yield child
    child.close()


@pytest.fixture(scope="module")
def network_server(network_bpf: Path, workdir: Path) -> Iterator[Server]:
    child = Server(network_bpf, workdir)
    yield child
    child.close()


# --- the plan (pure) ----------------------------------------------------------------------


def test_default_plan_denies_every_syscall_the_design_names() -> None:
    missing = set(REQUIRED_DENIALS) - set(plan().denied_syscalls)
    assert not missing


def test_inet_sockets_are_allowed_only_when_the_run_declares_network() -> None:
    assert plan().allow_inet_sockets is False
    assert plan(network=True).allow_inet_sockets is True


def test_clone3_and_openat2_answer_enosys_so_that_libc_falls_back() -> None:
    assert plan().enosys_syscalls == ("clone3", "openat2")
    for name in ("clone3", "openat2", "clone", "openat"):
        assert name not in plan().denied_syscalls


def test_plan_refuses_setuid_and_setgid_modes_in_every_call_that_sets_a_mode() -> None:
    assert dict(plan().setid_mode_args) == SETID_MODE_ARGS
    assert plan(network=True).setid_mode_args == plan().setid_mode_args


def test_a_mode_rule_for_a_syscall_refused_outright_is_refused() -> None:
    with pytest.raises(ValueError, match="chmod"):
        SeccompPlan(("chmod",), (), allow_inet_sockets=False, setid_mode_args=(("chmod", 1),))
    with pytest.raises(ValueError, match="0 to 5"):
        SeccompPlan((), (), allow_inet_sockets=False, setid_mode_args=(("chmod", 6),))


def test_read_only_get_mempolicy_stays_allowed() -> None:
    assert "get_mempolicy" not in plan().denied_syscalls
    assert "set_mempolicy" in plan().denied_syscalls


def test_plan_names_each_syscall_once() -> None:
    names = plan().denied_syscalls + plan().enosys_syscalls
    assert len(names) == len(set(names))


def test_plan_is_pure_and_hashable() -> None:
    assert plan() == plan()
    assert hash(plan(network=True)) == hash(plan(network=True))
    assert plan() != plan(network=True)


def test_a_syscall_cannot_be_both_denied_and_answered_enosys() -> None:
    with pytest.raises(ValueError, match="clone3"):
        SeccompPlan(("clone3",), ("clone3",), allow_inet_sockets=False, setid_mode_args=())


# --- the compiled program -----------------------------------------------------------------


def test_compiled_program_is_a_whole_number_of_sock_filter_instructions() -> None:
    program = compile_bpf(plan())
    assert len(program) > 0
    assert len(program) % 8 == 0


def test_compiling_twice_gives_the_same_program() -> None:
    assert compile_bpf(plan()) == compile_bpf(plan())


def test_network_plan_compiles_to_a_different_program() -> None:
    assert compile_bpf(plan(network=True)) != compile_bpf(plan())


@pytest.mark.skipif(not X86_64, reason="which syscalls exist depends on the architecture")
def test_no_denied_syscall_is_left_out_of_the_filter_on_x86_64() -> None:
    assert skipped_syscalls(plan()) == ()
    assert skipped_syscalls(plan(network=True)) == ()


@pytest.mark.skipif(not X86_64, reason="the fallback numbers are checked on x86_64")
def test_fallback_syscall_numbers_agree_with_libseccomp() -> None:
    checked = 0
    for name, number in seccomp._UNIFIED_SYSCALL_NUMBERS.items():
        known = int(pyseccomp.resolve_syscall(pyseccomp.Arch.NATIVE, name))
        if known >= 0:
            assert known == number, name
            checked += 1
    assert checked >= 10


def test_a_missing_libseccomp_raises_host_error_naming_libseccomp2(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No host without libseccomp can be made here; None in sys.modules is how Python
    itself makes an import fail, which is what pyseccomp does when libseccomp is absent."""
    monkeypatch.setitem(sys.modules, "pyseccomp", None)
    with pytest.raises(HostError) as caught:
        compile_bpf(plan())
    assert "libseccomp" in str(caught.value)
    assert "libseccomp2" in caught.value.hint


# --- probe --------------------------------------------------------------------------------


def test_probe_reports_seccomp_active_with_the_libseccomp_version() -> None:
    status = probe()
    assert status.name == "seccomp"
    assert status.active is True
    assert status.mechanism.startswith("seccomp-bpf (libseccomp ")
    assert status.mechanism[len("seccomp-bpf (libseccomp ") : -1].count(".") == 2
    for word in (
        "ptrace",
        "mount",
        "clone3",
        "openat2",
        "AF_UNIX",
        "TIOCSTI",
        "fchmodat2",
        "S_ISUID/S_ISGID",
        "KILL_PROCESS",
    ):
        assert word in status.detail


def test_probe_reports_the_layer_inactive_without_libseccomp(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """See test_a_missing_libseccomp_raises_host_error_naming_libseccomp2 for the import."""
    monkeypatch.setitem(sys.modules, "pyseccomp", None)
    status = probe()
    assert status.active is False
    assert "libseccomp2" in status.detail


# The interpreter's exit while a daemon thread (a warm pool's starter) compiles a filter.
# The child wraps libseccomp's seccomp_release to see, rather than crash on, a release of
# the filter the thread is building (it does not free that one for real), and holds the
# thread inside the compile until the exit hooks have had their chance to free it.
EXIT_DURING_COMPILE = """
import atexit, json, threading
import pyseccomp
from codecage.errors import HostError
from codecage.isolation import seccomp

real_release = pyseccomp._libseccomp.seccomp_release
building, freed_in_use = [], []
compiling, freed, go = threading.Event(), threading.Event(), threading.Event()

def release(pointer):
    if pointer in building and not go.is_set():
        freed_in_use.append(pointer)
        freed.set()
        return None
    return real_release(pointer)

pyseccomp._libseccomp.seccomp_release = release  # what pyseccomp's finalizers then call
real_set = seccomp._set_bad_arch_action

def set_then_wait(module, syscall_filter):
    building.append(syscall_filter._filter)
    compiling.set()
    go.wait()
    return real_set(module, syscall_filter)

seccomp._set_bad_arch_action = set_then_wait
programs = []
compiler = threading.Thread(
    target=lambda: programs.append(seccomp.compile_bpf(seccomp.plan())), daemon=True
)
compiler.start()
compiling.wait()
exiting = threading.Thread(target=atexit._run_exitfuncs)  # what the exit runs, in order
exiting.start()
freed.wait(timeout=3)  # only bounds how long a release under the compile is looked for
go.set()
compiler.join()
exiting.join()
try:
    seccomp.compile_bpf(seccomp.plan(network=True))
    after = "compiled"
except HostError as exc:
    after = str(exc)
print(json.dumps({"freed_in_use": len(freed_in_use), "compiled": len(programs), "after": after}))
"""


def test_the_exit_never_frees_a_filter_a_thread_is_compiling() -> None:
    """pyseccomp frees filters with weakref.finalize, whose atexit hook frees every live
    one: a `codecage serve` exiting on a configuration error while a pool starter compiled
    its first filter crashed with SIGSEGV (a few exits in a hundred). The exit now waits
    for the compile, and refuses later ones (HostError, which a starter survives)."""
    done = subprocess.run(
        [sys.executable, "-c", EXIT_DURING_COMPILE],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    outcome = json.loads(done.stdout)
    assert outcome["freed_in_use"] == 0
    assert outcome["compiled"] == 1  # the compile under way finished, with its filter whole
    assert outcome["after"] == "no seccomp filter is built while the process exits"


FORK_DURING_COMPILE = """
import os, threading
from codecage.isolation import seccomp

held, done = threading.Event(), threading.Event()

def hold():
    with seccomp._LIBSECCOMP_LOCK:  # as a thread compiling a filter at the fork
        held.set()
        done.wait()

threading.Thread(target=hold, daemon=True).start()
held.wait()
pid = os.fork()
if pid == 0:
    os._exit(0 if seccomp._LIBSECCOMP_LOCK.acquire(timeout=10) else 1)
done.set()
print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
"""


def test_a_forked_child_has_a_lock_of_its_own() -> None:
    """The exit hook above takes the compile lock: a child forked while a thread of the
    parent held it (a pre-forking server's worker) would otherwise hang at its exit."""
    done = subprocess.run(
        [sys.executable, "-c", FORK_DURING_COMPILE], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "0"


# --- the filter in a real kernel ----------------------------------------------------------


def test_the_filter_is_in_force_in_the_child(
    filtered: dict[str, int], bare: dict[str, int]
) -> None:
    assert filtered["seccomp_mode"] == SECCOMP_MODE_FILTER
    assert bare["seccomp_mode"] == 0


@pytest.mark.parametrize("name", plan().denied_syscalls)
def test_denied_syscall_fails_with_eperm(name: str, filtered: dict[str, int]) -> None:
    if name not in NR:
        pytest.skip(f"{name} is not a syscall on {platform.machine()}")
    assert filtered[f"sweep:{name}"] == errno.EPERM


def test_inet_socket_is_denied_with_eperm(filtered: dict[str, int]) -> None:
    assert filtered["socket_inet"] == errno.EPERM
    assert filtered["socket_inet6"] == errno.EPERM
    assert filtered["socket_netlink"] == errno.EPERM
    assert filtered["socketpair_inet"] == errno.EPERM


def test_unix_socket_and_socketpair_still_work(filtered: dict[str, int]) -> None:
    assert filtered["socket_unix"] == 0
    assert filtered["socketpair_unix"] == 0


def test_creating_a_user_namespace_is_denied_with_eperm(filtered: dict[str, int]) -> None:
    assert filtered["unshare_newuser"] == errno.EPERM
    assert filtered["clone_newuser"] == errno.EPERM


def test_ptrace_mount_and_keyctl_through_libc_are_denied_with_eperm(
    filtered: dict[str, int],
) -> None:
    assert filtered["ptrace_libc"] == errno.EPERM
    assert filtered["mount_libc"] == errno.EPERM
    assert filtered["keyctl_invalid"] == errno.EPERM
    assert filtered["unshare_invalid"] == errno.EPERM


def test_clone3_fails_with_enosys(filtered: dict[str, int]) -> None:
    assert filtered["clone3_invalid"] == errno.ENOSYS


def test_open_read_fork_threads_and_spawn_still_work(filtered: dict[str, int]) -> None:
    # Threads and posix_spawn go through glibc's clone3 first: this proves the fallback.
    for probe_name in ("read_file", "fork", "clone_plain", "thread", "posix_spawn", "subprocess"):
        assert filtered[probe_name] == 0, probe_name


def test_terminal_injection_ioctls_are_denied_even_with_upper_bits_set(
    filtered: dict[str, int],
) -> None:
    assert filtered["ioctl_tiocsti"] == errno.EPERM
    assert filtered["ioctl_tiocsti_upper_bits"] == errno.EPERM
    assert filtered["ioctl_tioclinux"] == errno.EPERM


def test_other_ioctls_still_work(filtered: dict[str, int]) -> None:
    assert filtered["ioctl_fionread"] == 0


def test_personality_flags_that_weaken_aslr_are_denied(filtered: dict[str, int]) -> None:
    assert filtered["personality_no_randomize"] == errno.EPERM
    assert filtered["personality_linux"] == 0


# --- S_ISUID and S_ISGID -------------------------------------------------------------------


@pytest.mark.parametrize("call", SETID_CALLS)
@pytest.mark.parametrize("variant", ["setuid", "setgid", "both"])
def test_setting_setuid_or_setgid_fails_with_eperm(
    call: str, variant: str, setid_filtered: dict[str, int]
) -> None:
    if not call.startswith("py_") and call not in NR:
        pytest.skip(f"{call} is not a syscall on {platform.machine()}")
    assert setid_filtered[f"{call}_{variant}"] == errno.EPERM


def test_the_same_calls_without_setuid_or_setgid_still_work(
    setid_filtered: dict[str, int], setid_filtered_dir: Path
) -> None:
    plain = {key: answer for key, answer in setid_filtered.items() if key.endswith("_plain")}
    assert len(plain) >= 4
    assert all(answer == 0 for answer in plain.values()), plain
    assert stat.S_IMODE((setid_filtered_dir / "py_chmod_plain").stat().st_mode) == 0o755
    assert (setid_filtered_dir / "py_mkdir_plain").is_dir()
    assert (setid_filtered_dir / "py_open_plain").is_file()


def test_the_filter_leaves_no_setuid_or_setgid_file_behind(
    setid_filtered: dict[str, int], setid_filtered_dir: Path
) -> None:
    assert setid_filtered  # the probes have run
    assert setid_entries(setid_filtered_dir) == {}
    # Creation was refused, not done without the bits.
    assert not (setid_filtered_dir / "py_open_setuid").exists()
    assert not (setid_filtered_dir / "py_mkdir_setgid").exists()


def test_openat2_answers_enosys_and_python_open_still_works(
    setid_filtered: dict[str, int], setid_bare: dict[str, int]
) -> None:
    assert setid_filtered["openat2"] == errno.ENOSYS
    assert setid_bare["openat2"] == errno.EINVAL
    assert setid_filtered["python_open"] == 0


def test_without_the_filter_the_same_child_can_make_a_setuid_file(
    setid_bare: dict[str, int], setid_bare_dir: Path
) -> None:
    # Every call the filter refuses succeeds here: the EPERM comes from the filter alone.
    refused_under_the_filter = {
        key: answer for key, answer in setid_bare.items() if not key.endswith("_plain")
    }
    del refused_under_the_filter["openat2"], refused_under_the_filter["python_open"]
    assert set(refused_under_the_filter.values()) == {0}, refused_under_the_filter
    for key in ("py_chmod_setuid", "py_fchmod_setuid", "py_open_setuid", "chmod_setuid"):
        assert (setid_bare_dir / key).lstat().st_mode & stat.S_ISUID, key
    assert (setid_bare_dir / "py_chmod_setgid").lstat().st_mode & stat.S_ISGID


# --- without the filter: the same child, other answers --------------------------------------


def test_without_the_filter_the_same_child_can_create_an_inet_socket(
    bare: dict[str, int],
) -> None:
    assert bare["socket_inet"] == 0
    assert bare["socket_netlink"] == 0


def test_without_the_filter_the_same_calls_fail_otherwise_than_eperm(
    bare: dict[str, int],
) -> None:
    # The kernel checks these arguments before any privilege, as root or not.
    expected = {
        "sweep:mount": errno.EFAULT,
        "sweep:umount2": errno.EINVAL,
        "sweep:unshare": errno.EINVAL,
        "sweep:setns": errno.EBADF,
        "sweep:ptrace": errno.ESRCH,
        "sweep:keyctl": errno.EOPNOTSUPP,
        "sweep:process_vm_readv": errno.EINVAL,
        "sweep:perf_event_open": errno.EINVAL,
        "sweep:name_to_handle_at": errno.EINVAL,
        "ptrace_libc": errno.ESRCH,
        "mount_libc": errno.EFAULT,
        "keyctl_invalid": errno.EOPNOTSUPP,
        "unshare_invalid": errno.EINVAL,
        "clone_newns_with_fs": errno.EINVAL,
        "clone3_invalid": errno.E2BIG,
        "ioctl_tiocsti": errno.ENOTTY,
        "ioctl_tiocsti_upper_bits": errno.ENOTTY,
        "socketpair_inet": errno.EOPNOTSUPP,
        "personality_no_randomize": 0,
    }
    assert {name: bare[name] for name in expected} == expected


def test_the_filter_changes_every_answer_that_the_kernel_alone_gives_otherwise(
    filtered: dict[str, int], bare: dict[str, int]
) -> None:
    sweep = [key for key in bare if key.startswith("sweep:")]
    decided_by_filter = [key for key in sweep if bare[key] != errno.EPERM]
    assert len(decided_by_filter) >= 10
    assert all(filtered[key] == errno.EPERM for key in decided_by_filter)
    assert filtered["clone_newns_with_fs"] == errno.EPERM


# --- other ABIs of the CPU ----------------------------------------------------------------


@pytest.mark.skipif(not X86_64, reason="x32 is an x86_64 ABI")
def test_an_x32_syscall_kills_the_process(default_bpf: Path, workdir: Path) -> None:
    without = run_child(X32_GETPID, None, workdir)
    assert without.returncode == 0, without.stderr  # ENOSYS or a pid: the kernel answers
    under = run_child(X32_GETPID, default_bpf, workdir)
    assert under.returncode == -signal.SIGSYS
    assert under.stdout == ""


@pytest.mark.skipif(not X86_64, reason="int 0x80 is the i386 ABI of x86_64")
def test_an_i386_syscall_kills_the_process(default_bpf: Path, workdir: Path) -> None:
    without = run_child(I386_GETPID, None, workdir)
    if without.returncode != 0:
        pytest.skip(f"this kernel runs no i386 syscalls (exit {without.returncode})")
    pid, own_pid = without.stdout.split()
    assert pid == own_pid  # int 0x80 really is a syscall here
    under = run_child(I386_GETPID, default_bpf, workdir)
    assert under.returncode == -signal.SIGSYS
    assert under.stdout == ""


# --- properties, against the live filter --------------------------------------------------

FAMILIES = st.one_of(st.integers(0, 64), st.integers(0, U64))
NETWORK_FAMILIES = (socket.AF_UNIX, socket.AF_INET, socket.AF_INET6)


@settings(max_examples=150, deadline=None)
@given(family=FAMILIES, call=st.sampled_from(["socket", "socketpair"]))
def test_any_socket_family_but_af_unix_is_denied(server: Server, family: int, call: str) -> None:
    answer = server.errno_of(call, family, socket.SOCK_DGRAM, 0)
    if family == socket.AF_UNIX:
        assert answer != errno.EPERM
    else:
        assert answer == errno.EPERM


@settings(max_examples=150, deadline=None)
@given(family=FAMILIES, call=st.sampled_from(["socket", "socketpair"]))
def test_with_network_only_unix_inet_and_inet6_families_are_allowed(
    network_server: Server, family: int, call: str
) -> None:
    answer = network_server.errno_of(call, family, socket.SOCK_DGRAM, 0)
    if family in NETWORK_FAMILIES:
        assert answer != errno.EPERM
    else:
        assert answer == errno.EPERM


@settings(max_examples=60, deadline=None)
@given(protocol=st.one_of(st.integers(0, 32), st.integers(0, U64)))
def test_with_network_every_netlink_socket_is_denied(network_server: Server, protocol: int) -> None:
    answer = network_server.errno_of("socket", socket.AF_NETLINK, socket.SOCK_DGRAM, protocol)
    assert answer == errno.EPERM


@settings(max_examples=60, deadline=None)
@given(flags=st.sets(st.sampled_from(sorted(CLONE_NAMESPACE_FLAGS.values())), min_size=1))
def test_clone_with_any_namespace_flag_is_denied(server: Server, flags: set[int]) -> None:
    assert server.errno_of("clone", sum(flags) | signal.SIGCHLD) == errno.EPERM


@settings(max_examples=60, deadline=None)
@given(upper=st.integers(0, 2**32 - 1), request=st.sampled_from(["TIOCSTI", "TIOCLINUX"]))
def test_terminal_injection_ioctls_are_denied_whatever_the_upper_32_bits(
    server: Server, upper: int, request: str
) -> None:
    assert server.errno_of("ioctl", upper << 32 | getattr(termios, request)) == errno.EPERM


@settings(max_examples=60, deadline=None)
@given(persona=st.integers(ADDR_NO_RANDOMIZE, U64))
def test_personality_from_addr_no_randomize_up_is_denied(server: Server, persona: int) -> None:
    assert server.errno_of("personality", persona) == errno.EPERM


@settings(max_examples=60, deadline=None)
@given(persona=st.integers(0, ADDR_NO_RANDOMIZE - 1))
def test_personality_below_addr_no_randomize_is_allowed(server: Server, persona: int) -> None:
    assert server.errno_of("personality", persona) == 0


@settings(max_examples=100, deadline=None)
@given(
    mode=st.one_of(st.integers(0, 0o7777), st.integers(0, U64)),
    call=st.sampled_from(["chmod", "openat"]),
)
def test_a_mode_is_refused_exactly_when_it_has_setuid_or_setgid_whatever_its_upper_bits(
    server: Server, mode: int, call: str
) -> None:
    answer = server.errno_of(call, mode)
    assert answer == (errno.EPERM if mode & SETID_BITS else 0)
