"""Requirement: the syscalls a guest must never reach, written down here by hand.

This list is not read from codecage.isolation.seccomp: a test generated from the deny-list
itself shrinks with it, so removing an entry there went unnoticed (issue 25). Each entry says
why the syscall is denied and carries its x86_64 number from the kernel's table
(arch/x86/entry/syscalls/syscall_64.tbl), not from libseccomp, so that the check in the real
sandbox does not depend on the code under test to find the call either.

Two checks: the plan (every listed syscall is in the deny-list, on every kind of run); and,
on x86_64, the real filter in a real sandbox: the guest invokes each syscall with -1 for
every argument and must get EPERM. Without the filter the same call fails differently
(EBADF, EFAULT, EINVAL...) or, for a call that needs a capability, with EPERM too: for
those the plan check is what fails when the entry is removed.
"""

from __future__ import annotations

import errno
import platform
from collections.abc import Iterator
from typing import Any

import pytest

from codecage import Options, Sandbox
from codecage.isolation.seccomp import SeccompPlan, plan

# name -> (x86_64 number, why a contained guest must not have it)
MUST_BE_DENIED: dict[str, tuple[int, str]] = {
    # Reaching into another process (memory, registers, fds): the classic escape route.
    "ptrace": (101, "reads and writes another process's memory and registers"),
    "process_vm_readv": (310, "reads another process's memory"),
    "process_vm_writev": (311, "writes another process's memory"),
    "process_madvise": (440, "advises on (reclaims, pages out) another process's memory"),
    "kcmp": (312, "compares kernel objects of two processes: an address-layout oracle"),
    "pidfd_getfd": (438, "copies a file descriptor out of another process"),
    # Changing the mount tree bubblewrap built (old and new mount APIs).
    "mount": (165, "remounts or adds filesystems"),
    "umount2": (166, "unmounts what hides the host"),
    "pivot_root": (155, "changes the root filesystem"),
    "chroot": (161, "changes the root directory"),
    "fsopen": (430, "new mount API: opens a filesystem context"),
    "fsconfig": (431, "new mount API: configures a filesystem context"),
    "fsmount": (432, "new mount API: creates a mount"),
    "fspick": (433, "new mount API: reconfigures an existing mount"),
    "move_mount": (429, "new mount API: attaches or moves a mount"),
    "open_tree": (428, "new mount API: clones a mount tree"),
    "open_tree_attr": (467, "new mount API: clones a mount tree with new attributes"),
    "mount_setattr": (442, "changes mount attributes (read-only, nosuid, idmap)"),
    # New namespaces hand out every capability inside them.
    "unshare": (272, "creates namespaces (a user namespace: all capabilities in it)"),
    "setns": (308, "joins another namespace"),
    # Subsystems that keep producing privilege escalations.
    "bpf": (321, "eBPF programs and maps"),
    "perf_event_open": (298, "perf events: a long CVE history, side channels"),
    "userfaultfd": (323, "widens kernel race windows for exploits"),
    "io_uring_setup": (425, "io_uring: a long CVE history, bypasses syscall filtering"),
    "io_uring_enter": (426, "io_uring"),
    "io_uring_register": (427, "io_uring"),
    # Keyrings are not namespaced.
    "keyctl": (250, "the host user's kernel keys"),
    "add_key": (248, "the host user's kernel keys"),
    "request_key": (249, "the host user's kernel keys"),
    # Loading or replacing kernel code.
    "kexec_load": (246, "boots another kernel"),
    "kexec_file_load": (320, "boots another kernel"),
    "init_module": (175, "loads a kernel module"),
    "finit_module": (313, "loads a kernel module"),
    "delete_module": (176, "unloads a kernel module"),
    # Whole-machine state.
    "reboot": (169, "reboots or halts the machine"),
    "swapon": (167, "adds swap"),
    "swapoff": (168, "removes swap"),
    "acct": (163, "switches process accounting"),
    "quotactl": (179, "disk quotas"),
    "quotactl_fd": (443, "disk quotas"),
    "syslog": (103, "the kernel log (addresses, other users' activity)"),
    "iopl": (172, "raw I/O port access"),
    "ioperm": (173, "raw I/O port access"),
    "vhangup": (153, "hangs up the session's terminal"),
    # The clock is not namespaced.
    "settimeofday": (164, "sets the host's clock"),
    "clock_settime": (227, "sets the host's clock"),
    "clock_adjtime": (305, "adjusts the host's clock"),
    "adjtimex": (159, "adjusts the host's clock"),
    # File handles bypass path lookup, and with it the mount tree ("shocker").
    "open_by_handle_at": (304, "opens host files by handle, outside the mount tree"),
    "name_to_handle_at": (303, "makes the handles open_by_handle_at takes"),
    # Obsolete interfaces nothing needs.
    "uselib": (134, "obsolete: loads a shared library the old way"),
    "ustat": (136, "obsolete: filesystem statistics"),
    "sysfs": (139, "obsolete: filesystem type information"),
    "_sysctl": (156, "obsolete: binary sysctl"),
    "nfsservctl": (180, "obsolete: the kernel NFS server's control"),
    "lookup_dcookie": (212, "obsolete: oprofile's directory cookies"),
    # NUMA placement moves pages of this or other processes: a noisy-neighbour tool.
    "mbind": (237, "NUMA memory placement"),
    "set_mempolicy": (238, "NUMA memory placement"),
    "set_mempolicy_home_node": (450, "NUMA memory placement"),
    "migrate_pages": (256, "moves another process's pages between nodes"),
    "move_pages": (279, "moves another process's pages between nodes"),
}

