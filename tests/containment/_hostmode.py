"""What the containment suite cannot show when codecage runs as an ordinary user, by test name.

As root on this host, codecage has writable cgroups and mounts a tmpfs per workspace. An
ordinary user has neither (cgroup v1 belongs to root; v2 only where a subtree is delegated),
and codecage falls back to rlimits and a plain directory, as `codecage info` says. Each
entry below is a limit that fallback cannot keep: a strict xfail, only for a non-root run
and only while the mechanism is missing, so the test keeps running and must keep failing
(an XPASS says the line is stale). docs/security-model.md says the same to users.

`NULL_BASELINE_HOLDS` is the other side: tests whose null runner (no isolation at all)
cannot fail as an ordinary user, because the host itself refuses the thing to a non-root
process. Their null case is skipped as non-root, with that reason; the sandboxed case runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

Missing = Literal["cgroup", "tmpfs"]

_RLIMIT_AS = "no cgroup as non-root: RLIMIT_AS stands in, per process"

NONROOT_GAPS: dict[str, tuple[Missing, str]] = {
    "test_a_memory_bomb_ends_as_memory_limit": (
        "cgroup",
        f"{_RLIMIT_AS}; the bomb gets MemoryError, but no peak memory is measured",
    ),
    "test_memory_held_in_tmpfs_or_memfd_counts_against_the_limit": (
        "cgroup",
        f"{_RLIMIT_AS}; tmpfs and memfd pages are not address space (RLIMIT_FSIZE stops them)",
    ),
    "test_kernel_memory_of_many_empty_files_counts_against_the_limit": (
        "cgroup",
        f"{_RLIMIT_AS}; kernel memory (inodes, dentries) is not counted at all",
    ),
    "test_the_limit_is_for_the_sandbox_as_a_whole_not_per_process": (
        "cgroup",
        f"{_RLIMIT_AS}: processes that each stay under it are not limited together",
    ),
    "test_peak_memory_is_reported_and_below_the_limit": (
        "cgroup",
        "no cgroup as non-root: the sandbox's peak memory cannot be measured (usage is None)",
    ),
    "test_cpu_time_is_summed_over_every_process_of_the_run": (
        "cgroup",
        "no cgroup as non-root: RLIMIT_CPU is per process and the run's CPU time is not summed",
    ),
    "test_writing_past_workspace_mb_gives_enospc": (
        "tmpfs",
        "no tmpfs mount as non-root: the workspace is a plain directory, workspace_mb is not "
        "enforced (max_file_size_mb still bounds each file)",
    ),
    "test_a_full_workspace_leaves_a_workspace_full_event": (
        "tmpfs",
        "no tmpfs mount as non-root: the workspace is a plain directory that does not fill up",
    ),
}

_HOST_REFUSES = "as non-root the host itself refuses this, so the null baseline cannot fail"

NULL_BASELINE_HOLDS: dict[str, str] = {
    # By test name (every parameter), or by the full item name (one parameter).
    "test_nothing_can_be_created_outside_workspace_and_tmp": (
        f"{_HOST_REFUSES}: / and the system directories are root's"
    ),
    "test_host_kernel_settings_under_proc_sys_cannot_be_written": (
        f"{_HOST_REFUSES}: /proc/sys is writable by root only"
    ),
    "test_the_code_runs_as_an_unprivileged_user_and_group": (
        f"{_HOST_REFUSES}: the test runner is already an unprivileged user"
    ),
    "test_rlimit_nproc_applies_to_the_sandbox_user": (
        f"{_HOST_REFUSES}: the kernel applies RLIMIT_NPROC to every user but root"
    ),
    "test_a_socket_of_a_network_family_cannot_be_created[null-AF_PACKET-SOCK_RAW-0]": (
        f"{_HOST_REFUSES}: packet sockets need CAP_NET_RAW"
    ),
}


def null_baseline_holds() -> dict[str, str]:
    """`NULL_BASELINE_HOLDS`, and what this host's settings add to it."""
    found = dict(NULL_BASELINE_HOLDS)
    try:
        userfaultfd = Path("/proc/sys/vm/unprivileged_userfaultfd").read_text().strip()
    except OSError:
        userfaultfd = ""
    if userfaultfd == "0":
        name = "test_a_denied_syscall_fails_with_eperm_and_the_process_carries_on"
        found[f"{name}[null-userfaultfd]"] = (
            f"{_HOST_REFUSES}: vm.unprivileged_userfaultfd is 0 on this host"
        )
    return found
