"""Seccomp layer, seen through a real sandbox: the denied syscalls fail with EPERM and the
process carries on (tests/test_seccomp.py tests the filter on its own).

Each call is made with ctypes' `syscall()` and the x86_64 numbers, with arguments chosen so
that the host kernel, without the filter, answers something other than EPERM (ESRCH,
EFAULT, EBADF, EINVAL, ENOSYS, or success) and changes nothing, even as root: so on the
null runner each test fails, as it must.
"""

from __future__ import annotations

import platform

import pytest

from ._support import Runner, guest, report

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(platform.machine() != "x86_64", reason="x86_64 syscall numbers"),
]

CLONE_NEWUSER = 0x10000000
SIGCHLD = 17
PTRACE_PEEKUSER = 3
KEXEC_BAD_FLAG = 0x100  # neither a KEXEC_* flag nor an architecture: EINVAL

# name -> (number, arguments); "PID" / "PPID" are replaced by the guest's own pids.
SYSCALLS: dict[str, tuple[int, tuple[int | str, ...]]] = {
    "ptrace": (101, (PTRACE_PEEKUSER, "PPID", 0, 0)),  # host: ESRCH (not our tracee)
    "mount": (165, (0, 0, 0, 0, 0)),  # host: EFAULT
    "unshare": (272, (0,)),  # host: 0 (no flags: does nothing)
    "setns": (308, (-1, 0)),  # host: EBADF
    "bpf": (321, (0x7FFF, 0, 0)),  # host: EINVAL (no such command)
    "perf_event_open": (298, (0, 0, -1, -1, 0)),  # host: EFAULT
    "keyctl": (250, (0x7FFF, 0, 0, 0, 0)),  # host: EOPNOTSUPP
    "add_key": (248, (0, 0, 0, 0, 0)),  # host: EFAULT
    "userfaultfd": (323, (0,)),  # host: a new fd
    "process_vm_readv": (310, ("PID", 0, 0, 0, 0, 0)),  # host: 0 (nothing to copy)
    "kexec_load": (246, (0, 1000, 0, KEXEC_BAD_FLAG)),  # host: EINVAL or ENOSYS
    "init_module": (175, (0, 0, 0)),  # host: ENOEXEC or ENOSYS
    "open_by_handle_at": (304, (-1, 0, 0)),  # host: EFAULT
    "io_uring_setup": (425, (0, 0)),  # host: EFAULT
    "clone_newuser": (56, (CLONE_NEWUSER | SIGCHLD, 0, 0, 0, 0)),  # host: a child
}

PROBE = """
import ctypes, errno, json, os
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
values = {"PID": os.getpid(), "PPID": os.getppid()}
args = [ctypes.c_long(values.get(a, a)) for a in $args]
ctypes.set_errno(0)
rc = libc.syscall(ctypes.c_long($number), *args)
err = ctypes.get_errno()
if rc == 0 and $number == 56:
    os._exit(0)  # the child of a clone that went through (null runner only)
if rc > 0 and $number == 56:
    os.waitpid(rc, 0)
print(json.dumps([rc, errno.errorcode.get(err, err) if rc == -1 else None]))
"""


@pytest.mark.parametrize("name", list(SYSCALLS))
def test_a_denied_syscall_fails_with_eperm_and_the_process_carries_on(
    runner: Runner, name: str
) -> None:
    number, args = SYSCALLS[name]
    seen = runner(guest(PROBE, number=number, args=list(args)), timeout=10)
    assert seen.status == "ok", seen.stderr
    assert report(seen) == [-1, "EPERM"]


def test_the_process_carries_on_after_many_denied_syscalls(runner: Runner) -> None:
    # Every denied call, one after the other, in one process: none of them kills it.
    code = guest(
        """
        import ctypes, errno, json, os
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall.restype = ctypes.c_long
        values = {"PID": os.getpid(), "PPID": os.getppid()}
        answers = {}
        for name, (number, args) in $syscalls.items():
            if number == 56:
                continue  # a clone that went through would fork this loop
            ctypes.set_errno(0)
            rc = libc.syscall(ctypes.c_long(number),
                              *[ctypes.c_long(values.get(a, a)) for a in args])
            answers[name] = errno.errorcode.get(ctypes.get_errno()) if rc == -1 else rc
        print(json.dumps(answers))
        """,
        syscalls=SYSCALLS,
    )
    seen = runner(code, timeout=10)
    assert seen.status == "ok"
    assert report(seen) == {name: "EPERM" for name in SYSCALLS if name != "clone_newuser"}