# What a fork server's template must still do itself (it makes each run's namespaces and
# mounts); every run's own processes install the full filter on top.
TEMPLATE_MAY_USE = frozenset({"unshare", "mount", "move_mount"})

# Invoked with every argument -1 so that, if the filter let one through, the kernel refuses
# it for a bad fd, pointer or flag before it changes anything (tests/test_seccomp.py does
# the same on the bare host).
GUEST = """
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
answers = {}
for name, number in NUMBERS.items():
    ctypes.set_errno(0)
    back = libc.syscall(ctypes.c_long(number), *[ctypes.c_long(-1)] * 6)
    answers[name] = [back, ctypes.get_errno()]
answers
"""


@pytest.mark.parametrize("name", sorted(MUST_BE_DENIED))
def test_the_plan_denies_each_required_syscall_on_every_kind_of_run(name: str) -> None:
    why = MUST_BE_DENIED[name][1]
    for network in (False, True):
        assert name in plan(network=network).denied_syscalls, f"{name}: {why}"
    if name not in TEMPLATE_MAY_USE:
        assert name in plan(template=True).denied_syscalls, f"{name}: {why}"


@pytest.fixture(scope="module")
def guest_answers() -> Iterator[dict[str, Any]]:
    if platform.machine() != "x86_64":
        pytest.skip("the syscall numbers written here are x86_64's; the plan check stands")
    numbers = {name: number for name, (number, _) in MUST_BE_DENIED.items()}
    with Sandbox(pool=False, options=Options(import_policy=False, scrub=False)) as box:
        result = box.run(f"NUMBERS = {numbers!r}\n{GUEST}", limits={"timeout": 60})
    assert result.status == "ok", (result.error, result.stderr)
    answers: dict[str, Any] = result.return_value
    yield answers


@pytest.mark.parametrize("name", sorted(MUST_BE_DENIED))
def test_the_guest_gets_eperm_for_each_required_syscall(
    name: str, guest_answers: dict[str, Any]
) -> None:
    back, err = guest_answers[name]
    assert (back, errno.errorcode.get(err, err)) == (-1, "EPERM"), MUST_BE_DENIED[name][1]


def test_a_mode_rule_may_name_any_of_the_six_syscall_arguments() -> None:
    # The kernel passes six arguments (0 to 5); a rule on any of them is valid, none beyond.
    for index in range(6):
        SeccompPlan((), (), allow_inet_sockets=False, setid_mode_args=(("chmod", index),))
    for index in (-1, 6):
        with pytest.raises(ValueError, match="0 to 5"):
            SeccompPlan((), (), allow_inet_sockets=False, setid_mode_args=(("chmod", index),))
